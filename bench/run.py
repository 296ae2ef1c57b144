"""One command, one results table: shardmesh against `transformers` on the same model, prompts and machine.

    .venv/bin/python bench/run.py [--model smollm2-135m-instruct] [--layouts 1x1,2x1,1x3,2x3] [--streams 1,4,16,64]

Writes bench/results/<host>-<date>.{md,json} and prints the markdown. Every number is measured in
this run: the baselines first (`transformers` fp32 `generate`, greedy, same prompt and lengths; and
llama.cpp on an F32 GGUF of the same weights when llama-cpp-python is installed: `pip install '.[bench]'`,
see bench/llamacpp.py), then the mesh (`shardmesh up` for each pp×tp layout, requests through the gateway).
Layouts use tp=3, not 2: SmolLM2's 9 attention heads cannot be split in 2.

- single stream: decode tokens/s = completion tokens / (total - time to first token), TTFT as the
  gateway reports it (queue wait + prefill + first step), and client-side totals; the median of 3
  requests in a row.
- aggregate: N concurrent streams, total completion tokens / wall time of the slowest.
- pp=2 (tp=1) runs twice, once per `up --pipeline`: `turns` (the default on CPU: one step in flight,
  each stage on all the cores when its turn comes) and `full` (two micro-batches in flight, every stage
  busy at once, one core each). Both stages share this machine's cores either way.
- stage boundary: per-token latency of pp=2 minus pp=1 (both tp=1, one stream) with the same torch threads
  per worker (for `full`, one extra pp=1 run with `--worker-threads` = what a pp=2 stage gets there), i.e.
  what one extra hop costs; and as deployed (pp=1 on all the cores).
- pipeline: aggregate tokens/s of pp=2 over pp=1 (both tp=1) at each stream count, for each pipeline
  mode (issue 5's target: >= 0.9x at 16 streams); and 16 streams over one stream (target: >= 6x).
- memory: peak RSS of every worker process (psutil), next to the planner-free raw weights size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llamacpp  # noqa: E402  (the repository root is on the path only now)
from bench.conditions import PROMPT, machine, save_results  # noqa: E402
from shardmesh.rpc.procs import cores  # noqa: E402
from shardmesh_cli.up import share_cores  # noqa: E402


def baseline_transformers(model_dir: Path, prompt_ids: list[int], new_tokens: int) -> dict:
    """`transformers` greedy generate, fp32, all cores: TTFT from a 1-token run, decode from the rest."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
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


def baseline_llamacpp(model: str, prompt_ids: list[int], new_tokens: int, threads: int) -> dict:
    """llama.cpp on an F32 GGUF of the very weights the mesh serves (bench/llamacpp.py), when
    llama-cpp-python is installed (`pip install '.[bench]'`); otherwise why not, for the table."""
    reason = llamacpp.available()
    if reason is not None:
        return {"skipped": reason}
    out = llamacpp.measure(llamacpp.f32_gguf(model=model), prompt_ids, new_tokens, threads=threads)
    out.pop("token_ids", None)
    return out


