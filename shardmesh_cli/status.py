"""`shardmesh status`: the mesh as the coordinator sees it, once — placement, shard states, the workers beyond
the slots (spares, drains, lost ones) and the balance check (each stage's measured time and memory) — as a
table or, with `--json`, for tools.

Exit codes, for scripts: 0 the mesh serves (complete and its balance check passed), 1 it does not
(the output says why), 2 the coordinator could not be asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

import grpc

from shardmesh.core.heads import format_tp_split
from shardmesh.core.topology import CalibrationStatus, MeshWorker, ServingLimits, Topology, WorkerState
from shardmesh.core.units import format_bytes
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from shardmesh.rpc.flags import UsageError, add_client_tls_flags
from shardmesh.rpc.tls import TlsError, TlsFiles, channel, from_args

EXIT_SERVING, EXIT_NOT_SERVING, EXIT_UNREACHABLE = 0, 1, 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    p.add_argument("--json", action="store_true", help="print one JSON object: topology_version, epoch, "
                   "workers (each one's state and slot), then the topology and its balance check")  # fmt: skip
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the coordinator (default 5)")
    add_client_tls_flags(p)


def fetch(address: str, timeout: float, tls: TlsFiles | None = None) -> Topology:
    """The coordinator's topology (GetTopology needs no join token: a client certificate is enough under mTLS)."""
    with channel(address, tls) as ch:
        pb = coordinator_pb2_grpc.CoordinatorStub(ch).GetTopology(coordinator_pb2.GetTopologyRequest(),
                                                                  timeout=timeout)  # fmt: skip
    return Topology.from_pb(pb)


def _mib(n: int) -> str:
    return format_bytes(n) if n else "-"


def _split(shares: tuple[int, ...]) -> str:
    """How the MLP and the vocabulary are split when not evenly (`--tp-split`)."""
    return f" (MLP and vocabulary split {format_tp_split(shares)})" if shares else ""


def render(t: Topology) -> str:
    """The human-readable report: one header, the shards, the balance check."""
    c = t.calibration
    epoch = f"epoch {t.rendezvous.epoch}" if t.rendezvous is not None else "no rendezvous (slots vacant)"
    state = "serving" if t.serving else ("complete, not serving yet" if t.complete else "not complete")
    lim = t.limits
    lines = [
        f"topology v{t.version} ({epoch}): pp={t.pp} tp={t.tp}{_split(t.tp_split)}, {state}",
        f"model {t.model.path} ({t.model.dtype}{_quantized(t.model.quantization)}, {t.model.num_layers} layers); "
        f"{_kv(lim)}, {lim.max_batch_tokens} tokens per step",
        "",
        f"{'stage':>5}  {'layers':<12} {'rank':>4}  {'worker':<16} {'state':<10} address",
    ]
    for st, sh in t.shards():
        layers = f"{st.layer_start}-{st.layer_end - 1} ({st.num_layers})"
        lines.append(f"{st.index:>5}  {layers:<12} {sh.rank:>4}  {sh.worker_id or '(vacant)':<16} "
                     f"{sh.state.value:<10} {sh.address or '-'}")  # fmt: skip
    lines += _other_workers(t)
    verdict = "passed" if c.passed and t.rendezvous is not None and c.epoch == t.rendezvous.epoch else "not passed"
    lines += ["", f"balance check (epoch {c.epoch}): {c.status.value}, {verdict}"]
    if c.message:
        lines.append(f"  {c.message}")
    if c.stages:
        lines.append(f"  passes: decode {c.decode_batch} sequences × 1 token, prefill {c.prefill_tokens} tokens; "
                     f"stage ratio {c.stage_ratio:.2f}× (limit {c.max_stage_ratio:g}×); "
                     f"speed split {list(c.speed_split)}; re-splits so far {c.rebalances}")  # fmt: skip
        lines.append("")
        memory = f"{'rank':>4} {'memory':>11} {'peak':>11} {'weights':>11} {'KV cache':>11} {'device':>11}"
        lines.append(f"{'stage':>5}  {'layers':<12} {'decode ms':>9} {'of which layers':>15} {'prefill ms':>10}  "
                     f"{memory}")  # fmt: skip
        for s in c.stages:
            layers = f"{s.layer_start}-{s.layer_end - 1} ({s.num_layers})"
            for i, sh in enumerate(s.shards):
                head = (f"{s.index:>5}  {layers:<12} {s.decode_ms:>9.2f} {s.decode_layers_ms:>15.2f} "
                        f"{s.prefill_ms:>10.2f}") if i == 0 else " " * 55  # fmt: skip
                lines.append(f"{head}  {sh.rank:>4} {_mib(sh.memory_bytes):>11} {_mib(sh.peak_memory_bytes):>11} "
                             f"{_mib(sh.weights_bytes):>11} {_mib(sh.kv_cache_bytes):>11} "
                             f"{_mib(sh.device_memory_bytes):>11}")  # fmt: skip
    return "\n".join(lines)


