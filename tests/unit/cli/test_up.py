"""`shardmesh up` on one host: how the workers share its cores (threads per worker, pipeline depth, OpenMP), and
what it prints about the metrics endpoints under `--metrics`."""

from __future__ import annotations

import grpc
import pytest

from shardmesh.core.topology import ModelSpec, ServingLimits, ShardAssignment, Stage, Topology
from shardmesh.rpc.telemetry import METRICS_LABEL
from shardmesh_cli.main import main
from shardmesh_cli.up import TURNS_SPINCOUNT, CoreShare, metrics_endpoints, metrics_lines, share_cores


def test_cpu_stages_take_turns_each_on_the_cores_of_its_rank() -> None:
    assert share_cores(2, 1, "cpu", "auto", None, cores=8, env={}) == CoreShare(
        "turns", 8, 1, {"GOMP_SPINCOUNT": TURNS_SPINCOUNT}
    )
    # tensor-parallel ranks of a stage compute at once: they still split the cores
    assert share_cores(3, 2, "cpu", "auto", None, cores=8, env={}).worker_threads == 4
    assert share_cores(2, 3, "cpu", "auto", None, cores=2, env={}).worker_threads == 1


def test_a_full_pipeline_splits_the_cores_among_every_worker() -> None:
    assert share_cores(2, 1, "cpu", "full", None, cores=8, env={}) == CoreShare("full", 4, 0, {})
    assert share_cores(2, 2, "cpu", "full", None, cores=2, env={}).worker_threads == 1
    assert share_cores(2, 1, "cuda", "auto", None, cores=8, env={}).pipeline == "full"  # devices of their own
    assert share_cores(1, 1, "cpu", "auto", None, cores=8, env={}) == CoreShare("full", 8, 0, {})


def test_given_threads_and_openmp_settings_are_kept() -> None:
    assert share_cores(2, 1, "cpu", "turns", 3, cores=8, env={}).worker_threads == 3
    assert share_cores(2, 1, "cpu", "full", 3, cores=8, env={}).worker_threads == 3
    for env in ({"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "active"}):
        assert share_cores(2, 1, "cpu", "auto", None, cores=8, env=env).worker_env == {}


def test_an_unknown_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match="--pipeline: must be one of auto, full, turns, got 'half'"):
        share_cores(2, 1, "cpu", "half", None, cores=8, env={})


def _topology_with_workers(*workers: tuple[int, int, str, str]) -> Topology:
    """A topology holding `(stage, tp rank, worker id, metrics label)` shards; an empty id is a vacant slot."""
    shards: dict[int, list[ShardAssignment]] = {}
    for rank, (stage, tp_rank, worker_id, metrics) in enumerate(workers):
        labels = ((METRICS_LABEL, metrics),) if metrics else ()
        shards.setdefault(stage, []).append(ShardAssignment(tp_rank, rank, worker_id, labels=labels))
    stages = tuple(Stage(i, i, i + 1, tuple(s)) for i, s in shards.items())
    model = ModelSpec("m", "float32", "LlamaForCausalLM", len(stages), 8, 16, 32)
    return Topology(1, model, len(stages), 2, stages, None, False, ServingLimits(1, 32, 32))


def test_metrics_lines_name_every_endpoint_and_the_top_command() -> None:
    topology = _topology_with_workers((0, 0, "worker-0", "127.0.0.1:9101"), (1, 0, "worker-1", ""), (1, 1, "", ""))
    services = {"coordinator": "127.0.0.1:9001", "gateway": "127.0.0.1:9002"}
    endpoints = metrics_endpoints(services, topology)
    assert endpoints == [
        ("gateway", "127.0.0.1:9002"),
        ("coordinator", "127.0.0.1:9001"),
        ("worker-0 (stage 0, tp rank 0)", "127.0.0.1:9101"),
        ("worker-1 (stage 1, tp rank 0)", ""),  # registered without metrics: said so, not skipped
    ]
    assert metrics_lines("127.0.0.1:50051", endpoints) == [
        "metrics: gateway                        http://127.0.0.1:9002/metrics",
        "metrics: coordinator                    http://127.0.0.1:9001/metrics",
        "metrics: worker-0 (stage 0, tp rank 0)  http://127.0.0.1:9101/metrics",
        "metrics: worker-1 (stage 1, tp rank 0)  (not published)",
        "watch the mesh: shardmesh top --coordinator 127.0.0.1:50051 --gateway-metrics 127.0.0.1:9002",
    ]


def test_metrics_lines_without_a_topology_still_name_the_services() -> None:
    unreachable = grpc.RpcError()
    endpoints = metrics_endpoints({"coordinator": "127.0.0.1:9001"}, unreachable)
    assert metrics_lines("127.0.0.1:50051", endpoints) == [
        "metrics: coordinator  http://127.0.0.1:9001/metrics",
        "watch the mesh: shardmesh top --coordinator 127.0.0.1:50051",
    ]


def test_up_refuses_a_bad_worker_thread_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", "smollm2-135m-instruct", "--worker-threads", "0"]) == 2
    assert "--worker-threads: must be >= 1, got 0" in capsys.readouterr().err
