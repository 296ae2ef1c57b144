"""What tracing costs, end to end: the same mesh and request with tracing off and on, interleaved.

    .venv/bin/python bench/tracing.py [--model smollm2-135m-instruct] [--pp 2] [--rounds 2]

Each round starts `shardmesh up` three ways — tracing off; on, exporting every span to a real OTLP/gRPC
receiver in this process, with the default `--trace-decode-steps` (8); on with every decode step traced —
and measures one greedy stream (decode ms/token and TTFT as the gateway reports them). Rounds alternate
the order of the configurations, so drift on the machine does not favour one. Writes
bench/results/tracing-<host>-<date>.md and prints it.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine  # noqa: E402

CONFIGS = {
    "off": [],
    "on (8 decode steps traced)": ["--otlp-endpoint", "{endpoint}"],
    "on (every step traced)": ["--otlp-endpoint", "{endpoint}"],
}


def one_stream(model_dir: Path, pp: int, extra: list[str], env: dict[str, str], prompt_ids: list[int], n: int) -> dict:
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    with tempfile.TemporaryDirectory() as logs:
        args = [sys.executable, "-m", "shardmesh_cli", "up", "--model", str(model_dir), "--pp", str(pp),
                "--log-dir", logs, *extra]  # fmt: skip
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        try:
            address = proc.stdout.readline().decode().strip()
            stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
            params = gateway_pb2.SamplingParams(max_new_tokens=n, temperature=0.0)
            req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids), params=params)
            stub.Generate(req, timeout=300)  # warm-up
            runs = [stub.Generate(req, timeout=300) for _ in range(2)]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "ms_per_token": statistics.median(r.timings.mean_inter_token_ms for r in runs),
        "ttft_ms": statistics.median(r.timings.time_to_first_token_ms for r in runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    a = ap.parse_args()

    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer
    from tests.otlp import Collector, GrpcReceiver

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    collector = Collector()
    receiver = GrpcReceiver(collector)
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    try:
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                extra = [x.format(endpoint=receiver.endpoint) for x in CONFIGS[name]]
                env = dict(os.environ)
                if "every step" in name:
                    env["SHARDMESH_GATEWAY_TRACE_DECODE_STEPS"] = str(a.new_tokens)
                results[name].append(one_stream(model_dir, a.pp, extra, env, prompt_ids, a.new_tokens))
                print(f"round {r} {name}: {results[name][-1]} (spans received so far: {len(collector.spans())})",
                      file=sys.stderr)  # fmt: skip
    finally:
        receiver.close()
    info = machine()
    base = statistics.median(x["ms_per_token"] for x in results["off"])
    lines = [
        f"## Tracing cost — {info['cpu']}, {info['cores']} cores, {info['date']}",
        "",
        f"`{a.model}` float32, pp={a.pp}, one greedy stream of {a.new_tokens} tokens through the gateway; "
        f"medians over {a.rounds} interleaved rounds × 2 requests. Spans went to a real OTLP/gRPC receiver "
        f"({len(collector.spans())} received).",
        "",
        "| tracing | decode ms/token | vs off | TTFT ms |",
        "|---|---:|---:|---:|",
    ]
    for name, runs in results.items():
        ms = statistics.median(x["ms_per_token"] for x in runs)
        ttft = statistics.median(x["ttft_ms"] for x in runs)
        lines.append(f"| {name} | {ms:.1f} | {ms / base:.3f} | {ttft:.0f} |")
    md = "\n".join(lines) + "\n"
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tracing-{socket.gethostname()}-{info['date'][:10]}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
