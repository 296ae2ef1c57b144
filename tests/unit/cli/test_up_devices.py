"""Each rank on a device of its own: the `--device` that `shardmesh up` gives every worker (and spare), the offline
`generate` launcher's per-rank devices, and the usage errors both give before anything starts, for 1, 2, 4 and 8
visible GPUs (a faked count: no GPU is needed)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from shardmesh.core import device_map
from shardmesh_cli import up
from shardmesh_cli.main import build_parser, main


def _up_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", "--model", "m", *extra])


def _devices(commands: list[tuple[str, list[str]]]) -> list[str]:
    return [argv[argv.index("--device") + 1] for _, argv in commands]


Gpus = Callable[[int], None]


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Gpus:
    """Set how many GPUs this process sees."""

    def visible(n: int) -> None:
        monkeypatch.setattr(device_map, "visible_gpu_count", lambda: n)

    return visible


@pytest.mark.parametrize("visible", [1, 2, 4, 8])
def test_up_gives_each_worker_the_gpu_of_its_rank(gpus: Gpus, visible: int) -> None:
    gpus(visible)
    for pp, tp in [(1, 1), (2, 1), (2, 2), (4, 2)]:
        if pp * tp > visible:
            continue
        commands = up.worker_commands(_up_args("--pp", str(pp), "--tp", str(tp), "--device", "cuda"), "c:1")
        for rank, (name, argv) in enumerate(commands):
            assert (name, argv[argv.index("--worker-id") + 1]) == (f"worker{rank}", f"worker-{rank}")
            assert argv[argv.index("--device") + 1] == f"cuda:{rank}"  # each its own GPU, matching its rank


def test_up_on_cpu_asks_no_gpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    def no(*_: object) -> int:
        raise AssertionError("a CPU mesh must not import torch to count GPUs")

    monkeypatch.setattr(device_map, "visible_gpu_count", no)
    assert _devices(up.worker_commands(_up_args("--pp", "2", "--tp", "2", "--spares", "1"), "c:1")) == ["cpu"] * 5


def test_up_gives_spares_the_gpus_no_rank_uses(gpus: Gpus) -> None:
    gpus(8)
    args = _up_args("--pp", "2", "--tp", "2", "--device", "cuda", "--spares", "2")
    assert _devices(up.worker_commands(args, "c:1")) == [f"cuda:{i}" for i in range(6)]
    listed = _up_args("--pp", "2", "--device", "cuda:5,cuda:4", "--spares", "1")
    assert _devices(up.worker_commands(listed, "c:1")) == ["cuda:5", "cuda:4", "cuda:0"]


def test_up_honours_one_named_gpu_for_one_rank(gpus: Gpus) -> None:
    gpus(4)
    assert _devices(up.worker_commands(_up_args("--device", "cuda:3"), "c:1")) == ["cuda:3"]


@pytest.mark.parametrize(
    ("flags", "visible", "message"),
    [
        (["--pp", "2", "--tp", "2", "--device", "cuda"], 2,
         "error: --device cuda: 4 ranks (pp=2 × tp=2) need 4 GPUs, one each, but 2 are visible"),
        (["--pp", "2", "--tp", "2", "--device", "cuda:3"], 8,
         "error: --device cuda:3: 4 ranks cannot share one GPU (NCCL refuses two ranks on one GPU)"),
        (["--pp", "2", "--tp", "2", "--device", "cuda:1,cuda,cuda:1,cuda"], 4,
         "ranks 0 and 2 both on cuda:1"),
        (["--pp", "2", "--tp", "2", "--device", "cpu,cpu,cuda,cpu"], 4,
         "stage 1: its tensor-parallel ranks must share a device type"),
        (["--pp", "2", "--device", "cuda", "--spares", "2"], 3,
         "error: --spares 2: each spare needs a GPU of its own, but the 2 ranks (--device) use 2 of the 3 visible "
         "GPUs, leaving 1"),
    ],
)  # fmt: skip
def test_up_refuses_ranks_without_a_gpu_of_their_own(gpus: Gpus, capsys: pytest.CaptureFixture[str], flags: list[str],
                                                     visible: int, message: str) -> None:  # fmt: skip
    gpus(visible)
    assert main(["up", "--model", "m", *flags]) == 2  # a usage error, before the model is even looked up
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cpu_ranks_of_a_mixed_mesh_share_the_cores() -> None:
    # a CPU stage next to a CUDA stage: the pipeline runs full, the cores split among the CPU ranks only
    share = up.share_cores(2, 2, ["cpu", "cpu", "cuda:0", "cuda:1"], "auto", None, cores=8, env={})
    assert (share.pipeline, share.worker_threads) == ("full", 4)
    assert up.share_cores(2, 2, ["cpu"] * 4, "auto", None, cores=8, env={}).pipeline == "turns"
    assert up.share_cores(2, 2, [f"cuda:{i}" for i in range(4)], "auto", None, cores=8, env={}).worker_threads == 2


@pytest.mark.parametrize("visible", [1, 2, 4, 8])
def test_offline_generate_gives_each_rank_its_own_device(gpus: Gpus, visible: int) -> None:
    gpus(visible)
    for pp, tp in [(1, 1), (2, 1), (2, 2), (2, 4)]:
        if pp * tp <= visible:
            assert device_map.rank_devices("cuda", pp, tp) == [f"cuda:{r}" for r in range(pp * tp)]
        else:
            with pytest.raises(ValueError, match=rf"need {pp * tp} GPUs, one each, but {visible} (is|are) visible"):
                device_map.rank_devices("cuda", pp, tp)
    assert device_map.rank_devices("cpu", 2, 2) == ["cpu"] * 4
    assert device_map.rank_devices(f"cuda:{visible - 1}", 1, 1) == [f"cuda:{visible - 1}"]


def test_offline_generate_refuses_before_any_process_starts(gpus: Gpus, capsys: pytest.CaptureFixture[str]) -> None:
    gpus(1)
    assert main(["generate", "--model", "m", "--token-ids", "1", "--pp", "2", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "error: --device cuda: 2 ranks (pp=2 × tp=1) need 2 GPUs, one each, but 1 is visible" in err
