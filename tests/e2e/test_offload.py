"""`shardmesh generate --memory-budget`: each rank streams the layers that do not fit and the answer is the
resident one; a budget too small even with offload is refused with the numbers, before any process starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.stack import Stack

PROMPT = "1,17,5,42,33,8"


def generate(model: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardmesh_cli", "generate", "--model", str(model), "--token-ids", PROMPT,
         "--max-new-tokens", "8", "--json", *flags], capture_output=True, text=True, timeout=180,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("offload"), "llama-gqa-tied", num_layers=6, seed=3,
                           hidden_size=128, intermediate_size=256)  # fmt: skip


@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 1), (1, 2)])
def test_generate_with_a_budget_gives_the_resident_answer(tiny: Path, pp: int, tp: int) -> None:
    mesh = ("--pp", str(pp), "--tp", str(tp))
    resident = generate(tiny, *mesh)
    assert resident.returncode == 0, resident.stderr
    # Find the least budget every rank accepts (the refusal names it), then serve with it: most layers stream.
    refused = generate(tiny, *mesh, "--memory-budget", "1KiB")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    need = int(re.findall(r"needs at least (\d+) B", refused.stderr)[0])  # the shard that needs the most
    streamed = generate(tiny, *mesh, "--memory-budget", str(need))
    assert streamed.returncode == 0, streamed.stderr
    want, got = json.loads(resident.stdout), json.loads(streamed.stdout)
    assert got["token_ids"] == want["token_ids"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < 1e-5


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2)])
def test_generate_int8_with_a_budget_gives_the_resident_int8_answer(
    tiny: Path, pp: int, tp: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--quantize int8 --memory-budget`: the int8 copy of the layers is written once, before the ranks start, and
    each rank streams its layers' int8 products from it; the answer is the resident int8 one."""
    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path))
    mesh = ("--pp", str(pp), "--tp", str(tp), "--quantize", "int8")
    resident = generate(tiny, *mesh)
    assert resident.returncode == 0, resident.stderr
    refused = generate(tiny, *mesh, "--memory-budget", "1KiB")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "in float32 with int8 products: it needs at least" in refused.stderr
    need = int(re.findall(r"needs at least (\d+) B", refused.stderr)[0])
    streamed = generate(tiny, *mesh, "--memory-budget", str(need))
    assert streamed.returncode == 0, streamed.stderr
    want, got = json.loads(resident.stdout), json.loads(streamed.stdout)
    assert got["token_ids"] == want["token_ids"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < 1e-5
    assert len(list((tmp_path / "int8").glob("*/layer-*.safetensors"))) == 6  # one file per layer, written once


def test_too_small_a_budget_is_one_line_naming_the_numbers(tiny: Path) -> None:
    r = generate(tiny, "--memory-budget", "100KiB")
    assert r.returncode == 1 and r.stdout == ""
    layers = r"is too small for layers \[0, 6\) in float32: "
    numbers = r"it needs at least \d+ B \([\d.]+ [KM]iB\) with every decoder layer streamed\n"
    assert re.fullmatch(rf"error: memory budget 102400 B \(100\.00 KiB\) {layers}{numbers}", r.stderr)


def test_a_malformed_size_is_a_usage_error(tiny: Path) -> None:
    r = generate(tiny, "--memory-budget", "lots")
    assert r.returncode == 2 and "--memory-budget: expected a size like 24GiB" in r.stderr


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_worker_with_a_budget_serves_the_resident_answer(
    tiny: Path, stack: Stack, quantize: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`worker --memory-budget` (what `up --memory-budget` gives every worker): the worker streams the layers
    beyond its budget, says which, and the gateway serves what a resident `generate` gives (with the coordinator's
    `--quantize int8`, the int8 layers streamed from the int8 copy, which the worker writes)."""
    import grpc

    from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
    from shardmesh_cli.up import free_port, wait_serving

    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path))
    quantized = ("--quantize", quantize)
    refused = generate(tiny, *quantized, "--memory-budget", "1KiB")
    need = int(re.findall(r"needs at least (\d+) B", refused.stderr)[0])
    for f in (tmp_path / "int8").glob("*/*"):  # the refusal wrote the int8 copy: the worker writes its own
        f.unlink()
    stack.start_coordinator(tiny, 1, 1, "--kv-slots", "2", *quantized)
    gateway = f"127.0.0.1:{free_port()}"
    stack.spawn("gateway", "gateway", "--listen", gateway, "--coordinator", stack.coordinator)
    stack.start_worker("a", "--memory-budget", str(need))
    stack.wait_complete(timeout=120)
    wait_serving(gateway, [], 60, stack.log_dir)
    with grpc.insecure_channel(gateway) as ch:
        params = gateway_pb2.SamplingParams(max_new_tokens=8, temperature=0.0)
        ids = gateway_pb2.TokenIds(ids=[int(t) for t in PROMPT.split(",")])
        r = gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(token_ids=ids, params=params),
                                                      timeout=60)  # fmt: skip
    want = json.loads(generate(tiny, *quantized).stdout)
    assert list(r.token_ids) == want["token_ids"]
    assert max(abs(a - b) for a, b in zip(r.logprobs, want["logprobs"], strict=True)) < 1e-4
    loaded = [json.loads(line) for line in (stack.log_dir / "a.log").read_text().splitlines()
              if '"shard_loaded"' in line]  # fmt: skip
    assert loaded and loaded[-1]["streamed_layers"], loaded  # most of the 6 layers stream at the least budget
