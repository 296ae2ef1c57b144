"""What a client sees while the mesh changes under it, next to an undisturbed run in the same invocation.

    .venv/bin/python bench/failover.py [--model smollm2-135m-instruct] [--pp 2] [--streams 16] [--new-tokens 96]

One `shardmesh up --spares 1` mesh serves every run: first N greedy streams undisturbed, then the same N streams
with one change once every stream has 3 tokens:
  - kill-prepared: SIGKILL of the worker holding the rank the idle spare loaded ahead of time (the spare takes
                 its slot without a load; `up` restarts the killed one, which becomes the next spare);
  - kill-other:  SIGKILL of a worker holding another rank (the spare loads that shard first);
  - join:        a new `shardmesh worker` registers (it becomes a spare: as fast as the others, nothing moves);
  - drain:       `shardmesh drain` of the first stage's worker (a spare takes its slot and the drained worker's KV
                 cache, the worker exits 0);
  - coordinator: SIGKILL of the coordinator (`up` restarts it; it takes the placement back from the workers).
For each run: requests completed, tokens identical to the undisturbed run, the longest pause between two tokens
of a stream (p50 and p99 over the streams), and the aggregate tokens/s; the ratios against the undisturbed run.

Writes bench/results/<host>-<date>-failover.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine, save_results  # noqa: E402  (the repository root is on the path only now)
from bench.run import Mesh  # noqa: E402
from shardmesh.rpc.procs import cores  # noqa: E402
from shardmesh_cli.up import share_cores  # noqa: E402


def topology(coordinator: str) -> Any:
    """The coordinator's topology now (None while it is down)."""
    import grpc

    from shardmesh_cli.status import fetch

    try:
        return fetch(coordinator, 5.0)
    except grpc.RpcError:
        return None


def process_of(mesh: Mesh, predicate: Callable[[list[str]], bool]) -> int:
    import psutil

    for p in psutil.Process(mesh.proc.pid).children(recursive=True):
        if predicate(p.cmdline()):
            return p.pid
    raise RuntimeError("no such process")


def holder(coordinator: str, stage: int) -> str:
    t = topology(coordinator)
    return t.stages[stage].shards[0].worker_id


def worker_pid(mesh: Mesh, worker_id: str) -> int:
    return process_of(mesh, lambda cmd: "--worker-id" in cmd and cmd[cmd.index("--worker-id") + 1] == worker_id)


def settle(coordinator: str, spares: int, timeout: float = 120.0) -> float:
    """Wait until the mesh serves with at least `spares` spares; returns the seconds it took."""
    from shardmesh.core.topology import WorkerState

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        t = topology(coordinator)
        if t is not None and t.serving and sum(w.state is WorkerState.SPARE for w in t.workers) >= spares:
            return time.perf_counter() - t0
        time.sleep(0.1)
    raise TimeoutError(f"the mesh did not serve with {spares} spare(s) within {timeout:.0f} s")


SPARE_IDLE_S = 5.0  # a hot spare loads its rank in about 1 s here; in service it idles far longer


def spare_rank(coordinator: str) -> int:
    """The stage whose weights the (first) spare loaded ahead of time (pp stages, tp=1)."""
    from shardmesh.core.topology import WorkerState

    t = topology(coordinator)
    ranks = [w.preparing_rank for w in t.workers if w.state is WorkerState.SPARE and w.preparing_rank is not None]
    if not ranks:
        raise RuntimeError("no spare is preparing a rank")
    return ranks[0]


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
    with cv:  # the change (if any) comes once every stream decodes: the prefills of the others are behind it
        cv.wait_for(lambda: started[0] >= n, timeout=600)
    steady = time.perf_counter()
    if kill is not None:
        kill()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps = sorted(max(b - a for a, b in itertools.pairwise(s)) for s in times.values() if len(s) > 1)
    # From the moment every stream decodes (the change's moment): each stream's longest pause, and the median pause
    # between two tokens over every stream, which the target for joins and drains is relative to.
    after = [[b - a for a, b in itertools.pairwise(s) if b > steady] for s in times.values()]
    longest_after = sorted(max(g) for g in after if g)
    every = sorted(g for gs in after for g in gs)
    return {"completed": len(tokens), "errors": errors, "tokens": tokens, "wall_s": wall,
            "aggregate_tok_s": sum(len(t) for t in tokens.values()) / wall,
            "longest_gap_p50_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
            "longest_gap_p99_ms": percentile(gaps, 0.99) * 1e3 if gaps else float("nan"),
            "after_longest_gap_p99_ms": percentile(longest_after, 0.99) * 1e3 if longest_after else float("nan"),
            "after_median_gap_ms": statistics.median(every) * 1e3 if every else float("nan")}  # fmt: skip