class Mesh:
    """`shardmesh up` of this checkout, or of another one (`tree`: a checkout of an earlier commit, for
    bench/against.py), started as its own process tree and stopped by `close`."""

    def __init__(self, model_dir: Path, pp: int, tp: int, pipeline: str, slots: int, log_dir: Path, threads: int,
                 rebalance: str, tree: Path = ROOT, extra: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.log_dir = log_dir
        # Earlier checkouts ran the command as `shardmesh.cli`; it lives in `shardmesh_cli` since the layering.
        command = "shardmesh_cli" if (tree / "shardmesh_cli").is_dir() else "shardmesh.cli"
        args = [sys.executable, "-m", command, "up", "--model", str(model_dir), "--pp", str(pp),
                "--tp", str(tp), "--pipeline", pipeline, "--kv-slots", str(slots), "--max-context", "1024",
                "--rebalance", rebalance, "--worker-threads", str(threads), "--log-dir", str(log_dir),
                *extra]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree)}  # that checkout's packages first, whatever is installed
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=tree)
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

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_streams(address: str, prompt_ids: list[int], new_tokens: int, n: int) -> dict:
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop=[])
    req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids), params=params)
    results: list = []

    def one() -> None:
        results.append(stub.Generate(req, timeout=600))

    stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids[:8]),
                                              params=gateway_pb2.SamplingParams(max_new_tokens=2)))  # fmt: skip
    # One stream is measured 3 times in a row (the median of the 3): single runs of it moved by 2-5 ms
    # between otherwise identical runs, as much as the stage boundary being measured.
    wall = 0.0
    for _ in range(3 if n == 1 else 1):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layouts", default="1x1,2x1,1x3,2x3", help="pp x tp pairs (tp must divide the heads)")
    ap.add_argument("--streams", default="1,4,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rebalance", default="none", choices=["none", "by-speed"],
                    help="pp >= 2: split layers evenly (default) or by measured stage speeds")  # fmt: skip
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()

    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    print(f"machine: {info}", file=sys.stderr)
    base = baseline_transformers(model_dir, prompt_ids, a.new_tokens)
    print(f"transformers: {base}", file=sys.stderr)
    llama = baseline_llamacpp(a.model, prompt_ids, a.new_tokens, info["cores"])
    print(f"llama.cpp: {llama}", file=sys.stderr)
    base["llama_cpp"] = llama
    streams = [int(s) for s in a.streams.split(",")]
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in a.layouts.split(",")]
    runs = []
    for pp, tp in layouts:
        for pipeline in ("turns", "full") if (pp, tp) == (2, 1) else ("auto",):
            share = share_cores(pp, tp, "cpu", pipeline, None, cores())
            runs.append((pp, tp, share.pipeline, share.worker_threads, streams, True))
    stage_threads = {t for pp, tp, _, t, _, _ in runs if (pp, tp) == (2, 1)} - {t for pp, tp, _, t, _, _ in runs
                                                                               if (pp, tp) == (1, 1)}  # fmt: skip
    if (1, 1) in layouts and 1 in streams:  # the stage boundary's like-for-like baseline, not a deployed layout
        runs += [(1, 1, "full", t, [1], False) for t in sorted(stage_threads)]
    rows = []
    for pp, tp, pipeline, threads, counts, deployed in runs:
        with tempfile.TemporaryDirectory() as logs:
            mesh = Mesh(model_dir, pp, tp, pipeline, max(streams), Path(logs), threads, a.rebalance)
            try:
                mine = []
                for n in counts:
                    r = run_streams(mesh.address, prompt_ids, a.new_tokens, n)
                    r.update(pp=pp, tp=tp, pipeline=pipeline, threads=threads, deployed=deployed)
                    mine.append(r)
                    print(f"pp={pp} tp={tp} pipeline={pipeline} threads={threads}: {r}", file=sys.stderr)
                rss = [round(x / 2**20) for x in mesh.worker_peak_rss()]
                rows += [{**r, "worker_peak_rss_mib": rss, "layers": mesh.layers()} for r in mine]
            finally:
                mesh.close()
    report(info, base, rows, a, Path(a.out))


def _deployed(rows: list[dict], pp: int, tp: int = 1) -> dict[str, dict[int, dict]]:
    """{pipeline: {streams: row}} of the runs with `up`'s own thread counts (not the extra baseline runs)."""
    out: dict[str, dict[int, dict]] = {}
    for r in rows:
        if (r["pp"], r["tp"]) == (pp, tp) and r.get("deployed", True):
            out.setdefault(r["pipeline"], {})[r["streams"]] = r
    return out


def pipeline_ratios(rows: list[dict]) -> list[str]:
    """pp=2 aggregate tokens/s over pp=1 (tp=1) at each stream count, per pipeline mode; and 16 streams
    over one stream (both of issue 5's throughput targets, from this run's rows)."""
    pp1 = next(iter(_deployed(rows, 1).values()), {})
    pp2_modes = sorted(_deployed(rows, 2).items(), reverse=True)  # turns, then full
    lines = []
    for pipeline, pp2 in pp2_modes:
        ratios = {n: pp2[n]["aggregate_tok_s"] / pp1[n]["aggregate_tok_s"] for n in sorted(pp2) if n in pp1}
        if ratios:
            parts = [f"{n} streams **{r:.2f}×**" if n == 16 else f"{n} streams {r:.2f}×" for n, r in ratios.items()]
            lines.append(f"Pipeline, `--pipeline {pipeline}` (pp=2 aggregate ÷ pp=1 aggregate, tp=1; target ≥ 0.9× at "
                         f"16 streams): {', '.join(parts)}.")  # fmt: skip
    modes = [("pp=1", pp1)] + [(f"pp=2 `{p}`", r) for p, r in pp2_modes]
    shown = [f"{label} **{r[16]['aggregate_tok_s'] / r[1]['aggregate_tok_s']:.2f}×**" for label, r in modes
             if 1 in r and 16 in r]  # fmt: skip
    if shown:
        lines.append(f"16 streams ÷ one stream, aggregate tok/s (target ≥ 6×): {', '.join(shown)}.")
    return _paragraphs(lines)


