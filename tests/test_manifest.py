"""The deployment manifest: good and bad files, the committed JSON Schema, `plan --manifest` and
`up --manifest` end to end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from shardmesh.core.topology import Topology
from shardmesh.engine.synthetic import write_checkpoint
from shardmesh.planning import deploy
from shardmesh.planning.manifest import SCHEMA_PATH, load_manifest, parse_manifest, schema_text
from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from shardmesh.proto.v1.coordinator_pb2 import GetTopologyRequest
from shardmesh.proto.v1.coordinator_pb2_grpc import CoordinatorStub
from shardmesh.rpc import procs
from shardmesh_cli.main import main
from shardmesh_cli.up import free_port
from tests.stack import ServiceProcess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "compose" / "manifest.example.yaml"
CONFIGS = Path(__file__).parent / "data" / "configs"


def test_committed_schema_is_a_fresh_export() -> None:
    assert SCHEMA_PATH == ROOT / "compose" / "manifest.schema.json"
    fresh = schema_text()
    assert SCHEMA_PATH.read_text() == fresh, "run: shardmesh plan --manifest-schema > compose/manifest.schema.json"


def test_example_manifest_plans_llama_70b(tmp_path: Path) -> None:
    m = load_manifest(EXAMPLE)
    assert m.nodes[0].devices[0].memory == 80 * 2**30 and m.placement.reserve == 2 * 2**30
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["path"] = str(CONFIGS / "llama-3-70b")  # the example's path is a deployment's, not ours
    d = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    assert (d.pp, d.tp, d.dtype) == (1, 4, "bfloat16") and d.plan is not None and d.plan.min_headroom > 2 * 2**30
    commands = deploy.service_commands(d)
    assert len(commands) == 1 + 4 + 1
    assert "--pp 1 --tp 4 --dtype bfloat16 --kv-slots 8 --max-context 8192" in commands[0]
    assert "--store-port 29500" in commands[0] and "--label node=gpu-a --label zone=eu-west-1a" in commands[1]
    assert commands[-1].endswith("--max-queue 256 --otlp-endpoint http://otel-collector:4317 --metrics-port 9464")
    assert all("--otlp-endpoint http://otel-collector:4317 --metrics-port 9464" in c for c in commands)
    up = deploy.up_args(d, argparse.Namespace())
    assert up.otlp_endpoint == "http://otel-collector:4317" and up.metrics


BAD = {
    "bounds and unknown fields": (
        "model: {path: /m}\nparallelism: {tensor: 0, pipline: 2}\nserving: {kv_slots: 0, max_queue: 2.5}\n",
        ["parallelism.tensor: must be 'auto' or an integer >= 1, got 0",
         "parallelism.pipline: unknown field; expected one of: tensor, pipeline, tensor_split",
         "serving.kv_slots: must be >= 1, got 0", "serving.max_queue: must be an integer, got 2.5"],
    ),
    "tensor split dims": (
        "model: {path: /m}\nparallelism: {tensor_split: {attention: hidden, mlp: rows}}\n",
        ["parallelism.tensor_split.attention: attention can only be split by 'heads' (query and key/value heads; "
         "q/k/v column-parallel, o_proj row-parallel); got 'hidden'",
         "parallelism.tensor_split.mlp: mlp can only be split by 'intermediate' (the intermediate dimension; "
         "gate/up column-parallel, down_proj row-parallel); got 'rows'"],
    ),
    "nodes and sizes": (
        "model: {path: /m, dtype: int8}\nnodes:\n  - {name: a, devices: [{count: 2, memory: 80 gigs}]}\n"
        "  - {name: a, devices: []}\nplacement: {node_order: [b]}\n",
        ["model.dtype: must be 'float32', 'bfloat16' or 'float16', got 'int8'",
         "nodes[0].devices[0].memory: must be a size like 80GiB, 48GB or 512MiB, or a number of bytes, got '80 gigs'",
         "nodes[1].devices: must list at least 1 item(s)"],
    ),
    "cross-field": (
        "model: {path: /m}\nnodes:\n  - {name: a, devices: [{memory: 8GiB}]}\n"
        "  - {name: a, devices: [{memory: 8GiB}]}\nplacement: {node_order: [b]}\n",
        ["nodes[1].name: duplicate node name 'a'", "placement.node_order[0]: unknown node 'b'; nodes: a"],
    ),
    "services and telemetry": (
        "model: {path: /m}\nservices: {gateway: {listen: nohost}, worker: {device: tpu}}\n"
        "telemetry: {otlp_endpoint: collector, metrics_port: 70000}\n",
        ["telemetry.otlp_endpoint: must be a URL like http://collector:4317, got 'collector'",
         "telemetry.metrics_port: must be <= 65535, got 70000",
         "services.gateway.listen: must be host:port, got 'nohost'",
         "services.worker.device: must be cpu, cuda or cuda:N, got 'tpu'"],
    ),
    "missing and wrong types": (
        "version: 2\nmdl: {}\nnodes: {a: 1}\n",
        ["version: must be 1, got 2", "model: is required", "nodes: must be a list, got {'a': 1}",
         "mdl: unknown field; expected one of: version, model, parallelism, nodes, placement, serving, telemetry, "
         "services"],
    ),
    "not a mapping": ("- just\n- a list\n", ["(top level): must be a mapping of key: value, got list"]),
    "YAML syntax": ("model: {path: /m\n",
                    ["not valid YAML: line 2, column 1: expected ',' or '}', but got '<stream end>'"]),
    "duplicate key": ("model: {path: /m}\nserving: {kv_slots: 2}\nserving: {kv_slots: 3}\n",
                      ["not valid YAML: line 3, column 1: key 'serving' given twice"]),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_manifest_is_one_line_per_error(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, expected = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["plan", "--manifest", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {path}: {line}" for line in expected], err


def test_bad_manifest_through_a_real_process(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: /m}\nparallelism: {tensor: -2}\n")
    r = subprocess.run([sys.executable, "-m", "shardmesh_cli", "plan", "--manifest", str(path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == f"error: {path}: parallelism.tensor: must be 'auto' or an integer >= 1, got -2\n"


def test_manifest_against_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fields valid on their own but not for this model, or not plannable, still name the field."""
    cases = {
        "parallelism: {tensor: auto, pipeline: 2}\n": "parallelism.tensor: 'auto' needs nodes to plan on",
        "parallelism: {tensor: 3, pipeline: 1}\n": "parallelism.tensor: 3 is not valid for this model; valid: [1, 2, 4",
        "parallelism: {tensor: 1, pipeline: 81}\n": "parallelism.pipeline: must be <= 80",
        "serving: {max_context: 9000}\nparallelism: {tensor: 1, pipeline: 1}\n": "serving.max_context: must be <= 8192",
        "": "model.path: 'nowhere' is neither a directory",
    }
    for i, (extra, msg) in enumerate(cases.items()):
        path = tmp_path / f"m{i}.yaml"
        path.write_text(f"model: {{path: {CONFIGS / 'llama-3-70b' if extra else 'nowhere'}}}\n{extra}")
        assert main(["plan", "--manifest", str(path)]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: {msg}") and err.count("\n") == 1, err
    # Infeasible: exit 1 with what is missing; and flags the manifest sets are refused, not overridden.
    path = tmp_path / "small.yaml"
    path.write_text(f"model: {{path: {CONFIGS / 'llama-3-70b'}}}\nnodes: [{{name: a, devices: [{{memory: 8GiB}}]}}]\n")
    assert main(["plan", "--manifest", str(path)]) == 1
    assert "does not fit on a:1x8GiB" in capsys.readouterr().err
    assert main(["plan", "--manifest", str(path), "--dtype", "bfloat16", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--dtype: the manifest sets this (model.dtype); --tp: the manifest sets this (parallelism.tensor)" in err


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


def test_uneven_plans_deploy_as_planned(tmp_path: Path) -> None:
    """The coordinator deploys the planner's split, uneven or not, and pins each rank to its node."""

    def manifest(second: str) -> dict:
        return {"model": {"path": str(CONFIGS / "llama-3-8b"), "dtype": "bfloat16"},
                "nodes": [{"name": "a", "devices": [{"memory": "48GiB"}]},
                          {"name": "b", "devices": [{"memory": second}]}],
                "serving": {"kv_slots": 4, "max_context": 4096, "max_batch_tokens": 1024},
                "services": {"worker": {"device": "cuda"}}}  # fmt: skip

    tight = deploy.resolve(parse_manifest(manifest("8GiB")), tmp_path / "m.yaml")
    assert tight.plan is not None and not tight.plan.even_split and tight.plan.fits
    counts = [b - a for a, b in tight.plan.layer_split]
    assert counts[0] > counts[1] and sum(counts) == 32 and tight.notes and "uneven layer split" in tight.notes[0]
    flags = deploy.coordinator_flags(tight)
    assert flags[flags.index("--layers") + 1] == ",".join(map(str, counts))
    assert flags[flags.index("--rank-nodes") + 1] == "a,b"
    up = deploy.up_args(tight, argparse.Namespace())
    assert (up.layers, up.rank_nodes, up.rebalance) == (",".join(map(str, counts)), "a,b", "none")
    roomy = deploy.resolve(parse_manifest(manifest("48GiB")), tmp_path / "m.yaml")
    assert roomy.plan is not None and roomy.plan.even_split and "--layers" not in deploy.coordinator_flags(roomy)


def test_up_refuses_a_bad_worker_thread_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", "smollm2-135m-instruct", "--worker-threads", "0"]) == 2
    assert "--worker-threads: must be >= 1, got 0" in capsys.readouterr().err
