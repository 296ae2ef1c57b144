"""A manifest deployed for real: `up --manifest` serves the planned (uneven) split with each rank on its node,
and `coordinator --manifest` serves what the manifest plans and refuses flags it sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from shardmesh.core.topology import Topology
from shardmesh.engine.synthetic import write_checkpoint
from shardmesh.planning import deploy
from shardmesh.planning.manifest import load_manifest
from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from shardmesh.proto.v1.coordinator_pb2 import GetTopologyRequest
from shardmesh.proto.v1.coordinator_pb2_grpc import CoordinatorStub
from shardmesh.rpc import procs
from shardmesh_cli.main import main
from shardmesh_cli.up import free_port
from tests.stack import ServiceProcess

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 256}  # fmt: skip

UP_MANIFEST = """
model: {path: tiny}            # relative: next to this file
nodes:                         # a 3 GiB and a 1 GiB device on two nodes: tp=1 (groups never span nodes), pp=2
  - {name: left, devices: [{memory: 3GiB}]}
  - {name: right, devices: [{memory: 1GiB}]}
serving: {kv_slots: 3, max_context: 64, max_batch_tokens: 32, max_queue: 4}
"""


def test_up_manifest_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_checkpoint(tmp_path / "tiny", TINY)
    manifest = tmp_path / "mesh.yaml"
    manifest.write_text(UP_MANIFEST)
    assert main(["plan", "--manifest", str(manifest)]) == 0
    shown = capsys.readouterr().out
    assert "plan: tp=1 × pp=2 on 2 of 2 devices" in shown and "--pp 2 --tp 1 --dtype float32 --kv-slots 3" in shown
    d = deploy.resolve(load_manifest(manifest), manifest)
    planned = d.plan.layer_split  # type: ignore[union-attr]
    assert planned[0][1] - planned[0][0] > planned[1][1] - planned[1][0]  # the larger device holds more layers
    assert f"--layers {d.layers_flag()} --rank-nodes left,right" in shown
    logs = tmp_path / "logs"
    proc = procs.spawn(["-m", "shardmesh_cli", "up", "--manifest", str(manifest), "--log-dir", str(logs)],
                       env={**os.environ, "SHARDMESH_LOG_LEVEL": "info"}, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)  # fmt: skip
    try:
        address = proc.stdout.readline().decode().strip()
        assert address, proc.stderr.read().decode()[-3000:]
        with grpc.insecure_channel(address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
            assert (info.pp, info.tp, info.max_context, info.model.num_layers) == (2, 1, 64, 4)
            params = gateway_pb2.SamplingParams(max_new_tokens=4, temperature=0.0)
            r = stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 2, 3]), params=params),
                              timeout=60)  # fmt: skip
            assert len(r.token_ids) == 4
        # The coordinator deployed the planned (uneven) split, each rank on the node the plan chose, and checked it.
        listening = next(json.loads(line) for line in (logs / "coordinator.log").read_text().splitlines()
                         if '"event": "listening"' in line)  # fmt: skip
        with grpc.insecure_channel(listening["address"]) as ch:
            t = Topology.from_pb(CoordinatorStub(ch).GetTopology(GetTopologyRequest(), timeout=10))
        assert tuple((s.layer_start, s.layer_end) for s in t.stages) == planned and t.serving
        assert [(sh.label("node"), dict(sh.requires)) for _, sh in t.shards()] == [
            ("left", {"node": "left"}), ("right", {"node": "right"})]  # fmt: skip
        assert [(s.layer_start, s.layer_end) for s in t.calibration.stages] == list(planned)
        # Both stages run on this host's cores: they take turns, one step in flight (`up --pipeline auto`).
        gateway = next(json.loads(line) for line in (logs / "gateway.log").read_text().splitlines()
                       if '"event": "listening"' in line)  # fmt: skip
        assert gateway["pipeline_depth"] == 1
    finally:
        procs.stop_all([proc], grace=15)
    err = proc.stderr.read().decode()
    assert "manifest" in err and "they take turns (one step in flight)" in err
    assert main(["up", "--manifest", str(manifest), "--pp", "3"]) == 2
    assert "--pp: the manifest sets this (parallelism.pipeline)" in capsys.readouterr().err


def test_coordinator_manifest(tmp_path: Path) -> None:
    """`coordinator --manifest` serves what the manifest plans (split and node pinning); flags it sets are refused."""
    write_checkpoint(tmp_path / "tiny", TINY)
    manifest = tmp_path / "mesh.yaml"
    port = free_port()
    manifest.write_text(UP_MANIFEST + f"services: {{coordinator: {{listen: '127.0.0.1:{port}'}}}}\n"
                        "placement: {rebalance: by-speed, max_stage_ratio: 1.5}\n")  # fmt: skip
    d = deploy.resolve(load_manifest(manifest), manifest)
    coordinator = ServiceProcess("coordinator", ["--manifest", str(manifest)])
    try:
        listening = coordinator.wait_event("listening")
        assert listening["address"] == f"127.0.0.1:{port}" and listening["pp"] == 2
        with grpc.insecure_channel(listening["address"]) as ch:
            t = Topology.from_pb(CoordinatorStub(ch).GetTopology(GetTopologyRequest(), timeout=10))
        assert tuple((s.layer_start, s.layer_end) for s in t.stages) == d.plan.layer_split  # type: ignore[union-attr]
        assert [dict(sh.requires) for _, sh in t.shards()] == [{"node": "left"}, {"node": "right"}]
        assert t.limits.kv_slots == 3 and t.limits.max_batch_tokens == 32
    finally:
        coordinator.kill()
    for extra, message in ((["--pp", "2"], "--pp: set by --manifest, give one or the other"),
                           (["--rebalance", "none", "--model", "x"], "--model: set by --manifest"),
                           ([], "")):  # fmt: skip
        bad = manifest if extra else tmp_path / "bad.yaml"
        if not extra:
            bad.write_text("model: {path: tiny}\nplacement: {rebalance: sometimes}\n")
            message = "placement.rebalance: must be 'none' or 'by-speed', got 'sometimes'"
        r = subprocess.run([sys.executable, "-m", "shardmesh_cli", "coordinator", "--manifest", str(bad), *extra],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
