"""`shardmesh up` on one host: how the workers share its cores (threads per worker, pipeline depth, OpenMP), and
what it prints about the metrics endpoints under `--metrics`."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from shardmesh.core.topology import ModelSpec, ServingLimits, ShardAssignment, Stage, Topology
from shardmesh.engine import compute_priority
from shardmesh.rpc.telemetry import METRICS_LABEL
from shardmesh_cli.main import main
from shardmesh_cli.up import (
    PRIORITY_ENV,
    TURNS_SPINCOUNT,
    CoreShare,
    metrics_endpoints,
    metrics_lines,
    pinned_nodes,
    share_cores,
    uneven_ranks,
    worker_commands,
)


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


def test_stages_taking_turns_get_realtime_compute_threads_where_the_os_allows() -> None:
    allowed = share_cores(2, 1, "cpu", "auto", None, cores=2, env={}, priority="auto", refusal=lambda: None)
    assert allowed.compute_priority == "realtime" and allowed.worker_env[PRIORITY_ENV] == "realtime"
    assert "at real-time priority" in allowed.describe(2)
    refused = share_cores(2, 1, "cpu", "auto", None, cores=2, env={}, priority="auto", refusal=lambda: "EPERM")
    assert refused.compute_priority == "normal" and PRIORITY_ENV not in refused.worker_env
    assert "at normal priority, as real-time was refused: EPERM" in refused.describe(2)


def test_auto_asks_for_realtime_only_where_the_computing_threads_fit_the_cores() -> None:
    def share(*layout: object, priority: str = "auto", refusal: object = lambda: None) -> CoreShare:
        return share_cores(*layout, None, cores=2, env={}, priority=priority, refusal=refusal)  # type: ignore[arg-type]

    alone = share(1, 1, "cpu", "auto")  # pp=1: its two threads, the short spin too (a real-time team's spin
    assert alone.compute_priority == "realtime"  # would keep the gateway off the cores)
    assert alone.worker_env == {"GOMP_SPINCOUNT": TURNS_SPINCOUNT, PRIORITY_ENV: "realtime"}
    assert share(1, 3, "cpu", "auto").worker_env == {}  # three one-thread ranks at once on two cores
    assert share(2, 1, "cpu", "full").compute_priority == "realtime"  # two one-thread stages at once: they fit
    assert share(2, 2, "cpu", "full").compute_priority == "normal"  # four at once on two cores
    assert share(2, 1, "cuda", "auto").worker_env == {}  # GPU workers: not asked


def test_a_given_priority_is_kept_and_the_os_is_not_asked() -> None:
    def asked() -> str | None:
        raise AssertionError("only auto asks the OS here; the command checked an explicit realtime")

    gpu = share_cores(2, 1, "cuda", "auto", None, cores=2, env={}, priority="realtime", refusal=asked)
    assert gpu.compute_priority == "realtime" and gpu.worker_env == {PRIORITY_ENV: "realtime"}
    tp3 = share_cores(1, 3, "cpu", "auto", None, cores=2, env={}, priority="realtime", refusal=asked)
    assert tp3.worker_env == {"GOMP_SPINCOUNT": TURNS_SPINCOUNT, PRIORITY_ENV: "realtime"}
    normal = share_cores(2, 1, "cpu", "auto", None, cores=2, env={}, priority="normal", refusal=asked)
    assert normal.compute_priority == "normal" and normal.worker_env == {"GOMP_SPINCOUNT": TURNS_SPINCOUNT}
    own = share_cores(1, 1, "cpu", "auto", None, cores=2, env={"GOMP_SPINCOUNT": "5"}, priority="realtime",
                      refusal=asked)  # fmt: skip
    assert own.worker_env == {PRIORITY_ENV: "realtime"}  # the caller's OpenMP settings are kept


def test_auto_stays_normal_where_realtime_threads_would_be_unbounded(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:  # fmt: skip
    knob = tmp_path / "sched_rt_runtime_us"
    monkeypatch.setattr(compute_priority, "RT_RUNTIME", knob)
    knob.write_text("-1\n")
    assert "is -1, so real-time threads could starve" in (compute_priority.auto_refusal() or "")
    knob.write_text("950000\n")
    assert compute_priority.unbounded() is None


def test_realtime_that_the_os_refuses_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compute_priority, "refusal", lambda: "Operation not permitted")
    assert main(["up", "--model", "smollm2-135m-instruct", "--compute-priority", "realtime"]) == 2
    assert "error: --compute-priority realtime: this process may not use it: Operation not permitted" in (
        capsys.readouterr().err
    )
    assert main(["worker", "--compute-priority", "realtime"]) == 2
    assert "error: --compute-priority realtime: this process may not use it" in capsys.readouterr().err


def test_tp_ranks_one_more_than_the_cores_are_split_unevenly_and_pinned() -> None:
    """tp=3 on 2 CPUs: shares 2,1,1 and CPUs 0,1,1 (every CPU carries two shares); not where the ranks fit the
    cores, have several threads each, or the model's intermediate_size does not split by the shares' sum."""
    auto = share_cores(1, 3, "cpu", "auto", None, cores=2, env={}, tp_split="auto", intermediate_size=1536,
                       cpu_ids=[4, 6])  # fmt: skip
    assert (auto.tp_split, auto.rank_cpus, auto.worker_threads) == ((2, 1, 1), (4, 6, 6), 1)
    assert "split 2,1,1 and pinned to CPUs 4,6,6" in auto.describe(2, 1)
    turns = share_cores(2, 3, "cpu", "auto", None, cores=2, env={}, tp_split="auto", intermediate_size=1536)
    assert (turns.pipeline, turns.tp_split, turns.rank_cpus) == ("turns", (2, 1, 1), (0, 1, 1))
    assert uneven_ranks(5, [0, 1, 2, 3], 1536) == ((2, 2, 2, 1, 1), (0, 1, 2, 3, 3))
    for share in (
        share_cores(1, 3, "cpu", "auto", None, cores=3, env={}, tp_split="auto", intermediate_size=1536),  # fits
        share_cores(1, 3, "cpu", "auto", 2, cores=2, env={}, tp_split="auto", intermediate_size=1536),  # 2 threads
        share_cores(1, 3, "cpu", "auto", None, cores=2, env={}, tp_split="auto", intermediate_size=66),  # 66 % 4
        share_cores(1, 3, "cpu", "auto", None, cores=2, env={}, tp_split="even", intermediate_size=1536),
        share_cores(2, 3, "cpu", "full", None, cores=2, env={}, tp_split="auto", intermediate_size=1536),  # at once
        share_cores(
            1, 3, ["cpu", "cuda:0", "cpu"], "auto", None, cores=2, env={}, tp_split="auto", intermediate_size=1536
        ),  # a GPU rank
    ):
        assert (share.tp_split, share.rank_cpus) == ((), ())
    given = share_cores(1, 3, "cpu", "auto", None, cores=8, env={}, tp_split="3,2,1", intermediate_size=1536)
    assert (given.tp_split, given.rank_cpus) == ((3, 2, 1), ())  # as given, unpinned


def test_pinned_workers_get_their_cpu_and_the_label_the_coordinator_places_them_by() -> None:
    args = argparse.Namespace(pp=2, tp=3, device="cpu", spares=0, rank_nodes=None)
    commands = dict(worker_commands(args, "127.0.0.1:1", devices=["cpu"] * 6, rank_cpus=(0, 1, 1)))
    assert commands["worker0"][-4:] == ["--label", "node=cpu0", "--cpus", "0"]
    assert commands["worker5"][-4:] == ["--label", "node=cpu1", "--cpus", "1"]
    assert pinned_nodes(2, 3, (0, 1, 1)) == "cpu0,cpu1,cpu1,cpu0,cpu1,cpu1"


def test_up_refuses_a_tp_split_that_does_not_fit_its_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--model", "smollm2-135m-instruct", "--tp", "3", "--tp-split", "2,1"]) == 2
    assert "--tp-split: 2 shares for --tp 3" in capsys.readouterr().err
    assert main(["up", "--model", "smollm2-135m-instruct", "--tp", "3", "--tp-split", "2,one,1"]) == 2
    assert "--tp-split: tp split '2,one,1': expected whole numbers and commas" in capsys.readouterr().err


def test_free_ports_come_from_below_the_ephemeral_range_and_are_not_handed_out_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Outgoing connections take their local ports from the ephemeral range, so a listening port picked there can be
    taken before the service binds it; below it, only another listener can, and a port just handed out is not
    handed out again."""
    import socket

    from shardmesh_cli import up

    low = int(up.EPHEMERAL_RANGE.read_text().split()[0])
    ports = [up.free_port() for _ in range(50)]
    assert all(up.LISTEN_PORTS_FROM <= p < low for p in ports) and len(set(ports)) == 50
    for p in ports[:3]:  # each one bindable on the loopback address
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
    monkeypatch.setattr(up, "EPHEMERAL_RANGE", tmp_path / "missing")  # no range to read: the OS picks
    assert 0 < up.free_port() < 65536
