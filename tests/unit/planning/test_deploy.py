"""From a manifest to what runs: the plan behind it, the services' command lines, and the flags `up` and the
coordinator get (an uneven split and node pinning included)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest
import yaml

from shardmesh.planning import deploy
from shardmesh.planning.manifest import ManifestError, load_manifest, parse_manifest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "compose" / "manifest.example.yaml"
CONFIGS = ROOT / "tests" / "data" / "configs"


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
    gateway = (
        "--max-queue 256 --http-listen 0.0.0.0:8000 --otlp-endpoint http://otel-collector:4317 --metrics-port 9464"
    )
    assert commands[-1].endswith(gateway)
    assert "--served-model-name" not in commands[-1]  # the coordinator's --model is the path as written
    assert all("--otlp-endpoint http://otel-collector:4317 --metrics-port 9464" in c for c in commands)
    up = deploy.up_args(d, argparse.Namespace())
    assert up.otlp_endpoint == "http://otel-collector:4317" and up.metrics


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


def _gateway(command: str) -> argparse.Namespace:
    """A printed gateway command line through the gateway's own parser and checks (`shardmesh gateway`)."""
    from gateway import app as gateway_app
    from shardmesh_cli.main import build_parser

    argv = shlex.split(command)
    assert argv[:2] == ["shardmesh", "gateway"]
    args = build_parser().parse_args(argv[1:])
    gateway_app.build_config(args)
    return args


def test_the_gateway_command_carries_the_http_api_and_the_model_name(tmp_path: Path) -> None:
    """`services.gateway.http_listen` and `model.served_model_name` reach the printed gateway command as the flags
    `up --manifest` gives its gateway; without a served name, the name as written where the coordinator is given a
    directory it resolved (a known name, a Hugging Face id)."""
    path = str(CONFIGS / "llama-3-8b")

    def gateway(model: dict, **service: object) -> argparse.Namespace:
        data = {"model": {"path": path, **model}, "parallelism": {"pipeline": 1, "tensor": 1},
                "services": {"coordinator": {"listen": "127.0.0.1:50051"},
                             "gateway": {"listen": "0.0.0.0:50050", **service}}}  # fmt: skip
        d = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
        return _gateway(deploy.service_commands(d)[-1])

    default = gateway({})
    assert (default.http_listen, default.served_model_name) == ("127.0.0.1:0", None)  # HTTP on, as in `up`
    named = gateway({"served_model_name": "llama"}, http_listen="0.0.0.0:8000")
    assert (named.http_listen, named.served_model_name) == ("0.0.0.0:8000", "llama")
    assert gateway({}, http_listen=None).http_listen is None
    relative = tmp_path / "models" / "llama"  # a directory relative to the manifest: the name as written
    relative.mkdir(parents=True)
    (relative / "config.json").write_text((CONFIGS / "llama-3-8b" / "config.json").read_text())
    path = "models/llama"
    assert gateway({}).served_model_name == "models/llama"


def test_a_coordinator_on_port_0_leaves_its_port_to_fill_in_for_the_others(tmp_path: Path) -> None:
    data = {"model": {"path": str(CONFIGS / "llama-3-8b")}, "parallelism": {"pipeline": 1, "tensor": 1}}
    commands = deploy.service_commands(deploy.resolve(parse_manifest(data), tmp_path / "m.yaml"))
    assert "--listen 127.0.0.1:0" in commands[0]  # it binds a free port ...
    assert all("--coordinator 127.0.0.1:COORDINATOR_PORT" in c for c in commands[1:])  # ... the others need it


