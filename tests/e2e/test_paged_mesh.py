"""A paged KV cache through the real mesh: a coordinator started with --kv-block-size has its workers hold blocks,
the gateway hands them out, and what it serves equals `transformers` token for token and logprob for logprob,
for prompts spanning many blocks, for a prompt whose prefix another request left cached (only the rest is
prefilled), and for requests that reuse the blocks earlier ones freed."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from shardmesh_cli.top import Metrics
from shardmesh_cli.up import free_port, wait_serving
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.stack import Stack

BLOCK = 4
NEW = 10
LONG = [(7 * i + 3) % 90 + 1 for i in range(37)]  # 37 tokens: 9 full blocks and one token
SHARED = [*LONG[:32], 9, 8, 7, 6, 5]  # LONG's first 8 blocks, then its own


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("paged"), "llama-gqa-tied", num_layers=4, seed=11)


def _expected(model: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    tokens, logits = reference_greedy(model, prompt, NEW)
    steps = [logits[0][-1], *logits[1:NEW]]
    return tokens, [torch.log_softmax(s, -1)[t].item() for s, t in zip(steps, tokens, strict=True)]


def _generate(gateway: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    with grpc.insecure_channel(gateway) as ch:
        params = gateway_pb2.SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        r = gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), params=params), timeout=120
        )
    return list(r.token_ids), list(r.logprobs)


def _assert_equal(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-4


def test_a_paged_mesh_serves_what_transformers_computes(model: Path, stack: Stack) -> None:
    stack.start_coordinator(model, 2, 1, "--kv-block-size", str(BLOCK), "--kv-slots", "4", "--max-context", "64",
                            "--kv-cache-memory", "72KiB")  # fmt: skip
    gateway, metrics = f"127.0.0.1:{free_port()}", free_port()
    stack.spawn("gateway", "gateway", "--listen", gateway, "--coordinator", stack.coordinator, "--metrics-port",
                str(metrics))  # fmt: skip
    for w in ("a", "b"):
        stack.start_worker(w)
    t = stack.wait_complete(timeout=120)
    assert t.limits.kv_block_size == BLOCK and t.limits.kv_blocks * BLOCK >= 64
    wait_serving(gateway, [], 60, stack.log_dir)

    _assert_equal(_generate(gateway, LONG), _expected(model, LONG))
    # LONG's 8 full prompt blocks are cached now: SHARED prefills only its last 5 tokens, and still equals the
    # reference computed whole.
    _assert_equal(_generate(gateway, SHARED), _expected(model, SHARED))
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
        scraped = Metrics.parse(r.read().decode())
    assert scraped.get("shardmesh_prefix_cache_tokens_saved_total") == 32
    # Concurrent requests over a pool that cannot hold them all at once: they wait for blocks, reuse the ones
    # freed, and each answer still equals the reference.
    prompts = [[(11 * i + 5 * k) % 90 + 1 for k in range(20 + i)] for i in range(6)]
    assert sum(-(-(len(p) + NEW) // BLOCK) for p in prompts) > t.limits.kv_blocks
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: _generate(gateway, p), prompts))
    for prompt, got in zip(prompts, answers, strict=True):
        _assert_equal(got, _expected(model, prompt))
