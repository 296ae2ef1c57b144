"""One stream through `shardmesh up` (pp=1) against llama.cpp on the same weights and dtype, request by request.

    .venv/bin/python bench/single_stream.py [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                                            [--rounds 7] [--new-tokens 64] [--out bench/results]

Why a bench of its own: on the virtual machines here a decode step's time moves by 15-30% from one minute to the
next (the memory bandwidth a 2-vCPU guest gets varies), so two numbers taken minutes apart, as bench/run.py takes its
baselines and its meshes, can put either side ahead. Here the mesh stays up and each round times one llama.cpp
greedy decode (`llamacpp.measure`: median ms per token after a warm-up run) and then one request through the
gateway (its mean inter-token ms; the median of 3 requests), back to back, so drift hits both alike. The result is
the median over `--rounds` of each round's ratio, llama.cpp's ms/token over ours (> 1: faster than llama.cpp), with
both sides' medians. Each dtype runs its own mesh (`up --dtype`) against llama.cpp's GGUF of that type (F32 or BF16,
bench/llamacpp.py). Greedy tokens of the two are recorded too (they agree for the first tokens at least; two
implementations sum in different orders). A second mesh of the same dtype runs with the gateway's `--decode-steps 1`
(one call per token, as before multi-step calls) in the same rounds, so what those calls buy is measured beside
them. Writes bench/results/<host>-<date>-single-stream.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llamacpp  # noqa: E402  (the repository root is on the path only now)
from bench.conditions import PROMPT, machine, save_results  # noqa: E402
from bench.run import Mesh  # noqa: E402


def mesh_round(address: str, prompt_ids: list[int], new_tokens: int, requests: int = 3) -> dict:
    """The median over `requests` greedy requests of the gateway's mean inter-token ms, and the first's tokens."""
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    params = gateway_pb2.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt_ids), params=params)
    replies = [stub.Generate(req, timeout=300) for _ in range(requests)]
    return {"ms_per_token": statistics.median(r.timings.mean_inter_token_ms for r in replies),
            "token_ids": list(replies[0].token_ids)}  # fmt: skip


def run_dtype(dtype: str, model_dir: Path, prompt_ids: list[int], a: argparse.Namespace, threads: int) -> dict:
    gguf = llamacpp.gguf_for(dtype, a.model)
    with tempfile.TemporaryDirectory() as logs, tempfile.TemporaryDirectory() as logs1:
        mesh = Mesh(model_dir, 1, 1, "auto", 4, Path(logs), threads, "none", extra=("--dtype", dtype))
        per_token = Mesh(model_dir, 1, 1, "auto", 4, Path(logs1), threads, "none", extra=("--dtype", dtype),
                         env={"SHARDMESH_GATEWAY_DECODE_STEPS": "1"})  # fmt: skip
        try:
            for m in (mesh, per_token):
                mesh_round(m.address, prompt_ids, 8, requests=1)  # warm-up
            rounds = []
            for _ in range(a.rounds):
                ours = mesh_round(mesh.address, prompt_ids, a.new_tokens)
                one = mesh_round(per_token.address, prompt_ids, a.new_tokens)
                theirs = llamacpp.measure(gguf, prompt_ids, a.new_tokens, threads=threads)
                rounds.append({"shardmesh_ms": ours["ms_per_token"], "one_step_ms": one["ms_per_token"],
                               "llama_cpp_ms": theirs["ms_per_token_median"],
                               "ratio": theirs["ms_per_token_median"] / ours["ms_per_token"],
                               "one_step_ratio": theirs["ms_per_token_median"] / one["ms_per_token"]})  # fmt: skip
                print(dtype, rounds[-1], flush=True)
        finally:
            mesh.close()
            per_token.close()
    agree = llamacpp.first_difference(ours["token_ids"], theirs["token_ids"])
    return {
        "dtype": dtype, "gguf": gguf.name, "rounds": rounds,
        "shardmesh_ms": statistics.median(r["shardmesh_ms"] for r in rounds),
        "one_step_ms": statistics.median(r["one_step_ms"] for r in rounds),
        "llama_cpp_ms": statistics.median(r["llama_cpp_ms"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "ratio_range": [min(r["ratio"] for r in rounds), max(r["ratio"] for r in rounds)],
        "one_step_ratio": statistics.median(r["one_step_ratio"] for r in rounds),
        "greedy_tokens_agree": agree,
        "same_tokens_both_meshes": ours["token_ids"] == one["token_ids"],
    }  # fmt: skip


def markdown(info: dict, results: list[dict], a: argparse.Namespace) -> str:
    lines = [
        f"## One stream, pp=1, shardmesh against llama.cpp, interleaved: {info['cpu']} ({info.get('cpu_id', '')}), "
        f"{info['cores']} cores, torch {info['torch']}, {info['date']}",
        "",
        f"CPU flags that pick kernels: {' '.join(info.get('cpu_flags', []))}. Model `{a.model}`, greedy, the chat "
        f"prompt of {PROMPT!r}, {a.new_tokens} new tokens, {a.rounds} rounds; each round one llama.cpp decode "
        f"(median ms/token) then 3 requests through each gateway (median of their mean inter-token ms): `up` as it "
        f"is (`--decode-steps 8`), and `up` with one call per token (`--decode-steps 1`).",
        "",
        "| dtype | llama.cpp file | shardmesh ms/token | one call per token ms/token | llama.cpp ms/token "
        "| llama.cpp ÷ shardmesh (median of rounds) | range over rounds | one call per token: llama.cpp ÷ it "
        "| greedy tokens equal before the first difference | both meshes' tokens equal |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['gguf']} | {r['shardmesh_ms']:.2f} | {r['one_step_ms']:.2f} | "
                     f"{r['llama_cpp_ms']:.2f} | **{r['ratio']:.2f}×** | "
                     f"{r['ratio_range'][0]:.2f}–{r['ratio_range'][1]:.2f} | {r['one_step_ratio']:.2f}× | "
                     f"{r['greedy_tokens_agree']} | {r['same_tokens_both_meshes']} |")  # fmt: skip
    lines += ["", "Target (issue: single-stream speed): >= 1.0× llama.cpp in float32, and in bfloat16 where the CPU "
              "has native bf16 (avx512_bf16 / amx_bf16).", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    reason = llamacpp.available()
    if reason is not None:
        sys.exit(f"bench/single_stream.py needs llama.cpp: {reason}")
    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    results = [run_dtype(d, model_dir, prompt_ids, a, info["cores"]) for d in a.dtypes.split(",")]
    save_results(Path(a.out), info, "-single-stream", markdown(info, results, a),
                 {"options": vars(a), "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