def test_manifest_quantization_is_planned_and_passed_on(tmp_path: Path) -> None:
    """`model.quantization: int8` plans int8 weights (about half of bfloat16's bytes per shard) and
    reaches the coordinator as --quantize; none, the default, adds no flag."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["path"] = str(CONFIGS / "llama-3-70b")
    d = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    assert "--quantize" not in deploy.coordinator_flags(d)
    data["model"]["quantization"] = "int8"
    q = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    assert q.plan is not None and d.plan is not None
    assert max(s.memory.weights for s in q.plan.shards) < 0.6 * max(s.memory.weights for s in d.plan.shards)
    flags = deploy.coordinator_flags(q)
    assert flags[flags.index("--quantize") + 1] == "int8"


def test_manifest_memory_budget_reaches_every_worker(tmp_path: Path) -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["path"] = str(CONFIGS / "llama-3-70b")
    data["services"]["worker"]["memory_budget"] = "300MiB"
    d = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    workers = [c for c in deploy.service_commands(d) if " worker " in c]
    assert workers and all("--memory-budget 314572800" in c for c in workers)
    assert deploy.up_args(d, argparse.Namespace()).memory_budget == "314572800"


def test_a_paged_kv_cache_reaches_the_coordinator_which_counts_the_same_blocks(tmp_path: Path) -> None:
    from coordinator.app import build_config
    from shardmesh_cli.main import build_parser

    data = {"model": {"path": str(CONFIGS / "llama-3-8b"), "dtype": "bfloat16"},
            "parallelism": {"pipeline": 2, "tensor": 1},
            "serving": {"max_context": 4096, "kv_block_size": 16, "kv_cache_memory": "1GiB"}}  # fmt: skip
    d = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    # Stage 0 of 16 layers: 2 × 16 × 8 kv heads × 128 × 16 tokens × 2 B = 1 MiB of keys and values a block, and
    # 16 × 4096 × 2 B = 128 KiB of activation log: 1 GiB buys 910 blocks of 1.125 MiB.
    assert (d.limits.kv_block_size, d.limits.kv_blocks) == (16, 910)
    flags = deploy.coordinator_flags(d)
    assert flags[flags.index("--kv-block-size") + 1] == "16"
    assert flags[flags.index("--kv-cache-memory") + 1] == str(2**30)
    coordinator = build_config(build_parser().parse_args(["coordinator", *flags]))
    assert coordinator.limits == d.limits
    up = deploy.up_args(d, argparse.Namespace())
    assert (up.kv_block_size, up.kv_cache_memory) == (16, str(2**30))
    data["serving"]["kv_cache_memory"] = "200MiB"  # 177 blocks: 2832 tokens, not one 4096-token sequence
    with pytest.raises(ManifestError, match=r"serving\.kv_cache_memory: 209715200 bytes buy 177 blocks of 16 tokens"):
        deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    del data["serving"]["kv_block_size"], data["serving"]["kv_cache_memory"]
    slots = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    assert not slots.limits.paged and "--kv-block-size" not in deploy.coordinator_flags(slots)


def test_manifest_tensor_shares_reach_up_and_the_coordinator(tmp_path: Path) -> None:
    """`parallelism.tensor_split.shares` becomes `--tp-split` for the coordinator (which parses it back) and `up`;
    shares that do not fit the degree or the model are refused naming the field."""
    from coordinator.app import build_config
    from shardmesh_cli.main import build_parser

    data = {"model": {"path": str(CONFIGS / "llama-3-8b"), "dtype": "bfloat16"},
            "parallelism": {"pipeline": 1, "tensor": 2, "tensor_split": {"shares": [3, 1]}}}  # fmt: skip
    d = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    flags = deploy.coordinator_flags(d)
    assert flags[flags.index("--tp-split") + 1] == "3,1"
    assert build_config(build_parser().parse_args(["coordinator", *flags])).tp_split == (3, 1)
    assert deploy.up_args(d, argparse.Namespace(tp_split="auto")).tp_split == "3,1"
    data["parallelism"]["tensor_split"]["shares"] = [2, 1, 1]
    with pytest.raises(ManifestError, match=r"parallelism\.tensor_split\.shares: tp split 2,1,1 has 3 shares for "
                                            r"tensor parallel degree 2"):  # fmt: skip
        deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    data["parallelism"]["tensor_split"]["shares"] = [0, 1]
    with pytest.raises(ManifestError, match=r"parallelism\.tensor_split\.shares\[0\]: must be >= 1, got 0"):
        parse_manifest(data)
    del data["parallelism"]["tensor_split"]
    even = deploy.resolve(parse_manifest(data), tmp_path / "m.yaml")
    assert "--tp-split" not in deploy.coordinator_flags(even)
    assert deploy.up_args(even, argparse.Namespace(tp_split="auto")).tp_split == "auto"  # up's own flag stands


def _gpu_manifest(nodes: list[dict], device: str = "cuda", **parallelism: int) -> dict:
    return {"model": {"path": str(CONFIGS / "llama-3-8b"), "dtype": "bfloat16"}, "nodes": nodes,
            "parallelism": parallelism or {"pipeline": 2, "tensor": 2},
            "serving": {"kv_slots": 4, "max_context": 4096}, "services": {"worker": {"device": device}}}  # fmt: skip


def _worker_devices(commands: list[str]) -> list[str]:
    workers = [shlex.split(c) for c in commands if c.startswith("shardmesh worker")]
    return [argv[argv.index("--device") + 1] for argv in workers]


def test_each_worker_runs_on_the_gpu_the_plan_gives_its_rank(tmp_path: Path) -> None:
    """Over 2 nodes, each node's GPUs count from cuda:0 (the plan's index within the node), one rank per GPU."""
    two = [{"name": "a", "devices": [{"count": 2, "memory": "24GiB"}]},
           {"name": "b", "devices": [{"count": 2, "memory": "24GiB"}]}]  # fmt: skip
    d = deploy.resolve(parse_manifest(_gpu_manifest(two)), tmp_path / "m.yaml")
    assert d.plan is not None and (d.pp, d.tp) == (2, 2)
    commands = deploy.service_commands(d)
    assert _worker_devices(commands) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [shlex.split(c)[-1] for c in commands[1:-1]] == ["node=a", "node=a", "node=b", "node=b"]
    # The device the plan chose, not the rank: a small GPU first on each node holds no shard, so each rank is on
    # its node's cuda:1.
    skip_small = [{"name": n, "devices": [{"memory": "2GiB"}, {"memory": "24GiB"}]} for n in ("a", "b")]
    d = deploy.resolve(parse_manifest(_gpu_manifest(skip_small, pipeline=2, tensor=1)), tmp_path / "m.yaml")
    assert d.plan is not None and [(s.device.node, s.device.index) for s in d.plan.shards] == [("a", 1), ("b", 1)]
    assert _worker_devices(deploy.service_commands(d)) == ["cuda:1", "cuda:1"]
    # `up --manifest` runs every rank on this one host: two nodes' cuda:1 would be one GPU, so rank order instead
    assert deploy.up_args(d, argparse.Namespace()).device == "cuda"


def test_up_on_a_one_node_plan_uses_the_planned_gpus(tmp_path: Path) -> None:
    one = [{"name": "a", "devices": [{"memory": "2GiB"}, {"count": 2, "memory": "24GiB"}]}]
    d = deploy.resolve(parse_manifest(_gpu_manifest(one, pipeline=2, tensor=1)), tmp_path / "m.yaml")
    assert deploy.up_args(d, argparse.Namespace()).device == "cuda:1,cuda:2"
    assert _worker_devices(deploy.service_commands(d)) == ["cuda:1", "cuda:2"]


def test_without_nodes_rank_r_is_on_cuda_r_and_cpu_stays_cpu(tmp_path: Path) -> None:
    d = deploy.resolve(parse_manifest(_gpu_manifest([], pipeline=2, tensor=2)), tmp_path / "m.yaml")
    assert _worker_devices(deploy.service_commands(d)) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    cpu = deploy.resolve(parse_manifest(_gpu_manifest([], "cpu", pipeline=2, tensor=1)), tmp_path / "m.yaml")
    assert _worker_devices(deploy.service_commands(cpu)) == ["cpu", "cpu"]
    one = deploy.resolve(parse_manifest(_gpu_manifest([], "cuda:3", pipeline=1, tensor=1)), tmp_path / "m.yaml")
    assert _worker_devices(deploy.service_commands(one)) == ["cuda:3"]


def test_one_named_gpu_for_several_ranks_is_a_manifest_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError) as e:
        deploy.resolve(parse_manifest(_gpu_manifest([], "cuda:1", pipeline=2, tensor=2)), tmp_path / "m.yaml")
    assert e.value.errors == ["services.worker.device cuda:1: 4 ranks cannot share one GPU (NCCL refuses two ranks on "
                              "one GPU); give services.worker.device cuda for one GPU per rank, or a list"]  # fmt: skip
