"""One command, one results table: shardmesh against `transformers` and llama.cpp on the same model, prompts,
machine and dtype.

    .venv/bin/python bench/run.py [--model smollm2-135m-instruct] [--layouts 1x1,2x1,1x3,2x3] [--streams 1,4,16,64]
                                  [--dtypes float32,bfloat16] [--quick] [--rounds 1] [--out bench/results]

Writes <out>/<host>-<date>.{md,json} and prints the markdown; both record the CPU model and the CPU flags that
pick kernels (bench/conditions.py `machine`). Every number is measured in this run, for each of `--dtypes`:
the baselines first (`transformers` `generate` in that dtype, greedy, same prompt and lengths; and llama.cpp on
a GGUF of the same weights and type when llama-cpp-python is installed: F32 for float32, BF16 for bfloat16
(F16 if this llama.cpp cannot run BF16), see bench/llamacpp.py), then the mesh (`shardmesh up --dtype` for
each pp×tp layout, requests through the gateway). Layouts use tp=3, not 2: SmolLM2's 9 attention heads cannot
be split in 2. `--quick`: layouts 1x1,2x1,1x3 and streams 1,16 (what the targets need) unless given.

`--rounds N` runs llama.cpp and every mesh N times, alternated: odd rounds in the planned order, even rounds in
the reverse order (so pp=1 stays beside llama.cpp, and each mesh's neighbours change sides), with the
`transformers` baselines once before them. A host whose memory speed drifts within the hour (one such host took
10.6 ms a token at pp=1 in one run and 17.0 half an hour later) then meets each layout in both of its phases:
every derived line is computed within each round, from that round's meshes and llama.cpp only, and reported as
the median of the rounds' values with their range.

- single stream: decode tokens/s = completion tokens / (total - time to first token), TTFT as the
  gateway reports it (queue wait + prefill + first step), and client-side totals; the median of 3
  requests in a row, or, for the meshes of a stage-boundary pair, of 6 requests alternated with the
  other mesh's (below).
- aggregate: N concurrent streams, total completion tokens / wall time of the slowest.
- pp=2 (tp=1) runs twice, once per `up --pipeline`: `turns` (the default on CPU: one step in flight,
  each stage on all the cores when its turn comes) and `full` (two micro-batches in flight, every stage
  busy at once, one core each). Both stages share this machine's cores either way.
- memory: peak RSS of every worker process (psutil), next to the planner-free raw weights size.

Derived lines, per dtype, each beside its target and whether this run met it:
- pp=1 one stream vs llama.cpp, same dtype: llama.cpp's median ms/token over ours (> 1: faster than
  llama.cpp); target >= 1 for float32, and for bfloat16 where the CPU has native bf16 (avx512_bf16/amx_bf16).
- tp=3 vs pp=1, one stream, per token: target within 1.1x where the run has a core per rank (3 CPUs or more),
  within 1.5x on fewer.
- stage boundary: per-token latency of pp=2 minus pp=1 (both tp=1, one stream) with the same torch threads
  per worker and the same decode steps per call (`turns`, one step in flight, runs the gateway's 8 per call as
  pp=1 does; `full`, two in flight, one per call, so pp=1 runs again with `--decode-steps 1` on the thread count
  a `full` stage gets), i.e. what one extra hop costs; target <= 0.5 ms. Against pp=1 as deployed (all the
  cores, several decode steps per call) beside it. Each pp=2 mesh and the pp=1 it is set against are up at
  once, and their one-stream requests alternate, A B B A ... (`--pairs`, 12 each by default; `run_meshes`):
  the boundary is the median of the adjacent pairs' differences. Meshes measured minutes apart met this host's
  drift (±3 ms a token), which put single rounds' boundaries anywhere from -3.7 to +3.2 ms. The report also
  pools every round's pairs: their median and a 95% interval of it (`median_interval`), and whether the whole
  interval lies below the target, above it, or holds it (then the run cannot tell the two apart).
- pipeline: aggregate tokens/s of pp=2 over pp=1 (both tp=1) at 16 streams, per pipeline mode: target >= 0.9x;
  and 16 streams over one stream: target >= 6x.
- memory floor (no target): a one-stream step reads every weight once, so it takes at least the weights' bytes over
  the rate this host reads memory at. bench/read_probe.py reads a buffer of those bytes on the step's threads; its
  passes run between pp=1's one-stream requests (`PROBE_PASSES` after each) and just before and after llama.cpp's,
  and the report gives each one's floor ÷ its ms per token (1: at the floor). What the llama.cpp target is set
  beside: two programs both near the floor can only trade places with this host's drift.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llamacpp, read_probe  # noqa: E402  (the repository root is on the path only now)
from bench.conditions import (  # noqa: E402
    BOUNDARY_GOAL_MS,
    PROMPT,
    interval_side,
    machine,
    median_interval,
    pythonpath,
    save_results,
)
from gateway.batching import pipeline_depth  # noqa: E402
from gateway.process import GatewayConfig  # noqa: E402
from shardmesh.rpc.procs import cores  # noqa: E402
from shardmesh_cli.up import share_cores  # noqa: E402

DECODE_STEPS = GatewayConfig.decode_steps  # the gateway's default --decode-steps: what `up` runs
PROBE_PASSES = 3  # read probe passes after each of pp=1's one-stream requests (float32 SmolLM2: ~20 ms each)
LLAMA_PROBE_PASSES = 10  # and before llama.cpp's measurement, and again after it
Probe = Callable[[int, int], list[float]]  # (threads, passes) -> GB/s of each pass over one dtype's weights' bytes


def baseline_transformers(model_dir: Path, prompt_ids: list[int], new_tokens: int, dtype: str = "float32") -> dict:
    """`transformers` greedy generate in ``dtype``, all cores: TTFT from a 1-token run, decode from the rest."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt_ids])
    kw = {"do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        ref.generate(ids, max_new_tokens=4, **kw)  # warm-up
        t0 = time.perf_counter()
        ref.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = ref.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    return {
        "ttft_ms": ttft * 1e3,
        "decode_tok_s": (n - 1) / (total - ttft),
        "ms_per_token": (total - ttft) / (n - 1) * 1e3,
    }


def baseline_llamacpp(model: str, prompt_ids: list[int], new_tokens: int, threads: int, dtype: str = "float32") -> dict:
    """llama.cpp on a GGUF of the very weights the mesh serves, of the same type as ``dtype`` (F32, BF16, F16:
    bench/llamacpp.py), when llama-cpp-python is installed (`pip install '.[bench]'`); otherwise why not, for
    the table. A BF16 file this llama.cpp build cannot run falls back to F16 (same weights, other rounding),
    and says so in `fallback`."""
    reason = llamacpp.available()
    if reason is not None:
        return {"skipped": reason}
    failures = []
    for kind in [dtype] + (["float16"] if dtype == "bfloat16" else []):
        ggml_type = llamacpp.GGUF_KINDS[kind][1]
        try:
            out = llamacpp.measure(llamacpp.gguf_for(kind, model), prompt_ids, new_tokens, threads=threads)
        except Exception as exc:  # llama.cpp reports a file it cannot load as ValueError/RuntimeError
            failures.append(f"{ggml_type}: {one_line(exc)}")
            continue
        out.pop("token_ids", None)
        out["gguf_type"] = ggml_type
        if failures:
            out["fallback"] = "; ".join(failures)
        return out
    return {"skipped": f"llama.cpp could not run the {dtype} GGUF: {'; '.join(failures)}"}


def one_line(exc: BaseException) -> str:
    """An exception as one line for the table: its type and the first line of its message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


MAX_CONTEXT = 1024  # each mesh's --max-context: prompt and new tokens of a request


class Mesh:
    """`shardmesh up` of this checkout, or of another one (`tree`: a checkout of an earlier commit, for
    bench/against.py), started as its own process tree and stopped by `close`."""

    def __init__(self, model_dir: Path, pp: int, tp: int, pipeline: str, slots: int, log_dir: Path, threads: int,
                 rebalance: str, tree: Path = ROOT, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.log_dir = log_dir
        # Earlier checkouts ran the command as `shardmesh.cli`; it lives in `shardmesh_cli` since the layering.
        command = "shardmesh_cli" if (tree / "shardmesh_cli").is_dir() else "shardmesh.cli"
        args = [sys.executable, "-m", command, "up", "--model", str(model_dir), "--pp", str(pp),
                "--tp", str(tp), "--pipeline", pipeline, "--kv-slots", str(slots), "--max-context", str(MAX_CONTEXT),
                "--rebalance", rebalance, "--worker-threads", str(threads), "--log-dir", str(log_dir),
                *extra]  # fmt: skip
        # that checkout's packages first (`pythonpath`); `env`: the services' own settings
        environ = {**os.environ, **(env or {}), "PYTHONPATH": pythonpath(tree)}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=environ, cwd=tree)
        self.address = self.proc.stdout.readline().decode().strip()
        if not self.address:
            raise RuntimeError(f"shardmesh up failed; logs in {log_dir}")

    def worker_peak_rss(self) -> list[int]:
        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            if "worker" in " ".join(p.cmdline()):
                status = Path(f"/proc/{p.pid}/status").read_text()
                out.append(next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmHWM")))
        return out

    def layers(self) -> list[int]:
        """Layers per stage of the placement that served (the last one the balance check measured)."""
        checks = [json.loads(line) for line in (self.log_dir / "coordinator.log").read_text().splitlines()
                  if '"event": "calibrated"' in line]  # fmt: skip
        return checks[-1]["layers"] if checks else []

    def links(self) -> list[str]:
        """How the stages' links moved their bytes (shm, gloo, nccl), from the workers' `ready` lines: a pipeline on
        one host takes shared memory unless a side refused it (`groups.form_link`)."""
        kinds = set()
        for ready in self._worker_events("ready"):
            kinds |= {ready[k].split()[0] for k in ("prev_link", "next_link", "loop_link") if k in ready}
        return sorted(kinds)

    def priorities(self) -> list[str]:
        """The scheduling priority of the workers' compute threads, from their `compute_thread` lines (realtime,
        normal; `shardmesh.engine.compute_priority`)."""
        return sorted({event["priority"] for event in self._worker_events("compute_thread")})

    def bf16_rows(self) -> list[str]:
        """How the workers multiply bfloat16 weights by several rows, from their `bf16_rows_chosen` lines (amx,
        vdpbf16ps, widened; `cpu_kernels.choose_bf16_rows`); none for other dtypes."""
        return sorted({event["way"] for event in self._worker_events("bf16_rows_chosen")})

    def _worker_events(self, event: str) -> Iterator[dict]:
        """The workers' log lines of `event`, parsed."""
        for log in self.log_dir.glob("worker*.log"):
            for line in log.read_text().splitlines():
                if f'"event": "{event}"' in line:
                    yield json.loads(line)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_streams(address: str, prompt_ids: list[int], new_tokens: int, n: int, repeats: int | None = None,
                sampling: dict | None = None) -> dict:  # fmt: skip
    """`n` concurrent greedy requests through the gateway at `address`, `repeats` times in a row (default: 3 for one
    stream, whose median is taken, else once), after a short warm-up request. `sampling`: fields of the requests'
    SamplingParams instead of greedy ones (temperature, top_p, top_k, seed); those requests ignore the end of
    sequence, so that every one decodes `new_tokens` whatever it draws."""
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    fields = {"temperature": 0.0, **({**sampling, "ignore_eos": True} if sampling else {})}
    params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, stop=[], **fields)
    req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids), params=params)
    results: list = []

    def one() -> None:
        results.append(stub.Generate(req, timeout=600))

    stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids[:8]),
                                              params=gateway_pb2.SamplingParams(max_new_tokens=2)))  # fmt: skip
    # One stream is measured 3 times in a row (the median of the 3): single runs of it moved by 2-5 ms
    # between otherwise identical runs, as much as the stage boundary being measured.
    wall = 0.0
    for _ in range(repeats or (3 if n == 1 else 1)):
        threads = [threading.Thread(target=one) for _ in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall += time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    decode = [r.timings.mean_inter_token_ms for r in results if len(r.token_ids) > 1]
    return {"streams": n, "tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "ttft_ms": statistics.median(r.timings.time_to_first_token_ms for r in results),
            "ms_per_token": statistics.median(decode) if decode else float("nan")}  # fmt: skip


def merged(parts: list[dict]) -> dict:
    """One stream's measurement from single requests made apart (`run_streams(..., 1, repeats=1)` each): tokens and
    wall time summed, time to first token and ms/token the medians of the requests'."""
    tokens, wall = sum(p["tokens"] for p in parts), sum(p["wall_s"] for p in parts)
    return {"streams": parts[0]["streams"], "tokens": tokens, "wall_s": wall, "aggregate_tok_s": tokens / wall,
            "ttft_ms": statistics.median(p["ttft_ms"] for p in parts),
            "ms_per_token": statistics.median(p["ms_per_token"] for p in parts)}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16", "float16")
# What shardmesh.engine.linear.cpu_has_native_bf16 looks for: without them bfloat16 products are emulated, and
# the bfloat16 target against llama.cpp does not apply.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
LAYOUTS, STREAMS = "1x1,2x1,1x3,2x3", "1,4,16,64"
# --quick: what the targets need (pp=1, pp=2 both ways, tp=3; one and 16 streams), ~3.3 min a round and dtype.
QUICK_LAYOUTS, QUICK_STREAMS = "1x1,2x1,1x3", "1,16"
# tp=3 ÷ pp=1 per token, one stream: on a host with a core per rank, and on fewer cores (issue targets)
TP_GOAL_CORE_PER_RANK, TP_GOAL_SHARED_CORES = 1.1, 1.5
# One-stream requests per mesh of a stage-boundary pair, alternated between the two meshes (`run_meshes`; `--pairs`).
# Single pairs' differences spread over ~5 ms on the 2-vCPU Xeon (a 64-token request takes ~1.3 s, and this host's
# speed moves within seconds), so 6 a round left the rounds' medians 1-2 ms apart where the target is 0.5 ms; 12 a
# round give 36 pairs in three rounds, whose pooled median has an interval ~1 ms wide (`pooled_boundaries`).
PAIRED_REQUESTS = 12


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--layouts",
        default=None,
        help=f"pp x tp pairs (tp must divide the heads); default {LAYOUTS}, {QUICK_LAYOUTS} with --quick",
    )
    ap.add_argument("--streams", default=None, help=f"default {STREAMS}, {QUICK_STREAMS} with --quick")
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help=f"serving dtypes, each against llama.cpp's GGUF of the same type ({', '.join(DTYPES)})",
    )
    ap.add_argument("--quick", action="store_true", help="only the layouts and stream counts the targets need")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--rebalance",
        default="none",
        choices=["none", "by-speed"],
        help="pp >= 2: split layers evenly (default) or by measured stage speeds",
    )
    ap.add_argument(
        "--rounds",
        default="1",
        help="run llama.cpp and the meshes this many times, alternating their order; lines are per-round medians",
    )
    ap.add_argument(
        "--pairs",
        default=str(PAIRED_REQUESTS),
        help="one-stream requests per mesh of a stage-boundary pair, alternated A B B A (an even number)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    a.layouts = a.layouts or (QUICK_LAYOUTS if a.quick else LAYOUTS)
    a.streams = a.streams or (QUICK_STREAMS if a.quick else STREAMS)
    try:
        a.layout_list = [_layout(x) for x in a.layouts.split(",")]
        a.stream_list = [_positive("--streams", x) for x in a.streams.split(",")]
        a.rounds = _positive("--rounds", a.rounds, each=False)
        a.pairs = _positive("--pairs", a.pairs, each=False)
        if a.pairs % 2:  # A B B A cancels a steady drift only over whole A B, B A quartets
            raise ValueError(f"--pairs: must be even (A B B A ...), got {a.pairs}")
    except ValueError as exc:
        ap.error(str(exc))
    a.dtype_list = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    wrong = [d for d in a.dtype_list if d not in DTYPES]
    if wrong or not a.dtype_list:
        ap.error(f"--dtypes: each must be one of {', '.join(DTYPES)}; got {a.dtypes!r}")
    if a.new_tokens < 2:
        ap.error(f"--new-tokens: at least 2 to time a decode step, got {a.new_tokens}")
    return a  # fmt: skip


def _positive(flag: str, text: str, each: bool = True) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{flag}: {'each must' if each else 'must'} be a positive whole number, got {text!r}")
    return n


def _layout(text: str) -> tuple[int, int]:
    pp, _, tp = text.strip().partition("x")
    if not tp:
        raise ValueError(f"--layouts: each must be PPxTP, e.g. 2x1, got {text!r}")
    return _positive("--layouts", pp), _positive("--layouts", tp)


def plan_runs(layouts: list[tuple[int, int]], streams: list[int], dtype: str) -> list[dict]:
    """The meshes to start for one dtype: every layout with `up`'s own core share (pp=2, tp=1 once per
    pipeline mode), then, for the stage boundary, pp=1 again on the threads and decode steps per call of each
    pp=2 mode that pp=1 as deployed does not already match. `decode_steps`: what the gateway runs per call."""
    runs = []
    for pp, tp in layouts:
        for pipeline in ("turns", "full") if (pp, tp) == (2, 1) else ("auto",):
            share = share_cores(pp, tp, "cpu", pipeline, None, cores())
            # Several decode steps per call only with one step in flight (gateway `Scheduler._decode_steps`).
            steps = DECODE_STEPS if pipeline_depth(share.gateway_depth, pp) == 1 else 1
            runs.append({"pp": pp, "tp": tp, "pipeline": share.pipeline, "threads": share.worker_threads,
                         "streams": streams, "deployed": True, "dtype": dtype, "decode_steps": steps})  # fmt: skip
    if (1, 1) in layouts and 1 in streams:
        have = {(r["threads"], r["decode_steps"]) for r in runs if (r["pp"], r["tp"]) == (1, 1)}
        wanted = sorted({(r["threads"], r["decode_steps"]) for r in runs if (r["pp"], r["tp"]) == (2, 1)} - have)
        # The stage boundary's like-for-like baselines, not deployed layouts: one stream only.
        runs += [{"pp": 1, "tp": 1, "pipeline": "full", "threads": t, "streams": [1], "deployed": False,
                  "dtype": dtype, "decode_steps": n} for t, n in wanted]  # fmt: skip
    return runs


def boundary_pairs(runs: list[dict]) -> list[list[dict]]:
    """One dtype's planned runs as the steps of a round: each pp=2 (tp=1) run together with the pp=1 run of the same
    threads per worker and decode steps per call (its stage-boundary baseline), pp=1 first, where both measure one
    stream; every other run alone. A pair takes the place of the first of its two runs in the plan."""

    def key(r: dict) -> tuple[int, int]:
        return r["threads"], r.get("decode_steps", 1)

    single = [r for r in runs if 1 in r["streams"] and r["tp"] == 1]
    partner: dict[int, dict] = {}
    for pp2 in (r for r in single if r["pp"] == 2):
        pp1 = next((r for r in single if r["pp"] == 1 and key(r) == key(pp2) and id(r) not in partner), None)
        if pp1 is not None:
            partner[id(pp1)], partner[id(pp2)] = pp2, pp1
    steps: list[list[dict]] = []
    placed: set[int] = set()
    for r in runs:
        if id(r) not in placed:
            group = sorted([r, partner[id(r)]], key=lambda x: x["pp"]) if id(r) in partner else [r]
            placed |= {id(x) for x in group}
            steps.append(group)
    return steps


def run_meshes(model_dir: Path, runs: list[dict], prompt_ids: list[int], a: argparse.Namespace,
               flip: bool = False, probe: Probe | None = None) -> list[dict]:  # fmt: skip
    """One step of a round: ``runs``' meshes (`shardmesh up` of each layout and dtype) up at once, and each of their
    stream counts through the gateway.

    A stage-boundary pair (pp=1, then pp=2; `boundary_pairs`) measures one stream by alternating single requests
    between its two meshes, `a.pairs` each, in the order A B B A A B ... (B first if `flip`), so the host's
    drift from one minute to the next lands on both alike; the pp=2 row's `boundary_each` holds every pair's
    difference (pp=2 minus pp=1, ms/token). Given `probe`, `PROBE_PASSES` of it run after each of a deployed
    pp=1's requests, on its threads, the meshes idle: its one-stream row's `probe_gbps`. Then each mesh, in turn,
    runs its other stream counts."""
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        meshes = []
        for i, run in enumerate(runs):
            log_dir = Path(logs) / f"mesh{i}"
            log_dir.mkdir()
            steps = {"SHARDMESH_GATEWAY_DECODE_STEPS": str(run["decode_steps"])}
            mesh = Mesh(model_dir, run["pp"], run["tp"], run["pipeline"], max(a.stream_list), log_dir, run["threads"],
                        a.rebalance, extra=("--dtype", run["dtype"]), env=steps)  # fmt: skip
            stack.callback(mesh.close)
            meshes.append(mesh)
        found: list[dict[int, dict]] = [{} for _ in runs]
        order = [1, 0] if flip else [0, 1]
        if len(runs) == 2:
            parts: list[list[dict]] = [[], []]
            probed = probe if runs[0]["pp"] == 1 and runs[0].get("deployed", True) else None
            rates: list[float] = []
            for i in range(a.pairs):
                for j in order if i % 2 == 0 else order[::-1]:
                    parts[j].append(run_streams(meshes[j].address, prompt_ids, a.new_tokens, 1, repeats=1))
                    if probed is not None and j == 0:
                        rates += probed(runs[0]["threads"], PROBE_PASSES)
            found = [{1: merged(parts[0])}, {1: merged(parts[1])}]
            if rates:
                found[0][1]["probe_gbps"] = rates
            found[1][1]["boundary_each"] = [b["ms_per_token"] - x["ms_per_token"] for x, b in zip(*parts, strict=True)]
        for j in order if len(runs) == 2 else range(len(runs)):
            for n in runs[j]["streams"]:
                if n not in found[j]:
                    found[j][n] = run_streams(meshes[j].address, prompt_ids, a.new_tokens, n)
        rows = []
        for run, mesh, by_n in zip(runs, meshes, found, strict=True):
            rss = [round(x / 2**20) for x in mesh.worker_peak_rss()]
            seen = {"layers": mesh.layers(), "links": mesh.links(), "compute_priority": mesh.priorities(),
                    "bf16_rows": mesh.bf16_rows()}  # fmt: skip
            for n in run["streams"]:
                r = {**by_n[n], **{k: v for k, v in run.items() if k != "streams"}}
                print(f"round {run.get('round', 1)} {run['dtype']} pp={run['pp']} tp={run['tp']} "
                      f"pipeline={run['pipeline']} threads={run['threads']}: {r}", file=sys.stderr)  # fmt: skip
                rows.append({**r, "worker_peak_rss_mib": rss, **seen})
        return rows


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    print(f"machine: {info}", file=sys.stderr)
    # The transformers baselines once, first; llama.cpp beside the meshes of its dtype in every round. No mesh
    # runs while a baseline does: each is closed, its processes gone, before the next thing starts.
    bases, probes = {}, {}
    for dtype in a.dtype_list:
        bases[dtype] = baseline_transformers(model_dir, prompt_ids, a.new_tokens, dtype)
        print(f"transformers {dtype}: {bases[dtype]}", file=sys.stderr)
        bases[dtype]["llama_cpp_rounds"], bases[dtype]["probe_llama_rounds"] = [], []
        probes[dtype], bases[dtype]["weight_bytes"], bases[dtype]["probe_skipped"] = prober(model_dir, dtype)
    rows = []
    for number in range(a.rounds):
        for dtype in a.dtype_list:
            planned = boundary_pairs(plan_runs(a.layout_list, a.stream_list, dtype))
            steps: list[list[dict] | None] = [None, *planned]  # None: llama.cpp
            probe = probes[dtype]
            for step in steps if number % 2 == 0 else steps[::-1]:
                if step is None:
                    around = probe(info["cores"], LLAMA_PROBE_PASSES) if probe is not None else []
                    llama = baseline_llamacpp(a.model, prompt_ids, a.new_tokens, info["cores"], dtype)
                    if probe is not None and "skipped" not in llama:
                        around += probe(info["cores"], LLAMA_PROBE_PASSES)
                    print(f"round {number + 1} llama.cpp {dtype}: {llama}", file=sys.stderr)
                    bases[dtype]["llama_cpp_rounds"].append(llama)
                    bases[dtype]["probe_llama_rounds"].append(around)
                    continue
                group = [{**run, "round": number + 1} for run in step]
                try:
                    rows += run_meshes(model_dir, group, prompt_ids, a, flip=number % 2 == 1, probe=probe)
                except Exception as exc:  # one layout or dtype that will not serve must not lose the others' numbers
                    failure = one_line(exc)
                    for run in group:
                        print(f"{dtype} pp={run['pp']} tp={run['tp']}: FAILED {failure}", file=sys.stderr)
                        rows.append({**{k: v for k, v in run.items() if k != "streams"}, "failed": failure})
    for base in bases.values():
        base["llama_cpp"] = base["llama_cpp_rounds"][0]
        base["probe_llama"] = base["probe_llama_rounds"][0]
    report(info, bases, rows, a, Path(a.out))


def prober(model_dir: Path, dtype: str) -> tuple[Probe | None, int | None, str]:
    """The read probe over `dtype`'s weights' bytes (`read_probe`): the probe, those bytes, and "" ; or None and why
    not (a checkpoint it cannot size, a probe that will not build), which the report says in place of the floor."""
    try:
        size = read_probe.weight_bytes(model_dir, dtype)
        read_probe.measure(size, 1, 1)  # builds it, and touches the buffer's pages
    except Exception as exc:  # the bench's other numbers stand without it
        return None, None, one_line(exc)
    return (lambda threads, passes: read_probe.measure(size, threads, passes)), size, ""


# --------------------------------------------------------------------------------------------------
# Derived numbers and their targets
# --------------------------------------------------------------------------------------------------


def _measured(rows: list[dict], dtype: str) -> list[dict]:
    return [r for r in rows if r["dtype"] == dtype and "failed" not in r]


def _deployed(rows: list[dict], pp: int, tp: int = 1) -> dict[str, dict[int, dict]]:
    """{pipeline: {streams: row}} of the runs with `up`'s own thread counts (not the extra baseline runs)."""
    out: dict[str, dict[int, dict]] = {}
    for r in rows:
        if (r["pp"], r["tp"]) == (pp, tp) and r.get("deployed", True):
            out.setdefault(r["pipeline"], {})[r["streams"]] = r
    return out


def _one_stream_pp1(rows: list[dict]) -> dict | None:
    return next(iter(_deployed(rows, 1).values()), {}).get(1)


def _target(name: str, dtype: str, value: float | None, unit: str, op: str, goal: float | None, detail: str = "",
            why_none: str = "") -> dict:  # fmt: skip
    """One derived number beside its target: `met` is True/False, or None where it was not measured (`value`
    None, `why_none` says what it needs) or no target applies here (`goal` None, `why_none` says why)."""
    met = None
    if value is not None and goal is not None:
        met = value >= goal if op == ">=" else value <= goal
    return {"name": name, "dtype": dtype, "value": value, "unit": unit, "target": None if goal is None else
            f"{op} {goal:g}{unit}", "met": met, "detail": detail, "note": why_none, "op": op,
            "goal": goal}  # fmt: skip


def llama_target(dtype: str, llama: dict, rows: list[dict], flags: list[str]) -> dict:
    """pp=1 one stream against llama.cpp on the GGUF of the same type: llama.cpp's median ms/token over ours
    (> 1: faster than llama.cpp). Target >= 1 for float32, and for bfloat16 where the CPU has native bf16."""
    name = "pp=1 one stream vs llama.cpp, same dtype (llama.cpp ms/token ÷ ours)"
    goal, why = 1.0, ""
    if dtype == "bfloat16" and not set(NATIVE_BF16_FLAGS) & set(flags):
        goal, why = None, f"no target: this CPU lacks {' and '.join(NATIVE_BF16_FLAGS)}"
    elif dtype == "float16":
        goal, why = None, "no target for float16"
    ours = _one_stream_pp1(rows)
    if not llama or "skipped" in llama:
        return _target(name, dtype, None, "×", ">=", goal, why_none=f"llama.cpp not measured: "
                       f"{llama.get('skipped', 'not run')}")  # fmt: skip
    if ours is None:
        return _target(name, dtype, None, "×", ">=", goal, why_none="needs --layouts 1x1 and --streams 1")
    detail = (f"llama.cpp {llama['gguf_type']} {llama['ms_per_token_median']:.2f} ms/token, shardmesh "
              f"{ours['ms_per_token']:.2f}")  # fmt: skip
    return _target(name, dtype, llama["ms_per_token_median"] / ours["ms_per_token"], "×", ">=", goal, detail, why)


def floor_targets(dtype: str, base: dict, rows: list[dict]) -> list[dict]:
    """How near this host's memory floor one stream decodes, pp=1 and llama.cpp: the floor (`weight_bytes` at the
    median of the read probe's passes beside each, `read_probe.floor_ms`) over its ms per token; 1 is at the floor.
    No target: what the target against llama.cpp is set beside."""
    note = "no target: the floor is the weights' bytes at the read probe's rate"
    size, ours, llama = base.get("weight_bytes"), _one_stream_pp1(rows), base.get("llama_cpp") or {}
    out = []
    for name, ms, rates in (
        ("pp=1 one stream ÷ this host's memory floor (floor ms ÷ ours)", ours and ours.get("ms_per_token"),
         ours and ours.get("probe_gbps")),
        ("llama.cpp one stream ÷ the same floor (floor ms ÷ its ms)", llama.get("ms_per_token_median"),
         base.get("probe_llama")),
    ):  # fmt: skip
        if not size or not ms or not rates:
            why = base.get("probe_skipped") or "needs the read probe, --layouts 1x1 and --streams 1 (and llama.cpp)"
            out.append(_target(name, dtype, None, "×", ">=", None, why_none=f"not measured: {why}"))
            continue
        floor = read_probe.floor_ms(size, rates)
        detail = (f"floor {floor:.2f} ms: {size / 1e6:.0f} MB at {statistics.median(rates):.1f} GB/s (median of "
                  f"{len(rates)} passes), against {ms:.2f} ms/token")  # fmt: skip
        out.append(_target(name, dtype, floor / ms, "×", ">=", None, detail, note))
    return out


def tp_target(dtype: str, rows: list[dict], cores: int | None = None) -> dict:
    """tp=3 one stream against pp=1, per token. Target: within 1.1x where the run had a core per rank (`cores`, the
    CPUs it could use, at least 3), else within 1.5x: three one-thread ranks on two cores finish a step in two
    rank-times while pp=1's two threads take 1.5 (docs/performance.md, "tp=3 on two cores: at its floor")."""
    name = "tp=3 vs pp=1 per token, one stream (tp=3 ms/token ÷ pp=1)"
    goal = TP_GOAL_CORE_PER_RANK if cores is not None and cores >= 3 else TP_GOAL_SHARED_CORES
    pp1, tp3 = _one_stream_pp1(rows), next(iter(_deployed(rows, 1, 3).values()), {}).get(1)
    if pp1 is None or tp3 is None:
        return _target(name, dtype, None, "×", "<=", goal, why_none="needs --layouts 1x1,1x3 and --streams 1")
    detail = f"{tp3['ms_per_token']:.2f} vs {pp1['ms_per_token']:.2f} ms/token"
    return _target(name, dtype, tp3["ms_per_token"] / pp1["ms_per_token"], "×", "<=", goal, detail)


def boundary_targets(dtype: str, rows: list[dict]) -> list[dict]:
    """One stream's per-token latency, pp=2 minus pp=1 (tp=1) with the same threads per worker and decode steps
    per call, per pipeline mode (target <= 0.5 ms); against pp=1 as deployed (all the cores, several decode steps
    per call) beside it. Rows of runs before decode steps were recorded made one call per token at pp=2."""
    single = [r for r in rows if r["streams"] == 1 and r["tp"] == 1]
    pp1 = {(r["threads"], r.get("decode_steps", 1)): r for r in single if r["pp"] == 1}
    deployed = _one_stream_pp1(rows)
    out = []
    for r in sorted((r for r in single if r["pp"] == 2), key=lambda r: r["pipeline"], reverse=True):
        steps = r.get("decode_steps", 1)
        name = (f"stage boundary, `--pipeline {r['pipeline']}` (pp=2 minus pp=1, one stream, same threads/worker "
                f"and decode steps per call)")  # fmt: skip
        same = pp1.get((r["threads"], steps))
        detail = f"each stage on {r['threads']} thread(s), {steps} decode step(s) per call"
        if deployed is not None:
            detail += f"; {r['ms_per_token'] - deployed['ms_per_token']:+.2f} ms against pp=1 as deployed"
        if same is None:
            out.append(_target(name, dtype, None, " ms", "<=", BOUNDARY_GOAL_MS, detail,
                               f"needs pp=1 on {r['threads']} thread(s), {steps} decode step(s) per call"))  # fmt: skip
        elif r.get("boundary_each"):  # up beside its pp=1, requests alternated: the median of the pairs' differences
            each = r["boundary_each"]
            detail += (f"; up beside that pp=1, the median of {len(each)} alternated requests' differences "
                       f"({min(each):+.2f} to {max(each):+.2f})")  # fmt: skip
            out.append(_target(name, dtype, statistics.median(each), " ms", "<=", BOUNDARY_GOAL_MS, detail))
        else:
            boundary = r["ms_per_token"] - same["ms_per_token"]
            out.append(_target(name, dtype, boundary, " ms", "<=", BOUNDARY_GOAL_MS, detail))
    if not out:
        out.append(_target("stage boundary (pp=2 minus pp=1, one stream)", dtype, None, " ms", "<=", BOUNDARY_GOAL_MS,
                           why_none="needs --layouts 1x1,2x1 and --streams 1"))  # fmt: skip
    return out


def pooled_boundaries(rows: list[dict], goal: float = BOUNDARY_GOAL_MS) -> list[dict]:
    """Per dtype and pipeline mode, every round's stage-boundary pairs (`boundary_each`) taken together: their
    median, its `median_interval`, and what the interval says of the target. A round's median of its pairs moves
    by more than the target from round to round on a noisy host; the pooled pairs say whether the run could tell
    the boundary from the target at all."""
    pooled: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.get("boundary_each"):
            pooled.setdefault((r["dtype"], r["pipeline"]), []).extend(r["boundary_each"])
    out = []
    for (dtype, pipeline), each in pooled.items():
        interval = median_interval(each)
        side = interval_side(interval, goal) if interval is not None else None
        if side is None:
            verdict = "too few pairs to tell"
        elif side == "at or below":
            verdict = f"all of it at or below {goal} ms: **met**, beyond this run's noise"
        elif side == "above":
            verdict = f"all of it above {goal} ms: **not met**, beyond this run's noise"
        else:
            verdict = f"the interval holds {goal} ms: this run cannot tell the boundary from the target"
        out.append({"dtype": dtype, "pipeline": pipeline, "pairs": len(each), "median": statistics.median(each),
                    "interval": interval, "verdict": verdict})  # fmt: skip
    return out


def throughput_targets(dtype: str, rows: list[dict]) -> list[dict]:
    """pp=2 aggregate tokens/s over pp=1 (tp=1) at 16 streams per pipeline mode (target >= 0.9x), and 16
    streams over one stream for each (target >= 6x)."""
    pp1 = next(iter(_deployed(rows, 1).values()), {})
    pp2_modes = sorted(_deployed(rows, 2).items(), reverse=True)  # turns, then full
    out = []
    for pipeline, pp2 in pp2_modes or [("", {})]:
        name = f"pp=2{f' `--pipeline {pipeline}`' if pipeline else ''} ÷ pp=1 at 16 streams, aggregate tok/s"
        if 16 in pp1 and 16 in pp2:
            others = ", ".join(f"{n} streams {pp2[n]['aggregate_tok_s'] / pp1[n]['aggregate_tok_s']:.2f}×"
                               for n in sorted(pp2) if n in pp1 and n != 16)  # fmt: skip
            out.append(_target(name, dtype, pp2[16]["aggregate_tok_s"] / pp1[16]["aggregate_tok_s"], "×", ">=", 0.9,
                               others))  # fmt: skip
        else:
            out.append(_target(name, dtype, None, "×", ">=", 0.9, why_none="needs --layouts 1x1,2x1 and 16 streams"))
    for label, by_n in [("pp=1", pp1)] + [(f"pp=2 `{p}`", r) for p, r in pp2_modes]:
        name = f"16 streams ÷ one stream, {label}, aggregate tok/s"
        if 1 in by_n and 16 in by_n:
            out.append(_target(name, dtype, by_n[16]["aggregate_tok_s"] / by_n[1]["aggregate_tok_s"], "×", ">=", 6.0))
        else:
            out.append(_target(name, dtype, None, "×", ">=", 6.0, why_none="needs --streams 1,16"))
    return out


def targets(bases: dict[str, dict], rows: list[dict], flags: list[str], cores: int | None = None) -> list[dict]:
    """Every derived line of one round: its rows, and its llama.cpp (`llama_cpp`) per dtype; `cores`: the CPUs the
    run could use (the tp target depends on it)."""
    out = []
    for dtype, base in bases.items():
        mine = _measured(rows, dtype)
        out.append(llama_target(dtype, base.get("llama_cpp") or {}, mine, flags))
        out += floor_targets(dtype, base, mine)
        out.append(tp_target(dtype, mine, cores))
        out += boundary_targets(dtype, mine)
        out += throughput_targets(dtype, mine)
    return out


def round_targets(bases: dict[str, dict], rows: list[dict], flags: list[str],
                  cores: int | None = None) -> list[dict]:  # fmt: skip
    """The derived lines of a run of one or more rounds: each line computed within each round (that round's
    meshes and llama.cpp, `llama_cpp_rounds`), then the median of the rounds' values beside the target, their
    range, and each round's value in `rounds` (None where that round lacks it). One round: that round's lines."""
    numbers = sorted({r.get("round", 1) for r in rows}) or [1]
    per_round = []
    for number in numbers:
        mine = [r for r in rows if r.get("round", 1) == number]
        here = {dtype: {**base, "llama_cpp": _nth(base.get("llama_cpp_rounds"), number - 1, base.get("llama_cpp")),
                        "probe_llama": _nth(base.get("probe_llama_rounds"), number - 1, base.get("probe_llama"))}
                for dtype, base in bases.items()}  # fmt: skip
        per_round.append({(t["dtype"], t["name"]): t for t in targets(here, mine, flags, cores)})
    if len(per_round) == 1:
        return list(per_round[0].values())
    out = []
    for key in dict.fromkeys(k for found in per_round for k in found):  # every line once, in first-seen order
        seen = [found.get(key) for found in per_round]
        values = [t["value"] if t else None for t in seen]
        measured = [v for v in values if v is not None]
        at, first = next((i, t) for i, t in enumerate(seen) if t)
        if not measured:
            out.append({**first, "rounds": values})
            continue
        median = statistics.median(measured)
        line = _target(first["name"], first["dtype"], median, first["unit"], first["op"], first["goal"],
                       why_none=first["note"])  # fmt: skip
        shown = ", ".join("–" if v is None else _shown(v, first["unit"]) for v in values)
        line["detail"] = f"median of {len(measured)} rounds ({shown})"
        if first["detail"]:
            line["detail"] += f"; round {numbers[at]}: {first['detail']}"
        out.append({**line, "rounds": values, "range": [min(measured), max(measured)]})
    return out


def _nth(items: list | None, i: int, default: object) -> object:
    return items[i] if items and i < len(items) else default


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _target_line(t: dict) -> str:
    if t["value"] is None:
        return f"- {t['dtype']}: {t['name']}: not measured ({t['note']})."
    number = _shown(t["value"], t["unit"]) + t["unit"]
    spread = ""
    if t.get("range"):
        low, high = (_shown(x, t["unit"]) for x in t["range"])
        spread = f" (range {low} to {high})"
    verdict = ("**met**" if t["met"] else "**not met**") if t["met"] is not None else t["note"]
    target = f"target {t['target']}: {verdict}" if t["target"] else verdict
    detail = f"; {t['detail']}" if t["detail"] else ""
    return f"- {t['dtype']}: {t['name']}: **{number}**{spread} ({target}{detail})."


def _shown(value: float, unit: str) -> str:
    """A derived number as the report prints it: milliseconds signed (a difference), ratios not."""
    return f"{value:+.2f}" if unit == " ms" else f"{value:.2f}"


def _llama_line(dtype: str, llama: dict) -> str:
    if not llama or "skipped" in llama:
        return f"llama.cpp, {dtype}: not measured ({llama.get('skipped', 'not run')})."
    fallback = f" ({llama['fallback']})" if llama.get("fallback") else ""
    return (f"llama.cpp, {dtype} (llama-cpp-python {llama['llama_cpp']}, {llama['gguf_type']} GGUF of the same "
            f"weights{fallback}, {llama['threads']} threads, same run): **{llama['decode_tok_s']:.1f} tok/s** "
            f"({llama['ms_per_token_median']:.1f} ms/token median), TTFT {llama['ttft_ms']:.0f} ms.")  # fmt: skip


def _row_line(r: dict, base: dict, rounds: bool = False) -> str:
    mode = r["pipeline"] if r["pp"] > 1 else "a call per token" if r.get("decode_steps") == 1 else ""
    if r["pp"] > 1 and r.get("decode_steps", 1) > 1:
        mode += f", {r['decode_steps']} steps per call"
    if r.get("links"):
        mode += f", links over {'/'.join(r['links'])}"
    head = f"| {r.get('round', 1)} |" if rounds else "|"
    head += f" {r['dtype']} | {r['pp']} | {r['tp']} | {mode} |"
    if "failed" in r:
        return f"{head} | {r['threads']} | | failed: {r['failed']} | | | | |"
    tok_s = 1e3 / r["ms_per_token"] if r["streams"] == 1 else r["aggregate_tok_s"]
    return (f"{head} {r.get('layers', '')} | {r['threads']} | {r['streams']} | {r['ms_per_token']:.1f} | "
            f"{r['ttft_ms']:.0f} | {r['aggregate_tok_s']:.1f} | {tok_s / base['decode_tok_s']:.2f} | "
            f"{r.get('worker_peak_rss_mib', '')} |")  # fmt: skip


def markdown(info: dict, bases: dict[str, dict], rows: list[dict], found: list[dict], a: argparse.Namespace) -> str:
    lines = [
        f"## shardmesh vs transformers and llama.cpp — {info['cpu']} ({info.get('cpu_id', '')}), {info['cores']} "
        f"cores, torch {info['torch']}, {info['date']}",
        "",
        f"CPU flags that pick kernels: {' '.join(info.get('cpu_flags', [])) or 'none of interest'}. Load average "
        f"(1 min) at the start {info.get('load_avg_1m', '?')}, at the end {info.get('load_avg_1m_end', '?')}.",
        f"Model `{a.model}` in {', '.join(bases)}, greedy, chat prompt of {PROMPT!r}, {a.new_tokens} new tokens; "
        f"pipeline layouts started with `--rebalance {a.rebalance}`.",
    ]  # fmt: skip
    rounds = a.rounds > 1
    if rounds:
        lines += [f"{a.rounds} rounds of llama.cpp and every mesh, alternated (odd rounds in the planned order, "
                  "even rounds reversed, the table in the order they ran); each derived line is computed within "
                  "each round, then the median of the rounds' values is set against its target."]  # fmt: skip
    if paired := [len(r["boundary_each"]) for r in rows if r.get("boundary_each")]:
        lines += [f"Each pp=2 mesh was up at once with the pp=1 mesh it is set against for the stage boundary, their "
                  f"one-stream requests alternated ({max(paired)} each, A B B A ...): the boundary is the median "
                  "of the adjacent pairs' differences."]  # fmt: skip
    for dtype, base in bases.items():
        lines += ["", f"Baseline `transformers.generate` {dtype} (same run): **{base['decode_tok_s']:.1f} tok/s** "
                      f"decode ({base['ms_per_token']:.1f} ms/token), TTFT {base['ttft_ms']:.0f} ms.",
                  _llama_line(dtype, base.get("llama_cpp") or {})]  # fmt: skip
        each = [x.get("ms_per_token_median") for x in base.get("llama_cpp_rounds") or []]
        if rounds and all(each):
            lines.append(f"llama.cpp {dtype} ms/token in rounds 1-{len(each)}: {', '.join(f'{x:.2f}' for x in each)}.")
        lines.append(_probe_line(dtype, base, rows))
    lines += [
        "",
        ("| round " if rounds else "") + "| dtype | pp | tp | pipeline | layers per stage | threads/worker | streams | "
        "decode ms/token (median) | TTFT ms | aggregate tok/s | × transformers (same dtype) | worker peak RSS MiB |",
        ("|---:" if rounds else "") + "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    lines += [_row_line(r, bases[r["dtype"]], rounds) for r in rows]
    lines += ["", "Targets (this run's rows; ratios > 1 against llama.cpp mean faster than llama.cpp):", ""]
    lines += [_target_line(t) for t in found]
    if pooled := pooled_boundaries(rows):
        lines += ["", "The stage boundary with every round's pairs pooled: their median, and a 95% interval of it "
                      "that assumes nothing of their distribution (`median_interval`):", ""]  # fmt: skip
        lines += [_pooled_line(p) for p in pooled]
    return "\n".join(lines) + "\n"


def _probe_line(dtype: str, base: dict, rows: list[dict]) -> str:
    """The read probe's rates in each round, beside llama.cpp and between pp=1's requests (`floor_targets`)."""
    if not base.get("weight_bytes"):
        return f"Read probe, {dtype}: not measured ({base.get('probe_skipped') or 'not run'})."
    beside = [statistics.median(x) for x in base.get("probe_llama_rounds") or [] if x]
    between = [statistics.median(r["probe_gbps"]) for r in _measured(rows, dtype) if r.get("probe_gbps")]

    def shown(rates: list[float]) -> str:
        return ", ".join(f"{x:.1f}" for x in rates) or "none"

    return (f"Read probe, {dtype} ({base['weight_bytes'] / 1e6:.0f} MB, the weights one step of one stream reads; "
            f"bench/read_probe.py), GB/s by round: beside llama.cpp {shown(beside)}; between pp=1's requests "
            f"{shown(between)}.")  # fmt: skip


def _pooled_line(p: dict) -> str:
    if p["interval"] is None:
        return (f"- {p['dtype']}, `--pipeline {p['pipeline']}`: median **{p['median']:+.2f} ms** of {p['pairs']} "
                f"pairs (too few for an interval).")  # fmt: skip
    low, high = p["interval"]
    return (f"- {p['dtype']}, `--pipeline {p['pipeline']}`: median **{p['median']:+.2f} ms** of {p['pairs']} pairs, "
            f"interval {low:+.2f} to {high:+.2f} ms: {p['verdict']}.")  # fmt: skip


def report(info: dict, bases: dict[str, dict], rows: list[dict], a: argparse.Namespace, out: Path) -> None:
    info = {**info, "load_avg_1m_end": round(os.getloadavg()[0], 2)}  # how busy the shared machine was
    found = round_targets(bases, rows, info.get("cpu_flags", []), info.get("cores"))
    data = {"baselines": bases, "rows": rows, "targets": found, "boundary_pooled": pooled_boundaries(rows), "options": {
        "layouts": a.layouts, "streams": a.streams, "dtypes": a.dtypes, "new_tokens": a.new_tokens,
        "rebalance": a.rebalance, "quick": a.quick, "rounds": a.rounds, "pairs": a.pairs}}  # fmt: skip
    save_results(out, info, "", markdown(info, bases, rows, found, a), data)


if __name__ == "__main__":
    main()
