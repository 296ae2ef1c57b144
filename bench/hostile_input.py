"""What oversized requests cost a gateway: its memory, and the pace of a stream it serves meanwhile.

    .venv/bin/python bench/hostile_input.py [--model smollm2-135m-instruct] [--pp 2] [--new-tokens 300]
                                            [--max-message-bytes 8388608] [--repeat 3]

One `shardmesh up` mesh (gRPC and HTTP) per gateway `--max-message-bytes` serves every run. Each run measures one
greedy stream (a chat prompt, `--new-tokens` tokens, end-of-sequence ignored) from another process, while a third
process (at nice 19: a client elsewhere would not take the mesh's cores) sends, once the stream has 5 tokens:
  - undisturbed:     nothing (the reference for the stream's pace);
  - grpc-20mib:      one 20 MiB text prompt over gRPC (the case of the issue: 23 s, 4.2 GB, a 3.9 s stall before);
  - grpc-flood:      50 concurrent 16 MiB text prompts over gRPC;
  - http-flood:      50 concurrent 16 MiB prompts over HTTP (`/v1/completions`);
  - long-prompts:    8 concurrent prompts just under the byte bound (they are tokenized, then refused for their
                     token count): what tokenizing costs the stream;
Every run is repeated `--repeat` times, the runs interleaved (a busy moment of the machine lands on one of each),
and the summary compares medians: a stream's longest pause is one sample of the machine's noise as much as of
the flood (an undisturbed run alone ranged 90-380 ms here). For each run: the statuses the oversized requests got
and how long they took, the stream's longest pause between two tokens (and its ratio to the median undisturbed
run's), the gateway's peak resident memory while the run lasted
and its memory a few seconds after, both as ratios to the idle gateway's.

Writes bench/results/<host>-<date>-hostile-input.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results  # noqa: E402  (the repository root is on the path only now)

MIB = 1024 * 1024
CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper who finds a message in a bottle."}]
SETTLE_S = 3.0  # after a run, before its "after" memory is read: the gateway has answered every request by then
RUNS = {
    "undisturbed": ("nothing", 0, 0),
    "grpc-20mib": ("grpc", 1, 20 * MIB),
    "grpc-flood": ("grpc", 50, 16 * MIB),
    "http-flood": ("http", 50, 16 * MIB),
    "long-prompts": ("grpc", 8, -1),  # -1: just under the prompt byte bound of the served model
}


# -- the parts that run in their own processes --------------------------------------------------------------


def stream(address: str, new_tokens: int) -> None:
    """One greedy stream; prints the monotonic time of every token, one JSON list (its own process: the flood's
    serialization must not hold this interpreter's lock)."""
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in CHAT])
    params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    times = []
    for i, _ in enumerate(stub.GenerateStream(gateway_pb2.GenerateRequest(chat=chat, params=params), timeout=600)):
        times.append(time.monotonic())
        if i == 4:
            print("started", flush=True)
    print(json.dumps(times), flush=True)


