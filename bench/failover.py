"""What a client sees when a stage worker dies mid-stream, next to an undisturbed run in the same invocation.

    .venv/bin/python bench/failover.py [--model smollm2-135m-instruct] [--pp 2] [--streams 16] [--new-tokens 96]

One `shardmesh up` mesh serves both runs: first N greedy streams undisturbed, then the same N streams with
SIGKILL of the last stage's worker once every stream has 3 tokens (`up` restarts it under the same id; the
gateway replays every running request's token log on the new topology). For each run: requests completed,
tokens identical to the undisturbed run, the longest pause between two tokens of a stream (p50 and p99 over
the streams), and the aggregate tokens/s; the run with the kill over the undisturbed one as ratios.

Writes bench/results/<host>-<date>-failover.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine, save_results  # noqa: E402  (the repository root is on the path only now)
from bench.run import Mesh  # noqa: E402
from shardmesh.rpc.procs import cores  # noqa: E402
from shardmesh_cli.up import share_cores  # noqa: E402


def worker_pid(mesh: Mesh, coordinator: str, stage: int) -> int:
    """The process holding stage `stage` (tp rank 0) now, from the coordinator's topology."""
    import grpc
    import psutil

    from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(coordinator) as ch:
        topology = coordinator_pb2_grpc.CoordinatorStub(ch).GetTopology(coordinator_pb2.GetTopologyRequest(),
                                                                         timeout=10)  # fmt: skip
    worker_id = topology.stages[stage].shards[0].worker_id
    for p in psutil.Process(mesh.proc.pid).children(recursive=True):
        cmd = p.cmdline()
        if "--worker-id" in cmd and cmd[cmd.index("--worker-id") + 1] == worker_id:
            return p.pid
    raise RuntimeError(f"no process for {worker_id}")


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank q-quantile of already sorted values."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run(address: str, prompt_ids: list[int], new_tokens: int, n: int, kill: Callable | None = None) -> dict:
    """N concurrent greedy streams; with `kill`, it is called once every stream has 3 tokens."""
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop=[])
    started, cv = [0], threading.Condition()
    tokens: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids), params=params)
        mine, stamps = [], []
        try:
            for msg in stub.GenerateStream(req, timeout=600):
                mine.append(msg.token_id)
                stamps.append(time.perf_counter())
                if len(mine) == 3:
                    with cv:
                        started[0] += 1
                        cv.notify_all()
            tokens[i], times[i] = mine, stamps
        except grpc.RpcError as e:
            errors.append(f"{e.code().name}: {e.details()}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    if kill is not None:
        with cv:
            cv.wait_for(lambda: started[0] >= n, timeout=600)
        kill()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps = sorted(max(b - a for a, b in itertools.pairwise(s)) for s in times.values() if len(s) > 1)
    return {"completed": len(tokens), "errors": errors, "tokens": tokens, "wall_s": wall,
            "aggregate_tok_s": sum(len(t) for t in tokens.values()) / wall,
            "longest_gap_p50_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
            "longest_gap_p99_ms": percentile(gaps, 0.99) * 1e3 if gaps else float("nan")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()

    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    share = share_cores(a.pp, 1, "cpu", "auto", None, cores())
    with tempfile.TemporaryDirectory() as logs:
        mesh = Mesh(model_dir, a.pp, 1, share.pipeline, a.streams, Path(logs), share.worker_threads, "none")
        try:
            coordinator = mesh.proc.stdout.readline().decode().strip().removeprefix("coordinator: ")
            calm = run(mesh.address, prompt_ids, a.new_tokens, a.streams)
            print(f"undisturbed: { {k: v for k, v in calm.items() if k != 'tokens'} }", file=sys.stderr)
            killed_at: list[float] = []

            def kill() -> None:
                os.kill(worker_pid(mesh, coordinator, a.pp - 1), signal.SIGKILL)
                killed_at.append(time.perf_counter())

            hit = run(mesh.address, prompt_ids, a.new_tokens, a.streams, kill)
            print(f"killed: { {k: v for k, v in hit.items() if k != 'tokens'} }", file=sys.stderr)
        finally:
            mesh.close()
    identical = sum(1 for i, t in hit["tokens"].items() if t == calm["tokens"].get(i))
    report(info, a, calm, hit, identical)


def report(info: dict, a: argparse.Namespace, calm: dict, hit: dict, identical: int) -> None:
    def row(name: str, r: dict) -> str:
        return (f"| {name} | {r['completed']}/{a.streams} | {r['longest_gap_p50_ms']:.0f} | "
                f"{r['longest_gap_p99_ms']:.0f} | {r['aggregate_tok_s']:.1f} | {r['wall_s']:.1f} |")  # fmt: skip

    lines = [
        f"## A stage worker killed mid-stream — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"{info['date']}",
        "",
        f"Model `{a.model}` float32, pp={a.pp}, {a.streams} greedy streams of {a.new_tokens} tokens, one "
        "`shardmesh up` mesh for both runs; SIGKILL of the last stage's worker once every stream has 3 tokens "
        "(`up` restarts it; no spare). Longest gap: the longest pause between two tokens of a stream, p50 and p99 "
        "over the streams.",
        "",
        "| run | completed | longest gap p50 ms | longest gap p99 ms | aggregate tok/s | wall s |",
        "|---|---:|---:|---:|---:|---:|",
        row("undisturbed", calm),
        row("worker killed", hit),
        "",
        f"Tokens identical to the undisturbed run: {identical}/{a.streams}. Errors: {len(hit['errors'])}. "
        f"Throughput with the kill ÷ undisturbed: {hit['aggregate_tok_s'] / calm['aggregate_tok_s']:.2f}×; "
        f"longest gap p99 with the kill ÷ undisturbed: {hit['longest_gap_p99_ms'] / calm['longest_gap_p99_ms']:.0f}×.",
    ]  # fmt: skip
    md = "\n".join(lines) + "\n"
    data = {"undisturbed": {k: v for k, v in calm.items() if k != "tokens"},
            "killed": {k: v for k, v in hit.items() if k != "tokens"}, "identical": identical}  # fmt: skip
    save_results(Path(a.out), info, "-failover", md, data)


if __name__ == "__main__":
    main()
