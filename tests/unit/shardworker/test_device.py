"""A worker on its own GPU: what it registers and reports is that GPU's (name, memory, UUID, index), its metrics
read that GPU's memory, and a `--device` naming a GPU this process does not see is a usage error. CUDA is faked:
torch.cuda's queries are replaced, nothing runs on a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from shardmesh.core import device_map
from shardmesh.proto.v1 import common_pb2
from shardmesh.rpc.flags import UsageError
from shardmesh_cli.main import main
from shardworker import app
from shardworker.metrics import WorkerMetrics
from shardworker.servicer import device_pb


class Quiet:
    """A logger that drops everything (the process's own log configuration is global)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **fields: None


@dataclass(frozen=True)
class Props:
    """What torch.cuda.get_device_properties returns, as far as the worker reads it."""

    name: str
    total_memory: int
    uuid: str


GPUS = [Props(f"GPU model {i}", (i + 1) * 2**30, f"GPU-{i:04d}") for i in range(4)]


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """torch.cuda with 4 GPUs of different names and memory; returns the indices asked for, in order."""
    asked: list[Any] = []

    def properties(index: int) -> Props:
        asked.append(index)
        return GPUS[index]

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    return asked


@pytest.mark.parametrize("index", [0, 1, 3])
def test_device_pb_reports_the_workers_own_gpu(four_gpus: list[Any], index: int) -> None:
    pb = device_pb(torch.device(f"cuda:{index}"))
    assert four_gpus == [index]  # its own GPU's properties, never GPU 0's for another index
    assert (pb.type, pb.name, pb.memory_bytes) == (common_pb2.DEVICE_TYPE_CUDA, f"GPU model {index}",
                                                   (index + 1) * 2**30)  # fmt: skip
    assert (pb.uuid, pb.index) == (f"GPU-{index:04d}", index)


def test_device_pb_of_plain_cuda_is_the_current_device_and_cpu_has_no_uuid(four_gpus: list[Any]) -> None:
    assert device_pb("cuda").name == "GPU model 0" and four_gpus == [0]
    cpu = device_pb(torch.device("cpu"))
    assert (cpu.type, cpu.name, cpu.uuid) == (common_pb2.DEVICE_TYPE_CPU, "cpu", "")


def test_metrics_read_the_memory_of_the_workers_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from shardmesh.core.topology import ShardState

    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return (5 * 2**30, 8 * 2**30)

    def memory_reserved(device: torch.device) -> int:
        asked.append(device)
        return 3 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", memory_reserved)
    info = {"weights_bytes": 2**30, "kv_cache_bytes": 2**29, "total_slots": 4, "free_slots": 4, "placement": None,
            "state": ShardState.PENDING}  # fmt: skip
    text = generate_latest(WorkerMetrics(lambda: info, lambda: "w2", "cuda:2").registry).decode()
    assert asked == [torch.device("cuda:2"), torch.device("cuda:2")]
    (memory,) = [f for f in text_string_to_metric_families(text) if f.name == "shardmesh_shard_memory_bytes"]
    by_kind = {sample.labels["kind"]: sample.value for sample in memory.samples}
    assert by_kind["free"] == 5 * 2**30 and by_kind["other"] == 3 * 2**30 - 2**30 - 2**29  # reserved - weights - kv
    assert "on its device (cuda)" in text  # one help text for every GPU worker


def test_worker_device_is_checked_against_the_gpus_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_map, "visible_gpu_count", lambda: 4)
    assert app.worker_device("cuda:3") == "cuda:3" and app.worker_device("cuda") == "cuda:0"
    with pytest.raises(UsageError, match=r"^--device cuda:4: GPU 4 does not exist: 4 GPUs are visible"):
        app.worker_device("cuda:4")
    monkeypatch.setattr(device_map, "visible_gpu_count", lambda: pytest.fail("cpu needs no GPU count"))
    assert app.worker_device("cpu") == "cpu"


def test_a_worker_on_a_gpu_it_does_not_see_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(device_map, "visible_gpu_count", lambda: 0)
    assert main(["worker", "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda:1: GPU 1 does not exist: 0 GPUs are visible") and "Traceback" not in err


def test_the_worker_process_makes_its_gpu_current_before_any_cuda_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """So that nothing it allocates without naming a device lands on GPU 0, which another rank holds."""
    from shardworker.process import WorkerConfig, WorkerProcess

    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    cfg = WorkerConfig("127.0.0.1:1", "127.0.0.1:0", None, None, "cuda:2", {}, 1.0, 1 << 20)
    worker = WorkerProcess(cfg, Quiet())
    try:
        assert current == [torch.device("cuda:2")] and worker.device == torch.device("cuda:2")
    finally:
        worker.stop(grace=0.0)
    cpu = WorkerProcess(WorkerConfig("127.0.0.1:1", "127.0.0.1:0", None, None, "cpu", {}, 1.0, 1 << 20),
                        Quiet())  # fmt: skip
    cpu.stop(grace=0.0)
    assert current == [torch.device("cuda:2")]  # a CPU worker touches no GPU


def test_a_config_read_elsewhere_checks_the_spelling_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest or pod spec for GPU workers is checked on a machine without one: the config parses, a bad spelling
    does not; the GPU itself is checked by the worker that runs it."""
    monkeypatch.setattr(device_map, "visible_gpu_count", lambda: 0)
    assert app.worker_device("cuda:3", check_visible=False) == "cuda:3"
    with pytest.raises(UsageError, match="expected cpu, cuda or cuda:N"):
        app.worker_device("gpu:1", check_visible=False)
    with pytest.raises(UsageError, match="GPU 3 does not exist: 0 GPUs are visible"):
        app.worker_device("cuda:3")