def flood(kind: str, target: str, n: int, size: int) -> None:
    """`n` concurrent requests with a text prompt of `size` bytes; prints {status: count} and the seconds until the
    last answer, one JSON object."""
    text = ("All work and no play makes Jack a dull boy. " * (size // 44 + 1))[:size]
    codes: collections.Counter[str] = collections.Counter()
    answered: list[float] = []
    lock = threading.Lock()
    if kind == "grpc":
        import grpc

        from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

        options = [("grpc.max_send_message_length", 128 * MIB), ("grpc.max_receive_message_length", 128 * MIB)]
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(target, options=options))
        request = gateway_pb2.GenerateRequest(prompt=text, params=gateway_pb2.SamplingParams(max_new_tokens=1))

        def one() -> None:
            try:
                stub.Generate(request, timeout=300)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                codes[code] += 1
                answered.append(time.monotonic())
    else:
        body = json.dumps({"prompt": text, "max_tokens": 1}).encode()

        def one() -> None:
            req = urllib.request.Request(target, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as response:
                    code = str(response.status)
            except urllib.error.HTTPError as e:
                code = str(e.code)
            except OSError as e:  # the connection closed while the body was still being sent
                code = type(e).__name__
            with lock:
                codes[code] += 1
                answered.append(time.monotonic())

    os.nice(19)  # a client elsewhere would not take the mesh's cores: here it takes what they leave
    print("ready", flush=True)
    sys.stdin.readline()  # go
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        for _ in range(n):
            pool.submit(one)
    print(json.dumps({"codes": dict(codes), "sent_at": t0, "seconds": round(time.monotonic() - t0, 3),
                      "answered_s": [round(t - t0, 3) for t in sorted(answered)]}), flush=True)  # fmt: skip


# -- the gateway's memory -------------------------------------------------------------------------------------


class Memory:
    """Samples a process's resident memory every 5 ms: `peak` since `reset()`, `now()`."""

    def __init__(self, pid: int) -> None:
        self._path = Path(f"/proc/{pid}/status")
        self._peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def now(self) -> int:
        status = self._path.read_text()
        return next(int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmRSS"))

    def reset(self) -> None:
        self._peak = self.now()

    @property
    def peak(self) -> int:
        return self._peak

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self.now())

    def stop(self) -> None:
        self._stop.set()


# -- one run ----------------------------------------------------------------------------------------------------


def child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)  # fmt: skip


def run(name: str, address: str, http: str, new_tokens: int, bound: int, memory: Memory) -> dict[str, Any]:
    kind, n, size = RUNS[name]
    size = bound - 1024 if size < 0 else size
    sender = None
    if kind != "nothing":
        target = address if kind == "grpc" else f"{http}/completions"
        sender = child("flood", kind, target, str(n), str(size))
        assert sender.stdout.readline().strip() == "ready"
    memory.reset()
    idle = memory.now()
    streamer = child("stream", address, str(new_tokens))
    assert streamer.stdout.readline().strip() == "started"
    sent_at = time.monotonic()
    flood_result: dict[str, Any] = {}
    if sender is not None:
        sender.stdin.write("go\n")
        sender.stdin.flush()
        flood_result = json.loads(sender.stdout.readline())
        sender.wait(60)
    times = json.loads(streamer.stdout.readline())
    streamer.wait(60)
    peak = memory.peak
    time.sleep(SETTLE_S)
    after = memory.now()
    gaps = [b - a for a, b in itertools.pairwise(times)]
    during = [b - a for a, b in itertools.pairwise(times) if b >= sent_at]
    sent_at = flood_result.pop("sent_at", sent_at)
    longest = max(range(len(gaps)), key=gaps.__getitem__)
    return {
        "run": name, "requests": n, "bytes_each": size, **flood_result,
        "stream_tokens": len(times), "longest_gap_ms": round(max(gaps) * 1000, 1),
        "longest_gap_after_send_ms": round(max(during) * 1000, 1),
        "longest_gap_from_s": round(times[longest] - sent_at, 3),  # when it began, from the moment of sending
        "median_gap_ms": round(statistics.median(gaps) * 1000, 1),
        "rss_before_mb": round(idle / MIB), "rss_peak_mb": round(peak / MIB), "rss_after_mb": round(after / MIB),
    }  # fmt: skip


def gateway_pid(up: subprocess.Popen) -> int:
    import psutil

    for p in psutil.Process(up.pid).children(recursive=True):
        if "gateway" in p.cmdline():
            return p.pid
    raise RuntimeError("no gateway process")


def prompt_bytes_bound(model: str) -> int:
    """The served model's byte bound on prompts, as the gateway computes it."""
    from gateway.requests import ModelContext, prompt_bytes_limit
    from shardmesh.core.config import ModelConfig
    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    path = resolve(model)
    tokenizer = Tokenizer.from_dir(path)
    context = ModelConfig.from_dir(path).max_context
    return prompt_bytes_limit(ModelContext(0, context, tokenizer, frozenset(), 0))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("stream", "flood"):
        if sys.argv[1] == "stream":
            stream(sys.argv[2], int(sys.argv[3]))
        else:
            flood(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=300)
    ap.add_argument("--runs", default=",".join(RUNS), help="which runs, in order (default: all)")
    ap.add_argument("--max-message-bytes", default=f"{8 * MIB}",
                    help="the gateway's --max-message-bytes, comma-separated, a mesh for each (default: 8 MiB, "
                         "the gateway's default)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="how many times each run is made, interleaved")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    info = machine()
    bound = prompt_bytes_bound(a.model)
    results = []
    for limit in a.max_message_bytes.split(","):
        results += serve_runs(a, bound, int(limit))
    report(info, a, bound, results)


def serve_runs(a: argparse.Namespace, bound: int, max_message_bytes: int) -> list[dict[str, Any]]:
    """Every run on one mesh whose gateway has `max_message_bytes` (SHARDMESH_GATEWAY_MAX_MESSAGE_BYTES)."""
    logs = tempfile.mkdtemp(prefix="hostile-input-")
    env = {**os.environ, "SHARDMESH_GATEWAY_MAX_MESSAGE_BYTES": str(max_message_bytes)}
    up = subprocess.Popen([sys.executable, "-m", "shardmesh_cli", "up", "--model", a.model, "--pp", str(a.pp),
                           "--kv-slots", "4", "--http-listen", "127.0.0.1:0", "--log-dir", logs],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)  # fmt: skip
    results = []
    try:
        address = up.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"shardmesh up failed; logs in {logs}")
        lines = [up.stdout.readline().strip() for _ in range(2)]
        http = next(line.removeprefix("http: ") for line in lines if line.startswith("http: "))
        memory = Memory(gateway_pid(up))
        subprocess.run([sys.executable, __file__, "stream", address, "4"], check=True, capture_output=True)  # warm
        for name in a.runs.split(",") * a.repeat:
            results.append({"max_message_bytes": max_message_bytes,
                            **run(name, address, http, a.new_tokens, bound, memory)})  # fmt: skip
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        memory.stop()
    finally:
        up.terminate()
        up.wait(60)
    return results


def report(info: dict, a: argparse.Namespace, bound: int, results: list[dict]) -> None:
    rows, summary = [], []
    undisturbed = {}
    for limit in dict.fromkeys(r["max_message_bytes"] for r in results):
        gaps: dict[str, list[float]] = {}
        for r in results:
            if r["max_message_bytes"] == limit:
                gaps.setdefault(r["run"], []).append(r["longest_gap_ms"])
        undisturbed[limit] = statistics.median(gaps.get("undisturbed", [float("nan")]))
        for name, values in gaps.items():
            ratios = [v / undisturbed[limit] for v in values]
            summary.append(f"| {limit // MIB} MiB | {name} | {len(values)} | {statistics.median(values):.0f} | "
                           f"{statistics.median(ratios):.2f}× | {max(ratios):.2f}× |")  # fmt: skip
    for r in results:
        limit = r["max_message_bytes"]
        base = {"longest_gap_ms": undisturbed[limit]}
        codes = ", ".join(f"{k} × {v}" for k, v in sorted(r.get("codes", {}).items())) or "—"
        sent = f"{r['requests']} × {r['bytes_each'] / MIB:.2f} MiB" if r["requests"] else "—"
        rows.append(f"| {limit // MIB} MiB | {r['run']} | {sent} | {codes} | {r.get('seconds', '—')} | "
                    f"{r['longest_gap_ms']:.0f} | {r['longest_gap_ms'] / base['longest_gap_ms']:.2f}× | "
                    f"{r['median_gap_ms']:.0f} | {r['rss_before_mb']} | "
                    f"{r['rss_peak_mb']} ({r['rss_peak_mb'] / r['rss_before_mb']:.2f}×) | "
                    f"{r['rss_after_mb']} ({r['rss_after_mb'] / r['rss_before_mb']:.2f}×) |")  # fmt: skip
    md = (f"## Oversized requests against a serving gateway — {info['cpu']}, {info['cores']} cores, "
          f"torch {info['torch']}, {info['date']}\n\n"
          f"Model `{a.model}`, pp={a.pp}, `shardmesh up` (gRPC and HTTP), prompt byte bound {bound} bytes; one mesh "
          "per gateway `--max-message-bytes`. One greedy stream of "
          f"{a.new_tokens} tokens per run from its own process; the oversized requests are sent from another (at "
          "nice 19: a client elsewhere would not take the mesh's cores) once it has 5 tokens. Longest gap: the "
          "stream's longest pause between two tokens (ratio: to the median of the undisturbed runs' on the same mesh). "
          f"Each run made {a.repeat} times, interleaved. Memory: "
          "the gateway's resident set before the run, its peak during it (sampled every 5 ms) and "
          f"{SETTLE_S:g} s after the last answer, with ratios to before.\n\n"
          "| gateway --max-message-bytes | run | times | median longest gap ms | ÷ undisturbed (median) | "
          "÷ undisturbed (worst) |\n|---|---|---:|---:|---:|---:|\n" + "\n".join(summary) + "\n\nEvery run:\n\n"
          "| gateway --max-message-bytes | run | sent | answers | seconds to the last answer | longest gap ms | "
          "÷ undisturbed | median gap ms | gateway MB before | peak MB | after MB |\n"
          "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")  # fmt: skip
    save_results(a.out, info, "-hostile-input", md, {"bound": bound, "args": vars(a) | {"out": str(a.out)},
                                                     "runs": results})  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("SHARDMESH_LOG_LEVEL", "warning")
    main()