SCENARIOS = ("kill-prepared", "kill-other", "join", "drain", "coordinator")
DESCRIBE = {
    "kill-prepared": "worker of the rank the spare loaded ahead killed (spare takes over)",
    "kill-other": "worker of another rank killed (spare loads it, takes over)",
    "join": "a worker joins (becomes a spare)",
    "drain": "first stage's worker drained (to the spare, KV cache sent along)",
    "coordinator": "coordinator killed (restarted by `up`)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="which changes to run, in order")
    ap.add_argument("--log-dir", help="keep the services' logs here (default: a temporary directory)")
    a = ap.parse_args()

    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    share = share_cores(a.pp, 1, "cpu", "auto", None, cores())
    runs: dict[str, dict] = {}
    joined: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = a.log_dir or tmp
        mesh = Mesh(model_dir, a.pp, 1, share.pipeline, a.streams, Path(logs), share.worker_threads, "none",
                    extra=("--spares", "1"))  # fmt: skip
        try:
            coordinator = mesh.proc.stdout.readline().decode().strip().removeprefix("coordinator: ")
            settle(coordinator, 1)
            runs["undisturbed"] = run(mesh.address, prompt_ids, a.new_tokens, a.streams)
            changes: dict[str, Callable[[], None]] = {
                "kill-prepared": lambda: os.kill(worker_pid(mesh, holder(coordinator, spare_rank(coordinator))),
                                                 signal.SIGKILL),
                "kill-other": lambda: os.kill(worker_pid(mesh, holder(coordinator, a.pp - 1 - spare_rank(coordinator))),
                                              signal.SIGKILL),
                "join": lambda: joined.append(subprocess.Popen(
                    [sys.executable, "-m", "shardmesh_cli", "worker", "--coordinator", coordinator, "--worker-id",
                     "joiner"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)),
                "drain": lambda: subprocess.run(
                    [sys.executable, "-m", "shardmesh_cli", "drain", "--coordinator", coordinator,
                     holder(coordinator, 0)], check=True, capture_output=True, timeout=300),
                "coordinator": lambda: os.kill(process_of(mesh, lambda cmd: "coordinator" in cmd), signal.SIGKILL),
            }  # fmt: skip
            for name in a.scenarios.split(","):
                needs_spare = name.startswith("kill") or name == "drain"  # these need a spare to hand over to
                settle(coordinator, 1 if needs_spare else 0)
                if needs_spare:  # as a spare is between changes: idle long enough to have loaded its rank ahead
                    time.sleep(SPARE_IDLE_S)
                runs[name] = run(mesh.address, prompt_ids, a.new_tokens, a.streams, changes[name])
                runs[name]["settle_s"] = settle(coordinator, 0)
                print(f"{name}: { {k: v for k, v in runs[name].items() if k != 'tokens'} }", file=sys.stderr)
        finally:
            for p in joined:
                p.terminate()
                p.wait(timeout=30)
            mesh.close()
    calm = runs["undisturbed"]["tokens"]
    for r in runs.values():
        r["identical"] = sum(1 for i, t in r["tokens"].items() if t == calm.get(i))
    report(info, a, runs)


def report(info: dict, a: argparse.Namespace, runs: dict[str, dict]) -> None:
    calm = runs["undisturbed"]

    def row(name: str, r: dict) -> str:
        ratio = r["aggregate_tok_s"] / calm["aggregate_tok_s"]
        bound = max(500.0, 5 * r["after_median_gap_ms"])
        return (f"| {DESCRIBE.get(name, name)} | {r['completed']}/{a.streams} | {r['identical']}/{a.streams} | "
                f"{len(r['errors'])} | {r['longest_gap_p50_ms']:.0f} | {r['longest_gap_p99_ms']:.0f} | "
                f"{r['after_longest_gap_p99_ms']:.0f} | {r['after_median_gap_ms']:.0f} | {bound:.0f} | "
                f"{r['aggregate_tok_s']:.1f} | {ratio:.2f}× |")  # fmt: skip

    lines = [
        f"## The mesh changing mid-stream — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"{info['date']}",
        "",
        f"Model `{a.model}` float32, pp={a.pp}, `shardmesh up --spares 1`, {a.streams} greedy streams of "
        f"{a.new_tokens} tokens per run, one mesh for every run, each change made once every stream has 3 tokens. "
        "Longest gap: the longest pause between two tokens of a stream, p50 and p99 over the streams. Identical: "
        "streams whose tokens equal the undisturbed run's. *After the change*: from the moment every stream decodes "
        "(when the change is made; the same moment in the undisturbed run), each stream's longest pause (p99 over "
        "the streams) and the median pause between two tokens over all streams; bound: max(500 ms, 5 × that "
        "median), the target for joins and drains.",
        "",
        "| run | completed | identical | errors | longest gap p50 ms | longest gap p99 ms | after the change: "
        "longest gap p99 ms | median gap ms | bound ms | aggregate tok/s | tok/s ÷ undisturbed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(row(name, r) for name, r in runs.items()),
    ]  # fmt: skip
    md = "\n".join(lines) + "\n"
    data = {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in runs.items()}
    save_results(Path(a.out), info, "-failover", md, data)


if __name__ == "__main__":
    main()
