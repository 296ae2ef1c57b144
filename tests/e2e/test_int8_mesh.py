"""int8 weights through the mesh: a coordinator started with --quantize int8 has its workers load int8 shards,
which say so (GetShardInfo, status), and the gateway serves what `shardmesh generate --quantize int8` gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2
from shardmesh_cli.up import free_port, wait_serving
from tests.checkpoints import make_checkpoint
from tests.stack import Stack, worker_stubs

PROMPT = [1, 17, 5, 42, 33, 8]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("int8"), "llama-gqa-tied", num_layers=4, seed=5,
                           hidden_size=128, intermediate_size=256)  # fmt: skip


def _generate_offline(model: Path, n: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "shardmesh_cli", "generate", "--model", str(model), "--token-ids",
                        ",".join(map(str, PROMPT)), "--max-new-tokens", str(n), "--quantize", "int8", "--json"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_an_int8_mesh_serves_what_generate_gives(model: Path, stack: Stack) -> None:
    stack.start_coordinator(model, 2, 1, "--quantize", "int8", "--kv-slots", "2")
    gateway = f"127.0.0.1:{free_port()}"
    stack.spawn("gateway", "gateway", "--listen", gateway, "--coordinator", stack.coordinator)
    for w in ("a", "b"):
        stack.start_worker(w)
    t = stack.wait_complete(timeout=120)
    assert t.model.quantization == "int8"
    for stub in worker_stubs(t):
        info = stub.GetShardInfo(worker_pb2.GetShardInfoRequest(), timeout=30)
        # the int8 kernel chosen for this CPU (`linear.choose_kernel`): blocked on AVX-512 or AVX2, else int8-cpu
        assert info.quantization == "int8" and {"int8-blocked", "int8-cpu"} & set(info.linear_kernels), info
    wait_serving(gateway, [], 60, stack.log_dir)
    with grpc.insecure_channel(gateway) as ch:
        params = gateway_pb2.SamplingParams(max_new_tokens=8, temperature=0.0)
        r = gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT), params=params), timeout=60
        )
    offline = _generate_offline(model, 8)
    assert list(r.token_ids) == offline["token_ids"]
    assert max(abs(a - b) for a, b in zip(r.logprobs, offline["logprobs"], strict=True)) < 1e-4
    shown = subprocess.run([sys.executable, "-m", "shardmesh_cli", "status", "--coordinator", stack.coordinator],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0 and "float32, int8 weights, 4 layers" in shown.stdout, shown.stdout