def _kv(lim: ServingLimits) -> str:
    """The KV cache every shard holds: slots of a whole context, or blocks shared by up to kv_slots sequences."""
    if lim.paged:
        return (f"{lim.kv_blocks} KV blocks × {lim.kv_block_size} tokens ({lim.kv_slots} sequences, "
                f"{lim.max_context} tokens each at most)")  # fmt: skip
    return f"{lim.kv_slots} KV slots × {lim.max_context} tokens"


_OTHER_STATES = (WorkerState.SPARE, WorkerState.DRAINING, WorkerState.LOST)  # listed after the stages, in this order


def _other_workers(t: Topology) -> list[str]:
    """The workers besides those serving a slot: spares, drains (with what they wait for) and lost ones."""
    others = sorted((w for w in t.workers if w.state in _OTHER_STATES), key=lambda w: _OTHER_STATES.index(w.state))
    if not others:
        return []
    lines = ["", f"{'state':<8}  {'worker':<16} {'pid':>7}  {'address':<21} detail"]
    for w in others:
        detail = w.detail
        if not detail and w.state is WorkerState.SPARE and w.preparing_rank is not None and t.tp:
            detail = f"hot: holds stage {w.preparing_rank // t.tp} tp rank {w.preparing_rank % t.tp} ahead of need"
        lines.append(f"{w.state.value:<8}  {w.worker_id:<16} {w.pid or '-':>7}  {w.address or '-':<21} "
                     f"{detail}".rstrip())  # fmt: skip
    return lines


def worker_json(t: Topology, w: MeshWorker) -> dict[str, Any]:
    """One worker for `--json`: who and where, its state, and the slot it holds (nulls for a worker without one)."""
    slot: dict[str, int | None] = {"stage": None, "layer_start": None, "layer_end": None, "tp_rank": None}
    stage = next((s for s in t.stages if s.index == w.rank // t.tp), None) if w.rank is not None and t.tp else None
    if stage is not None and w.rank is not None:
        slot = {"stage": stage.index, "layer_start": stage.layer_start, "layer_end": stage.layer_end,
                "tp_rank": w.rank % t.tp}  # fmt: skip
    return {"worker_id": w.worker_id, "address": w.address, "pid": w.pid, "state": w.state.value, **slot,
            "detail": w.detail, "preparing_rank": w.preparing_rank}  # fmt: skip


def as_json(t: Topology) -> dict[str, Any]:
    """The topology for tools: its version, epoch and workers first, then placement and the balance check."""
    out: dict[str, Any] = {"topology_version": t.version, "epoch": t.epoch,
                           "workers": [worker_json(t, w) for w in t.workers]}  # fmt: skip
    out.update((k, v) for k, v in asdict(t).items() if k != "workers")
    out["serving"] = t.serving
    out["calibration"]["status"] = t.calibration.status.value
    for stage in out["stages"]:
        for shard in stage["shards"]:
            shard["state"] = shard["state"].value
            shard["labels"], shard["requires"] = dict(shard["labels"]), dict(shard["requires"])
    return out


def run(args: argparse.Namespace) -> int:
    try:
        files = from_args(args)
    except TlsError as e:
        raise UsageError(str(e)) from None
    try:
        t = fetch(args.coordinator, args.timeout, files)
    except grpc.RpcError as e:
        print(f"error: coordinator {args.coordinator}: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(json.dumps(as_json(t), indent=2) if args.json else render(t))
    if t.calibration.status is CalibrationStatus.FAILED and not args.json:
        print("the balance check failed; see the coordinator's log (event calibration_failed)", file=sys.stderr)
    return EXIT_SERVING if t.serving else EXIT_NOT_SERVING


def _quantized(quantization: str) -> str:
    return f", {quantization} weights" if quantization not in ("", "none") else ""
