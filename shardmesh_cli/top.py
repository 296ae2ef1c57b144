"""`shardmesh top`: the mesh at a glance, redrawn every `--interval` seconds (ANSI clear + redraw).

Where the numbers come from: the coordinator's topology (`GetTopology`: stages, layers, tp ranks,
states, and each worker's `metrics` label, the address of its Prometheus endpoint) and the
services' `/metrics` (workers: memory, links, steps; the gateway, when `--gateway-metrics` is
given: requests, tokens, latency). A frame compares two scrapes `--interval` apart: rates are over
that window; latency percentiles and totals are since each service started. `--once` prints one
frame (after one window) without escape codes and exits.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shardmesh.rpc.flags import EXIT_USAGE, add_client_tls_flags

BAR = 20  # memory bar width
BAR_CHARS = (("weights", "#"), ("kv_cache", "="), ("other", "."))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator (its topology lists the workers)")
    p.add_argument("--gateway-metrics", metavar="HOST:PORT", help="the gateway's metrics endpoint (--metrics-port)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames, and the rate window (2)")
    p.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each service (default 2)")
    add_client_tls_flags(p)


# -- scraping ----------------------------------------------------------------------------------------------


@dataclass
class Metrics:
    """One scrape: sample name -> [(labels, value)]."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        from prometheus_client.parser import text_string_to_metric_families

        out = cls()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return out

    def get(self, name: str, **labels: str) -> float | None:
        """The sum over samples whose labels include `labels`; None when there is none."""
        values = [v for lab, v in self.samples.get(name, ()) if all(lab.get(k) == w for k, w in labels.items())]
        return sum(values) if values else None

    def value(self, name: str, **labels: str) -> float:
        return self.get(name, **labels) or 0.0

    def label(self, name: str, key: str) -> str:
        return next((lab.get(key, "") for lab, _ in self.samples.get(name, ())), "")

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """Cumulative (upper bound, count) pairs of histogram `name`, summed over its other labels."""
        acc: dict[float, float] = {}
        for lab, v in self.samples.get(f"{name}_bucket", ()):
            le = float(lab["le"])
            acc[le] = acc.get(le, 0.0) + v
        return sorted(acc.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Like PromQL's histogram_quantile: linear within the bucket holding rank q·count."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def scrape(address: str, timeout: float) -> Metrics | str:
    """The metrics at http://address/metrics, or why not (a string)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
            return Metrics.parse(r.read().decode())
    except (OSError, ValueError) as e:
        return f"unreachable: {e}"


@dataclass
class Snapshot:
    at: float  # monotonic
    wall: float
    topology: Any = None  # shardmesh.core.topology.Topology
    error: str = ""
    workers: dict[str, Metrics | str] = field(default_factory=dict)
    gateway: Metrics | str | None = None


def collect(coordinator: str, gateway_metrics: str | None, timeout: float, tls: Any = None) -> Snapshot:
    """`tls`: the `shardmesh.rpc.tls.TlsFiles` of a mesh with mutual TLS (the /metrics endpoints are plain HTTP)."""
    import grpc

    from shardmesh.core.topology import Topology
    from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
    from shardmesh.rpc.tls import channel as connect

    snap = Snapshot(time.monotonic(), time.time())
    try:
        with connect(coordinator, tls) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            snap.topology = Topology.from_pb(stub.GetTopology(coordinator_pb2.GetTopologyRequest(), timeout=timeout))
    except grpc.RpcError as e:
        snap.error = f"coordinator {coordinator}: {e.code().name}: {e.details()}"
    if snap.topology is not None:
        from shardmesh.rpc.telemetry import METRICS_LABEL

        for _, shard in snap.topology.shards():
            if shard.vacant:
                continue
            address = shard.label(METRICS_LABEL)
            snap.workers[shard.worker_id] = scrape(address, timeout) if address else "no metrics (--metrics-port 0)"
    if gateway_metrics:
        snap.gateway = scrape(gateway_metrics, timeout)
    return snap


# -- rendering ---------------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _delta(cur: Metrics, prev: Metrics | str | None, name: str, **labels: str) -> float:
    before = prev.value(name, **labels) if isinstance(prev, Metrics) else 0.0
    return max(0.0, cur.value(name, **labels) - before)


def _bar(parts: list[tuple[str, float]], scale: float) -> str:
    cells, used = [], 0
    for char, value in parts:
        n = round(BAR * value / scale) if scale > 0 else 0
        n = min(n, BAR - used)
        cells.append(char * n)
        used += n
    return "[" + "".join(cells) + " " * (BAR - used) + "]"


def _worker_rows(cur: Snapshot, prev: Snapshot | None, dt: float) -> list[list[str]]:
    topology = cur.topology
    memory: dict[str, dict[str, float]] = {}
    for worker_id, m in cur.workers.items():
        if isinstance(m, Metrics):
            memory[worker_id] = {k: m.value("shardmesh_shard_memory_bytes", kind=k) for k, _ in BAR_CHARS}
    scale = max((sum(v.values()) for v in memory.values()), default=0.0)
    rows = []
    for stage, shard in topology.shards():
        row = [shard.worker_id or "(vacant)", str(stage.index), f"{stage.layer_start}-{stage.layer_end - 1}",
               str(shard.tp_rank), shard.state.value]  # fmt: skip
        m = cur.workers.get(shard.worker_id)
        if not isinstance(m, Metrics):
            rows.append([*row, m or "", "", "", "", "", "", "", ""])
            continue
        old = prev.workers.get(shard.worker_id) if prev is not None else None
        mem = memory[shard.worker_id]
        bar = _bar([(c, mem[k]) for k, c in BAR_CHARS], scale)
        rss = m.value("shardmesh_process_resident_memory_bytes")
        bytes_in = _delta(m, old, "shardmesh_link_bytes_total", direction="received") / dt
        bytes_out = _delta(m, old, "shardmesh_link_bytes_total", direction="sent") / dt
        steps = _delta(m, old, "shardmesh_worker_step_seconds_count")
        step_s = _delta(m, old, "shardmesh_worker_step_seconds_sum")
        comm_s = sum(_delta(m, old, "shardmesh_worker_step_phase_seconds_total", phase=p)
                     for p in ("recv_wait", "send", "collective"))  # fmt: skip
        if steps:
            step = f"{step_s / steps * 1e3:.1f}"
            comm = f"{100 * comm_s / step_s:.0f}%" if step_s else "-"
        else:  # idle in this window: since start, in parentheses
            total, n = m.value("shardmesh_worker_step_seconds_sum"), m.value("shardmesh_worker_step_seconds_count")
            comm_total = sum(m.value("shardmesh_worker_step_phase_seconds_total", phase=p)
                             for p in ("recv_wait", "send", "collective"))  # fmt: skip
            step = f"({total / n * 1e3:.1f})" if n else "-"
            comm = f"({100 * comm_total / total:.0f}%)" if total else "-"
        rows.append([*row, f"{bar} {human_bytes(rss)}", human_bytes(mem["weights"]), human_bytes(mem["kv_cache"]),
                     f"{human_bytes(bytes_in)}/s", f"{human_bytes(bytes_out)}/s", comm, step,
                     f"{m.value('shardmesh_worker_step_seconds_count'):.0f}"])  # fmt: skip
    return rows


# A streaming worker's counters (`shardworker.metrics._offload`), and what each offload cell divides by.
OFFLOAD_COUNTERS = ("shardmesh_offload_streamed_bytes_total", "shardmesh_worker_step_tokens_total",
                    "shardmesh_offload_read_bytes_total", "shardmesh_offload_read_seconds_total",
                    "shardmesh_offload_wait_seconds_total", "shardmesh_worker_step_seconds_sum")  # fmt: skip


def _gb_s(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 1e9:.1f} GB/s"


def _offload_row(worker_id: str, m: Metrics, old: Metrics | str | None) -> list[str]:
    """Bytes streamed per token, the plan's per step, the achieved read rate, the bound, their ratio and the
    share of step time spent waiting for reads: over the window, or since start (in parentheses) when the
    shard ran no tokens in it."""
    window = {name: _delta(m, old, name) for name in OFFLOAD_COUNTERS}
    idle = not window["shardmesh_worker_step_tokens_total"]
    v = {name: m.value(name) for name in OFFLOAD_COUNTERS} if idle else window
    streamed, tokens, read, read_s, wait_s, step_s = (v[name] for name in OFFLOAD_COUNTERS)
    achieved = read / read_s if read_s else None
    bound = m.value("shardmesh_offload_bound_bytes_per_second") or None
    cells = [human_bytes(streamed / tokens) if tokens else "-", _gb_s(achieved),
             f"{achieved / bound:.2f}" if achieved and bound else "-",
             f"{100 * wait_s / step_s:.0f}%" if step_s else "-"]  # fmt: skip
    if idle:
        cells = [c if c == "-" else f"({c})" for c in cells]
    plan = human_bytes(m.value("shardmesh_offload_planned_bytes_per_step"))
    return [worker_id, cells[0], plan, cells[1], _gb_s(bound), cells[2], cells[3]]


def _offload_lines(cur: Snapshot, prev: Snapshot | None) -> list[str]:
    """The workers that stream layers (a memory budget), one row each; nothing when none does."""
    rows = []
    for worker_id, m in cur.workers.items():
        if isinstance(m, Metrics) and m.get("shardmesh_offload_planned_bytes_per_step") is not None:
            rows.append(_offload_row(worker_id, m, prev.workers.get(worker_id) if prev is not None else None))
    if not rows:
        return []
    header = ["OFFLOAD", "STREAMED/TOKEN", "PLAN/STEP", "ACHIEVED", "BOUND", "ACHIEVED/BOUND", "WAIT"]
    return ["", *_table(header, rows),
            "STREAMED/TOKEN: weight bytes streamed per token run (one sequence decoding: the plan's bytes per step); "
            "ACHIEVED: read bytes / read seconds; BOUND: the same reads measured at load, page cache hot (a cold "
            "file reads at the disk's rate); WAIT: share of step time waiting for reads"]  # fmt: skip


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _gateway_lines(address: str, cur: Metrics | str, prev: Metrics | str | None, dt: float) -> list[str]:
    if not isinstance(cur, Metrics):
        return [f"GATEWAY {address}  {cur}"]
    ready = "ready" if cur.value("shardmesh_mesh_ready") else "NOT READY"
    requests = cur.value("shardmesh_requests_total")
    tokens = cur.value("shardmesh_generated_tokens_total")
    batches = cur.value("shardmesh_batch_size_count")
    lines = [
        f"GATEWAY {address}  {ready}  queue {cur.value('shardmesh_queue_depth'):.0f}  "
        f"running {cur.value('shardmesh_running_requests'):.0f}  "
        f"free KV slots {cur.value('shardmesh_free_kv_slots'):.0f}",
        f"  requests {requests:.0f} ({_delta(cur, prev, 'shardmesh_requests_total') / dt:.2f}/s)   "
        f"tokens {tokens:.0f} ({_delta(cur, prev, 'shardmesh_generated_tokens_total') / dt:.1f}/s)   "
        f"steps {batches:.0f}, mean batch "
        + (f"{cur.value('shardmesh_batch_size_sum') / batches:.1f} sequences, "
           f"{cur.value('shardmesh_batch_tokens_sum') / batches:.1f} tokens" if batches else "-"),
    ]  # fmt: skip
    lines += _kv_block_lines(cur)
    header = ["  latency since start", "p50", "p90", "p99", "mean", "count"]
    rows = []
    for title, name in (("time to first token", "shardmesh_time_to_first_token_seconds"),
                        ("inter-token", "shardmesh_inter_token_latency_seconds"),
                        ("request", "shardmesh_request_duration_seconds"),
                        ("queue wait", "shardmesh_queue_wait_seconds"),
                        ("step (all shards)", "shardmesh_step_duration_seconds")):  # fmt: skip
        b, n = cur.buckets(name), cur.value(f"{name}_count")
        mean = cur.value(f"{name}_sum") / n if n else None
        rows.append([f"    {title}", *(_ms(quantile(q, b)) for q in (0.5, 0.9, 0.99)), _ms(mean), f"{n:.0f}"])
    return lines + _table(header, rows)


def _kv_block_lines(cur: Metrics) -> list[str]:
    """A paged mesh's KV blocks (the same ids on every shard: the gateway hands them out) and what prefix caching
    saved since the gateway started; nothing on a mesh of slots."""
    if cur.get("shardmesh_kv_blocks", state="used") is None:
        return []
    used, cached, free, reserved = (cur.value("shardmesh_kv_blocks", state=s) for s in ("used", "cached", "free",
                                                                                         "reserved"))  # fmt: skip
    total = used + cached + free
    lookups, hits = cur.value("shardmesh_prefix_cache_lookups_total"), cur.value("shardmesh_prefix_cache_hits_total")
    looked = cur.value("shardmesh_prefix_cache_tokens_looked_up_total")
    saved = cur.value("shardmesh_prefix_cache_tokens_saved_total")
    hit_rate = f"{100 * hits / lookups:.0f}% of {lookups:.0f} prompts" if lookups else "no prompt yet"
    share = f" ({100 * saved / looked:.0f}% of prompt tokens)" if looked else ""
    return [f"  KV blocks per shard {total:.0f} × {cur.value('shardmesh_kv_block_size'):.0f} tokens: used {used:.0f}, "
            f"cached {cached:.0f}, free {free:.0f} (reserved {reserved:.0f})   prefix hits {hit_rate}, "
            f"tokens saved {saved:.0f}{share}"]  # fmt: skip


def _workers_line(t: Any) -> str:
    """The rendezvous epoch and how many workers are spares, draining or lost (`shardmesh status` names them)."""
    states = [w.state.value for w in t.workers]
    return (f"epoch {t.epoch}  workers {len(states)}: {states.count('spare')} spare, "
            f"{states.count('draining')} draining, {states.count('lost')} lost")  # fmt: skip


def render(cur: Snapshot, prev: Snapshot | None, coordinator: str, gateway_metrics: str | None) -> str:
    dt = max(1e-6, cur.at - prev.at) if prev is not None else 1.0
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(cur.wall))
    if cur.topology is None:
        return f"shardmesh top  {stamp}\n{cur.error}\n"
    t = cur.topology
    state = "serving" if t.serving else ("complete, balance check " + t.calibration.status.value if t.complete
                                         else "NOT complete")  # fmt: skip
    c = t.calibration
    balance = f"  balance {c.stage_ratio:.2f}x ({c.status.value})" if c.stages else ""
    lines = [
        f"shardmesh top  coordinator {coordinator}  topology v{t.version} {state}  pp {t.pp} x tp {t.tp}  "
        f"{t.model.architecture} {t.model.num_layers} layers{balance}  {stamp}",
        _workers_line(t),
        f"rates over the last {dt:.1f} s; memory bar: # weights  = KV cache  . other (RSS - weights - KV), "
        "scaled to the largest worker",
        "",
    ]  # fmt: skip
    header = ["WORKER", "STAGE", "LAYERS", "TP", "STATE", "MEMORY" + " " * (BAR - 4) + "RSS", "WEIGHTS", "KV",
              "LINK IN", "LINK OUT", "COMM", "STEP ms", "STEPS"]  # fmt: skip
    lines += _table(header, _worker_rows(cur, prev, dt))
    lines.append("STEP ms: mean step time on the shard; COMM: its share spent receiving, sending and in tp "
                 "collectives; (...) = since start, no steps in this window")  # fmt: skip
    lines += _offload_lines(cur, prev)
    lines.append("")
    if gateway_metrics and cur.gateway is not None:
        lines += _gateway_lines(gateway_metrics, cur.gateway, prev.gateway if prev else None, dt)
    else:
        lines.append("GATEWAY  not shown: pass --gateway-metrics HOST:PORT (the gateway's --metrics-port)")
    return "\n".join(lines) + "\n"


def frame(coordinator: str, gateway_metrics: str | None, interval: float, timeout: float, tls: Any = None) -> str:
    """One frame over one window: two scrapes `interval` seconds apart."""
    prev = collect(coordinator, gateway_metrics, timeout, tls)
    time.sleep(interval)
    return render(collect(coordinator, gateway_metrics, timeout, tls), prev, coordinator, gateway_metrics)


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        print(f"error: --interval: must be > 0 seconds, got {args.interval}", file=sys.stderr)
        return EXIT_USAGE
    from shardmesh.rpc.tls import TlsError, from_args

    try:
        tls = from_args(args)
    except TlsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.once:
        sys.stdout.write(frame(args.coordinator, args.gateway_metrics, args.interval, args.timeout, tls))
        return 0
    prev = collect(args.coordinator, args.gateway_metrics, args.timeout, tls)
    try:
        while True:
            time.sleep(args.interval)
            cur = collect(args.coordinator, args.gateway_metrics, args.timeout, tls)
            sys.stdout.write("\x1b[H\x1b[2J" + render(cur, prev, args.coordinator, args.gateway_metrics))
            sys.stdout.flush()
            prev = cur
    except KeyboardInterrupt:
        return 0
