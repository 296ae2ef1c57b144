"""The paged KV cache against the slot cache: sequences per KV memory, prefix caching, worker memory vs the model.

    .venv/bin/python bench/paged_kv.py [--model smollm2-135m-instruct] [--pp 1] [--conversations 64]
                                       [--prompt-tokens 256] [--new-tokens 256] [--streams 16] [--repeat 3]

Every mesh is a coordinator, its workers and a gateway started as processes on 127.0.0.1 (`tests/stack.py`),
float32, with the cores shared as `shardmesh up` shares them (`share_cores`). Three parts, each in one run:

  - capacity:  a slot mesh (--kv-slots 4, --max-context 8192) and a paged mesh given the same KV bytes per
               shard (--kv-block-size 16, --kv-cache-memory = what the 4 slots take, --kv-slots 256). Each is
               sent the same `--conversations` concurrent greedy conversations of prompt + new tokens (distinct
               random prompts: no prefix is shared; end-of-sequence ignored; every answer checked for its
               length). The gateway's `shardmesh_running_requests` (and KV block gauges) are scraped every
               100 ms: the peak number running at once, paged over slots. KV written over KV taken at that
               peak: tokens the running sequences hold (prompt + tokens streamed so far, from the clients'
               timestamps) over the used blocks × block size (paged) or the running slots × max_context
               (slots).
  - prefix:    a 1,000-token system prompt shared by `--streams` concurrent requests, each with its own short
               user turn (distinct across streams and rounds). Three meshes at the same KV bytes and kv_slots:
               paged with prefix caching, paged with the gateway's --no-prefix-caching, slots. Each first
               serves one warm-up request with the system prompt (so the prefix mesh has it cached, and every
               mesh has run a step), then the rounds, interleaved, in a rotating order: time to first token
               (client side) and aggregate generated tokens/s (all tokens over first send to last token).
  - memory:    every worker's peak resident set (VmHWM) and resident set after the runs (VmRSS), against
               `planning.memory.shard_memory` for the limits the coordinator served with (predicted peak and
               serving figure).

Writes bench/results/<host>-<date>-paged-kv.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results  # noqa: E402  (the repository root is on the path only now)

KIB, MIB = 1024, 1024 * 1024
SCRAPE_S = 0.1  # gateway metrics every 100 ms: a decode step of 64 sequences takes several times that here
SYSTEM = (
    "You are the keeper's assistant at the lighthouse on the northern cape. You answer questions about the "
    "lighthouse, its history, the ships that pass, the weather, the tides and the keeper's daily work. Keep a "
    "calm tone, be precise with numbers and dates, and say when you do not know. Log entry {i}: the lamp was lit "
    "at dusk, the lens cleaned, the fog signal tested, the barometer read and the tide tables checked. "
)


# -- pure parts ---------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One request as its client saw it: when it was sent and when each token arrived (monotonic seconds)."""

    prompt_tokens: int
    sent: float = 0.0
    stamps: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent


def distinct_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` random token ids in [1000, vocab): their first tokens differ, so no two share a
    cached block (the ids below 1000 hold the special and most frequent tokens)."""
    if length < 1 or vocab <= 1000 + n:
        raise ValueError(f"length must be >= 1 and vocab > 1000 + n, got length={length}, vocab={vocab}, n={n}")
    rng = random.Random(seed)
    firsts = rng.sample(range(1000, vocab), n)
    return [[first, *(rng.randrange(1000, vocab) for _ in range(length - 1))] for first in firsts]


def peak_concurrency(intervals: Sequence[tuple[float, float]]) -> int:
    """The most intervals [start, end] open at one moment (an end and a start at the same moment do not
    overlap)."""
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def tokens_held(streams: Sequence[Stream], t: float) -> tuple[int, int]:
    """KV positions held at `t` by the sequences that have streamed and not finished (prompt + tokens streamed by
    then: the last one's KV is written by the step in flight), and how many such sequences there are. A running
    sequence that has not streamed yet may hold none of its prompt's blocks (they are taken when its prefill chunk
    is dispatched), so moments with any of those are left out by the caller."""
    held, streaming = 0, 0
    for s in streams:
        if s.stamps and s.stamps[0] <= t < s.stamps[-1]:
            held += s.prompt_tokens + sum(1 for x in s.stamps if x <= t)
            streaming += 1
    return held, streaming


def aggregate_tok_s(streams: Sequence[Stream]) -> float:
    """Tokens of every stream over the wall time from the first request sent to the last token."""
    last = max(s.stamps[-1] for s in streams)
    first = min(s.sent for s in streams)
    return sum(len(s.stamps) for s in streams) / (last - first)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# -- a mesh -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshSpec:
    """One mesh: its KV cache (slots, or blocks of `block_size` with `kv_memory` bytes per shard)."""

    name: str
    slots: int
    context: int
    block_size: int = 0
    kv_memory: int | None = None
    prefix_caching: bool = True


class Mesh:
    """Coordinator, workers and gateway as processes (`tests/stack.py`), with the gateway's metrics endpoint."""

    def __init__(self, spec: MeshSpec, model_dir: Path, pp: int, threads: int | None) -> None:
        from shardmesh.rpc.procs import cores
        from shardmesh_cli.up import free_port, share_cores, wait_serving
        from tests.stack import Stack

        self.spec = spec
        self.stack = Stack(Path(tempfile.mkdtemp(prefix=f"paged-kv-{spec.name}-")))
        share = share_cores(pp, 1, "cpu", "auto", threads, cores())
        self.threads = share.worker_threads
        coordinator = ["--dtype", "float32", "--kv-slots", str(spec.slots), "--max-context", str(spec.context)]
        if spec.block_size:
            coordinator += ["--kv-block-size", str(spec.block_size), "--kv-cache-memory", str(spec.kv_memory)]
        self.stack.start_coordinator(model_dir, pp, 1, *coordinator)
        self.address, self.metrics_port = f"127.0.0.1:{free_port()}", free_port()
        gateway = ["--listen", self.address, "--coordinator", self.stack.coordinator, "--metrics-port",
                   str(self.metrics_port), "--pipeline-depth", str(share.gateway_depth)]  # fmt: skip
        self.stack.spawn("gateway", "gateway", *gateway, *([] if spec.prefix_caching else ["--no-prefix-caching"]))
        env = {**share.worker_env, "OMP_NUM_THREADS": str(share.worker_threads)}
        self.workers = [f"{re.sub(r'[^A-Za-z0-9._-]', '-', spec.name)}-{i}" for i in range(pp)]  # valid worker ids
        for w in self.workers:
            self.stack.start_worker(w, env=env)
        self.topology = self.stack.wait_complete(timeout=300)
        wait_serving(self.address, [], 120, self.stack.log_dir)

    def scrape(self) -> Any:
        from shardmesh_cli.top import Metrics

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return Metrics.parse(r.read().decode())

    def worker_memory(self) -> dict[str, dict[str, int]]:
        """VmHWM and VmRSS of each worker, by worker id."""
        out = {}
        for w in self.workers:
            status = Path(f"/proc/{self.stack.procs[w].pid}/status").read_text().splitlines()
            kb = {x.split(":")[0]: int(x.split()[1]) * KIB for x in status if x.startswith(("VmHWM", "VmRSS"))}
            out[w] = {"hwm": kb["VmHWM"], "rss": kb["VmRSS"]}
        return out

    def close(self) -> None:
        self.stack.close()


# -- requests ---------------------------------------------------------------------------------------------


def run_streams(address: str, prompts: Sequence[list[int]], new_tokens: int) -> list[Stream]:
    """Every prompt at once, one greedy stream each (end-of-sequence ignored); each must get `new_tokens`."""
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    streams = [Stream(len(p)) for p in prompts]

    def one(prompt: list[int], s: Stream) -> None:
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), params=params)
        s.sent = time.monotonic()
        try:
            for _ in stub.GenerateStream(req, timeout=3600):
                s.stamps.append(time.monotonic())
        except grpc.RpcError as e:
            s.error = f"{e.code().name}: {e.details()}"

    threads = [threading.Thread(target=one, args=(p, s)) for p, s in zip(prompts, streams, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [(i, s.error or f"{len(s.stamps)} tokens") for i, s in enumerate(streams) if len(s.stamps) != new_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(streams)} requests did not get {new_tokens} tokens: {bad[:3]}")
    return streams


class Sampler:
    """Scrapes a gateway's running requests and KV block gauges every SCRAPE_S while a run lasts."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.samples = mesh, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_S):
            t0 = time.monotonic()
            m = self.mesh.scrape()
            at = (t0 + time.monotonic()) / 2
            blocks = {s: m.value("shardmesh_kv_blocks", state=s) for s in ("used", "reserved", "cached", "free")}
            self.samples.append({"t": at, "running": int(m.value("shardmesh_running_requests")), **blocks})

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def capacity(mesh: Mesh, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The conversations at once on `mesh`: the peak running, and KV written over KV taken at the peak."""
    sampler = Sampler(mesh)
    t0 = time.monotonic()
    streams = run_streams(mesh.address, prompts, new_tokens)
    wall = time.monotonic() - t0
    samples = sampler.stop()
    peak = max(s["running"] for s in samples)
    spec = mesh.spec
    # KV written over KV taken, at the moments the peak runs with every sequence decoding (none prefilling).
    at_peak = []
    for s in samples:
        written, streaming = tokens_held(streams, s["t"])
        if s["running"] == peak and streaming >= peak:
            taken = s["used"] * spec.block_size if spec.block_size else peak * spec.context
            reserved = (s["used"] + s["reserved"]) * spec.block_size if spec.block_size else taken
            at_peak.append(s | {"written": written, "over_taken": written / taken, "over_reserved": written / reserved})
    return {
        "mesh": spec.name, "conversations": len(prompts), "prompt_tokens": len(prompts[0]), "new_tokens": new_tokens,
        "seconds": round(wall, 1), "tok_s": round(len(prompts) * new_tokens / wall, 1),
        "peak_running": peak, "peak_streaming": peak_concurrency([(s.stamps[0], s.stamps[-1]) for s in streams]),
        "samples_at_peak": len(at_peak),
        "written_over_taken": round(statistics.median(x["over_taken"] for x in at_peak), 4),
        "written_over_taken_min": round(min(x["over_taken"] for x in at_peak), 4),
        "written_over_reserved": round(statistics.median(x["over_reserved"] for x in at_peak), 4),
        "peak_used_blocks": max(s["used"] for s in samples), "blocks_total": mesh.topology.limits.kv_blocks,
        # used + reserved at the peak: equal to the pool when the blocks, not the conversations sent, bound it
        "held_at_peak_blocks": max(s["used"] + s["reserved"] for s in at_peak),
        "ttft_median_s": round(statistics.median(s.ttft for s in streams), 2),
        "samples": [s | {"t": round(s["t"] - t0, 3)} for s in samples],  # every scrape, from the first request
    }  # fmt: skip


# -- the parts --------------------------------------------------------------------------------------------


def slot_bytes(model_dir: Path, slots: int, context: int) -> int:
    """KV bytes per shard of the slot cache (pp=1: one shard holds every layer; with pp > 1 the paged mesh gets
    the same bytes, and the coordinator sizes its blocks by the most loaded shard)."""
    from shardmesh.core.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * slots * context


def part_capacity(a: argparse.Namespace, model_dir: Path, vocab: int) -> tuple[list[dict], list[dict]]:
    memory = slot_bytes(model_dir, a.slots, a.context)
    specs = [MeshSpec("slots", a.slots, a.context),
             MeshSpec("paged", a.paged_slots, a.context, a.block_size, memory)]  # fmt: skip
    prompts = distinct_prompts(a.conversations, a.prompt_tokens, vocab)
    results, memories = [], []
    for spec in specs:  # one at a time: each holds its KV bytes, and a capacity run needs no interleaving
        mesh = Mesh(spec, model_dir, a.pp, a.threads)
        try:
            run_streams(mesh.address, [prompts[0][:16]], 4)  # warm-up: one short request
            # The slot mesh runs `slot_conversations` of them: its peak is its kv_slots once more are queued, and
            # each extra wave of kv_slots conversations costs another full decode (minutes on this busy machine).
            n = a.slot_conversations if spec.block_size == 0 else a.conversations
            results.append(capacity(mesh, prompts[:n], a.new_tokens) | {"kv_bytes": memory})
            print({k: v for k, v in results[-1].items() if k != "samples"}, file=sys.stderr, flush=True)
            memories += memory_rows(mesh, model_dir, "capacity")
        finally:
            mesh.close()
    return results, memories


def turn_prompts(system: list[int], tokenizer: Any, streams: int, round_: int) -> list[list[int]]:
    """The system prompt and a user turn of its own for each stream (distinct across rounds too)."""
    return [system + tokenizer.encode(f"\nQuestion {round_}.{i}: when was lamp {i} last lit, and by whom?",
                                      add_special_tokens=False) for i in range(streams)]  # fmt: skip


def system_prompt(tokenizer: Any, tokens: int) -> list[int]:
    text = "".join(SYSTEM.format(i=i) for i in range(tokens // 40 + 1))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < tokens:
        raise ValueError(f"the system text gives {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def part_prefix(a: argparse.Namespace, model_dir: Path) -> tuple[list[dict], list[dict], dict]:
    from shardmesh.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    system = system_prompt(tokenizer, a.system_tokens)
    memory = slot_bytes(model_dir, a.streams, a.prefix_context)
    specs = [MeshSpec("paged+prefix", a.streams, a.prefix_context, a.block_size, memory),
             MeshSpec("paged-no-prefix", a.streams, a.prefix_context, a.block_size, memory, prefix_caching=False),
             MeshSpec("slots", a.streams, a.prefix_context)]  # fmt: skip
    meshes: list[Mesh] = []
    runs, memories = [], []
    try:
        for spec in specs:
            meshes.append(Mesh(spec, model_dir, a.pp, a.threads))
        warm = system + tokenizer.encode("\nQuestion: is the lamp lit?", add_special_tokens=False)
        for mesh in meshes:  # the prefix mesh caches the system prompt; every mesh has run a step
            run_streams(mesh.address, [warm], 4)
        for r in range(a.repeat):
            prompts = turn_prompts(system, tokenizer, a.streams, r)
            for mesh in meshes[r % len(meshes) :] + meshes[: r % len(meshes)]:
                streams = run_streams(mesh.address, prompts, a.turn_new_tokens)
                runs.append({"round": r, "mesh": mesh.spec.name, "prompt_tokens": len(prompts[0]),
                             "ttft_median_s": round(statistics.median(s.ttft for s in streams), 3),
                             "ttft_max_s": round(max(s.ttft for s in streams), 3),
                             "tok_s": round(aggregate_tok_s(streams), 1)})  # fmt: skip
                print(runs[-1], file=sys.stderr, flush=True)
        m = meshes[0].scrape()
        prefix = {k: m.value(f"shardmesh_prefix_cache_{k}_total") for k in ("lookups", "hits", "tokens_saved")}
        for mesh in meshes:
            memories += memory_rows(mesh, model_dir, "prefix")
    finally:
        for mesh in meshes:
            mesh.close()
    return runs, memories, prefix


def memory_rows(mesh: Mesh, model_dir: Path, part: str) -> list[dict]:
    """Each worker's VmHWM and VmRSS against `shard_memory` for the limits its coordinator served with."""
    from shardmesh.planning.memory import load_model, shard_memory

    model = load_model(model_dir, "float32")
    held = mesh.worker_memory()
    rows = []
    for stage, shard in mesh.topology.shards():
        planned = shard_memory(model, (stage.layer_start, stage.layer_end), 1, shard.tp_rank, "float32",
                               mesh.topology.limits)  # fmt: skip
        got = held[shard.worker_id]
        rows.append({"part": part, "mesh": mesh.spec.name, "worker": shard.worker_id,
                     "layers": [stage.layer_start, stage.layer_end], "hwm": got["hwm"], "rss": got["rss"],
                     "planned_total": planned.total, "planned_serving": planned.serving,
                     "planned_kv": planned.kv_cache, "planned_weights": planned.weights,
                     "planned_activations": planned.activations, "planned_runtime": planned.runtime,
                     "hwm_over_planned": round(got["hwm"] / planned.total, 3)})  # fmt: skip
    return rows


# -- the report -------------------------------------------------------------------------------------------


def summarize_prefix(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per mesh: the median over rounds of the median TTFT and of the aggregate tokens/s."""
    out = {}
    for name in dict.fromkeys(r["mesh"] for r in runs):
        mine = [r for r in runs if r["mesh"] == name]
        out[name] = {"ttft_median_s": statistics.median(r["ttft_median_s"] for r in mine),
                     "tok_s": statistics.median(r["tok_s"] for r in mine)}  # fmt: skip
    return out


def paired(runs: list[dict], a: str, b: str, key: str) -> list[float]:
    """Per round, `key` of mesh `a` over mesh `b` (the rounds interleave them, so a busy moment hits both)."""
    by = {(r["round"], r["mesh"]): r[key] for r in runs}
    return [ratio(by[(k, a)], by[(k, b)]) for k in sorted({r["round"] for r in runs})]


def report(info: dict, a: argparse.Namespace, cap: list[dict], runs: list[dict], memories: list[dict],
           prefix: dict) -> None:  # fmt: skip
    lines = [f"## Paged KV cache against slots — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
             f"{info['date']}\n",
             f"Model `{a.model}`, float32, pp={a.pp}, {info['threads']} torch threads per worker "
             f"(as `shardmesh up` shares the cores). CPU flags: {info['flags']}. The machine was shared with other "
             "engineers' experiments: compare the ratios, measured in the same run, not absolute times.\n"]  # fmt: skip
    if cap:
        slots, paged = cap
        lines += [
            "### Capacity in the same KV memory\n",
            f"Concurrent conversations of {slots['prompt_tokens']} + {slots['new_tokens']} tokens (512-token "
            "sequences; distinct random prompts, so no prefix is shared; greedy, end-of-sequence ignored, every "
            f"answer checked to have {slots['new_tokens']} tokens), max_context {a.context}: "
            f"{paged['conversations']} sent at once to the paged mesh, {slots['conversations']} to the slot mesh "
            f"(its peak is its {a.slots} slots once more wait; each further wave is another full decode). KV bytes "
            f"per shard: {slots['kv_bytes'] / MIB:.0f} MiB for both (slots: {a.slots} × {a.context} positions; "
            f"paged: `--kv-block-size {a.block_size} --kv-cache-memory {slots['kv_bytes']}` = "
            f"{paged['blocks_total']} blocks, `--kv-slots {a.paged_slots}`). Peak running: the gateway's "
            f"`shardmesh_running_requests`, scraped every {SCRAPE_S * 1000:.0f} ms (peak streaming: most requests "
            "between their first and last token at once, from the clients' timestamps). KV written ÷ taken: "
            "positions the running sequences hold (prompt + tokens streamed) ÷ used blocks × block size (paged) "
            "or running slots × max_context (slots), median (min) over the samples at the peak with every running "
            "sequence decoding (none waiting for its prefill chunk); ÷ taken+reserved "
            "also counts the blocks promised at admission for tokens not generated yet. Blocks held at the "
            "peak: used + reserved.\n",
            "| mesh | conversations | peak running | peak streaming | × slots | KV written ÷ taken (min) | "
            "written ÷ taken+reserved | blocks held at the peak | wall s | tok/s | median TTFT s |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        ]  # fmt: skip
        for c in cap:
            held = f"{c['held_at_peak_blocks']:.0f} of {c['blocks_total']}" if c["blocks_total"] else "—"
            lines.append(f"| {c['mesh']} | {c['conversations']} | {c['peak_running']} | {c['peak_streaming']} | "
                         f"**{c['peak_running'] / slots['peak_running']:.1f}×** | {c['written_over_taken']:.3f} "
                         f"({c['written_over_taken_min']:.3f}) | {c['written_over_reserved']:.3f} | {held} | "
                         f"{c['seconds']} | {c['tok_s']} | {c['ttft_median_s']} |")  # fmt: skip
        lines.append("")
    if runs:
        s = summarize_prefix(runs)
        ttft = paired(runs, "paged-no-prefix", "paged+prefix", "ttft_median_s")
        tput = paired(runs, "paged+prefix", "slots", "tok_s")
        tput_np = paired(runs, "paged-no-prefix", "slots", "tok_s")
        lines += [
            "### A shared 1,000-token system prompt\n",
            f"{a.streams} concurrent requests: the same {a.system_tokens}-token system prompt and a user turn of "
            f"their own ({runs[0]['prompt_tokens']} tokens in all), {a.turn_new_tokens} new tokens each; three "
            f"meshes with the same KV bytes ({a.streams} slots × {a.prefix_context} positions) and --kv-slots "
            f"{a.streams}. Each mesh first served one warm-up request with the system prompt (so the prefix "
            f"mesh had it cached before the rounds). {a.repeat} rounds, the meshes interleaved in a rotating "
            "order; TTFT: the median over a round's requests (client side, from send to first token); tok/s: "
            "all generated tokens over the round's wall time. Medians over rounds; ratios paired per round.\n",
            "| mesh | median TTFT s | aggregate tok/s |", "|---|---:|---:|",
            *(f"| {k} | {v['ttft_median_s']:.3f} | {v['tok_s']:.1f} |" for k, v in s.items()),
            "",
            f"- TTFT without ÷ with prefix caching: **{statistics.median(ttft):.1f}×** (rounds: "
            f"{', '.join(f'{x:.1f}' for x in ttft)}); target >= 5×.",
            f"- tokens/s paged+prefix ÷ slots: **{statistics.median(tput):.2f}×** (rounds: "
            f"{', '.join(f'{x:.2f}' for x in tput)}); target >= 1×. Paged without prefix caching ÷ slots: "
            f"{statistics.median(tput_np):.2f}× (the paged cache alone, the same prefill work).",
            f"- The prefix gateway's counters: {prefix['lookups']:.0f} lookups, {prefix['hits']:.0f} hits, "
            f"{prefix['tokens_saved']:.0f} prompt tokens not prefilled.",
            "",
        ]  # fmt: skip
    if memories:
        lines += [
            "### Worker memory against the model\n",
            "Peak resident set (VmHWM) and resident set after the runs (VmRSS) of each worker, against "
            "`planning.memory.shard_memory` for the limits its coordinator served with (`shardmesh plan`'s "
            "model: predicted peak = runtime + weights + buffers + max(load, KV + activations); its runtime is "
            "the fresh-install figure, 322 MiB).\n",
            "| part | mesh | layers | VmHWM MiB | VmRSS MiB | planned peak MiB | HWM ÷ planned | planned KV MiB | "
            "planned activations MiB |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
            *(f"| {m['part']} | {m['mesh']} | {m['layers'][0]}–{m['layers'][1]} | {m['hwm'] / MIB:.0f} | "
              f"{m['rss'] / MIB:.0f} | {m['planned_total'] / MIB:.0f} | {m['hwm_over_planned']:.2f} | "
              f"{m['planned_kv'] / MIB:.0f} | {m['planned_activations'] / MIB:.0f} |" for m in memories),
            "",
        ]  # fmt: skip
    save_results(a.out, info, "-paged-kv", "\n".join(lines), {"args": vars(a) | {"out": str(a.out)},
                 "capacity": cap, "prefix_runs": runs, "prefix_counters": prefix, "memory": memories})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: as `up`)")
    ap.add_argument("--parts", default="capacity,prefix", help="capacity, prefix or both (memory comes with each)")
    ap.add_argument("--slots", type=int, default=4, help="capacity: the slot mesh's --kv-slots")
    ap.add_argument("--context", type=int, default=8192, help="capacity: --max-context of both meshes")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--paged-slots", type=int, default=256, help="capacity: the paged mesh's --kv-slots")
    ap.add_argument("--conversations", type=int, default=64, help="capacity: conversations sent to the paged mesh")
    ap.add_argument("--slot-conversations", type=int, default=16,
                    help="capacity: conversations sent to the slot mesh (more than its kv_slots)")  # fmt: skip
    # 448 + 64, not 256 + 256: the same 512-token sequences, and the decode of 64 conversations at once stays in
    # minutes on this shared 2-core machine (a batch-64 decode step took 1-2 s under the other experiments' load).
    ap.add_argument("--prompt-tokens", type=int, default=448)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16, help="prefix: concurrent requests (and every mesh's slots)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--prefix-context", type=int, default=1280, help="prefix: --max-context of the three meshes")
    ap.add_argument("--turn-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="prefix: rounds, interleaved")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    from bench.conditions import cpu_flags
    from shardmesh.core.config import ModelConfig
    from shardmesh.models.registry import resolve
    from shardmesh.rpc.procs import cores
    from shardmesh_cli.up import share_cores

    info = machine() | {
        "flags": " ".join(cpu_flags()),
        "threads": share_cores(a.pp, 1, "cpu", "auto", a.threads, cores()).worker_threads,
    }
    model_dir = resolve(a.model)
    parts = set(a.parts.split(","))
    cap, runs, memories, prefix = [], [], [], {}
    if "capacity" in parts:
        cap, mem = part_capacity(a, model_dir, ModelConfig.from_dir(model_dir).vocab_size)
        memories += mem
    if "prefix" in parts:
        runs, mem, prefix = part_prefix(a, model_dir)
        memories += mem
    report(info, a, cap, runs, memories, prefix)


if __name__ == "__main__":
    os.environ.setdefault("SHARDMESH_LOG_LEVEL", "warning")
    main()