def _paragraphs(lines: list[str]) -> list[str]:
    """Each line as its own markdown paragraph, after the table."""
    return [x for line in lines for x in ("", line)]


def _llama_line(llama: dict, single_pp1: dict | None) -> str:
    if "skipped" in llama or not llama:
        return f"llama.cpp: not measured ({llama.get('skipped', 'not run')})."
    line = (f"llama.cpp (llama-cpp-python {llama['llama_cpp']}, F32 GGUF of the same weights, {llama['threads']} "
            f"threads, same run): **{llama['decode_tok_s']:.1f} tok/s** ({llama['ms_per_token_median']:.1f} ms/token "
            f"median), TTFT {llama['ttft_ms']:.0f} ms")  # fmt: skip
    if single_pp1 is not None:
        speed = llama["ms_per_token_median"] / single_pp1["ms_per_token"]
        line += f"; shardmesh pp=1, one stream, decodes at {speed:.2f}× its speed"
    return line + "."


def stage_boundary(rows: list[dict]) -> list[str]:
    """One stream's per-token latency, pp=2 minus pp=1 (tp=1): at equal threads per worker, and as deployed."""
    single = [r for r in rows if r["streams"] == 1 and r["tp"] == 1]
    pp1 = {r["threads"]: r["ms_per_token"] for r in single if r["pp"] == 1}
    deployed = next((r for r in single if r["pp"] == 1 and r.get("deployed", True)), None)
    lines = []
    for r in sorted((r for r in single if r["pp"] == 2), key=lambda r: r["pipeline"], reverse=True):
        parts = []
        if r["threads"] in pp1:
            parts.append(f"**{r['ms_per_token'] - pp1[r['threads']]:+.2f} ms per decode step** against pp=1 on the "
                         f"same {r['threads']} thread(s)")  # fmt: skip
        if deployed is not None and deployed["threads"] != r["threads"]:
            parts.append(f"{r['ms_per_token'] - deployed['ms_per_token']:+.2f} ms against pp=1 as deployed")
        if parts:
            lines.append(f"Stage boundary, `--pipeline {r['pipeline']}` (pp=2 minus pp=1, tp=1, one stream; each stage "
                         f"on {r['threads']} thread(s)): {'; '.join(parts)}.")  # fmt: skip
    return _paragraphs(lines)


def report(info: dict, base: dict, rows: list[dict], a: argparse.Namespace, out: Path) -> None:
    lines = [
        f"## shardmesh vs transformers — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['date']}",
        "",
        f"Model `{a.model}` float32, greedy, chat prompt of {PROMPT!r}, {a.new_tokens} new tokens; "
        f"pipeline layouts started with `--rebalance {a.rebalance}`.",
        f"Baseline `transformers.generate` (same run): **{base['decode_tok_s']:.1f} tok/s** decode "
        f"({base['ms_per_token']:.1f} ms/token), TTFT {base['ttft_ms']:.0f} ms.",
        _llama_line(base.get("llama_cpp") or {}, single_pp1=_deployed(rows, 1).get("full", {}).get(1)),
        "",
        "| pp | tp | pipeline | layers per stage | threads/worker | streams | decode ms/token (median) | TTFT ms "
        "| aggregate tok/s | × transformers | worker peak RSS MiB |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in rows:
        ratio = (
            (1e3 / r["ms_per_token"]) / base["decode_tok_s"]
            if r["streams"] == 1
            else r["aggregate_tok_s"] / base["decode_tok_s"]
        )
        lines.append(f"| {r['pp']} | {r['tp']} | {r['pipeline'] if r['pp'] > 1 else ''} | {r.get('layers', '')} | "
                     f"{r['threads']} | {r['streams']} | "
                     f"{r['ms_per_token']:.1f} | {r['ttft_ms']:.0f} | {r['aggregate_tok_s']:.1f} | {ratio:.2f} | "
                     f"{r.get('worker_peak_rss_mib', '')} |")  # fmt: skip
    lines += stage_boundary(rows)
    lines += pipeline_ratios(rows)
    md = "\n".join(lines) + "\n"
    save_results(out, info, "", md, {"baseline": base, "rows": rows})


if __name__ == "__main__":
    main()
