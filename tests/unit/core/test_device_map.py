"""`--device` to one device per rank (shardmesh.core.device_map): each rank on a GPU of its own, for 1, 2, 4 and 8
visible GPUs, and every refusal naming the flag and the counts. No GPU is needed: the count is passed in."""

from __future__ import annotations

import pytest

from shardmesh.core import device_map
from shardmesh.core.device_map import assign_devices, check_worker_device, spare_devices


@pytest.mark.parametrize("visible", [1, 2, 4, 8])
def test_cuda_puts_rank_r_on_cuda_r_while_the_gpus_last(visible: int) -> None:
    for pp, tp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (8, 1)]:
        world = pp * tp
        if world <= visible:
            assert assign_devices("cuda", pp, tp, visible) == [f"cuda:{r}" for r in range(world)]
        else:
            with pytest.raises(ValueError) as e:
                assign_devices("cuda", pp, tp, visible)
            seen = f"{visible} {'is' if visible == 1 else 'are'} visible"
            assert f"--device cuda: {world} ranks (pp={pp} × tp={tp}) need {world} GPUs, one each, but {seen}" in str(
                e.value
            )


def test_cpu_is_every_rank_and_needs_no_gpu() -> None:
    assert assign_devices("cpu", 2, 3, visible_gpus=0) == ["cpu"] * 6
    assert not device_map.needs_gpus("cpu") and device_map.needs_gpus("cpu,cuda")


def test_one_rank_may_name_its_gpu() -> None:
    assert assign_devices("cuda:3", 1, 1, visible_gpus=4) == ["cuda:3"]
    with pytest.raises(ValueError, match=r"--device cuda:3: GPU 3 does not exist: 2 GPUs are visible \(cuda:0..cuda:1"):
        assign_devices("cuda:3", 1, 1, visible_gpus=2)
    with pytest.raises(ValueError, match=r"GPU 0 does not exist: 0 GPUs are visible \(no CUDA device"):
        assign_devices("cuda:0", 1, 1, visible_gpus=0)


def test_one_gpu_for_several_ranks_is_refused() -> None:
    with pytest.raises(ValueError) as e:
        assign_devices("cuda:3", 2, 2, visible_gpus=8)
    assert str(e.value) == ("--device cuda:3: 4 ranks cannot share one GPU (NCCL refuses two ranks on one GPU); give "
                            "--device cuda for one GPU per rank, or a list")  # fmt: skip


@pytest.mark.parametrize("visible", [4, 8])
def test_a_list_per_rank_or_per_stage(visible: int) -> None:
    # One entry per rank: named GPUs as named, plain cuda on the lowest GPUs no entry names, in rank order.
    assert assign_devices("cuda:1,cuda,cuda:0,cuda", 2, 2, visible) == ["cuda:1", "cuda:2", "cuda:0", "cuda:3"]
    # One entry per stage, for each of its tp ranks: a CPU stage next to a CUDA stage.
    assert assign_devices("cpu,cuda", 2, 2, visible) == ["cpu", "cpu", "cuda:0", "cuda:1"]
    assert assign_devices("cuda,cpu", 2, 2, visible) == ["cuda:0", "cuda:1", "cpu", "cpu"]
    assert assign_devices("cpu,cuda:3", 2, 1, visible) == ["cpu", "cuda:3"]
    # tp = 1: per stage and per rank are the same list
    assert assign_devices(" cuda:2 , cuda ", 2, 1, visible) == ["cuda:2", "cuda:0"]


def test_two_ranks_on_one_gpu_in_a_list_are_refused() -> None:
    with pytest.raises(ValueError) as e:
        assign_devices("cuda:1,cuda,cuda:1,cuda", 2, 2, visible_gpus=4)
    assert "ranks 0 and 2 both on cuda:1 (NCCL refuses two ranks on one GPU)" in str(e.value)
    with pytest.raises(ValueError, match=r"stage 1 on cuda:1: its 2 tensor-parallel ranks cannot share one GPU"):
        assign_devices("cpu,cuda:1", 2, 2, visible_gpus=4)


def test_a_stage_whose_ranks_mix_cpu_and_cuda_is_refused() -> None:
    with pytest.raises(ValueError) as e:
        assign_devices("cpu,cpu,cuda,cpu", 2, 2, visible_gpus=4)
    assert (
        "--device cpu,cpu,cuda,cpu: stage 1: its tensor-parallel ranks must share a device type, got cuda:0, cpu"
        in (str(e.value))
    )


def test_list_refusals_name_the_counts() -> None:
    with pytest.raises(ValueError, match=r"3 entries for pp=2 × tp=2; give 2, one per stage, or 4, one per rank"):
        assign_devices("cuda,cuda,cuda", 2, 2, visible_gpus=8)
    with pytest.raises(ValueError, match=r"3 entries for pp=2 × tp=1; give 2, one per rank"):
        assign_devices("cuda,cuda,cuda", 2, 1, visible_gpus=8)
    with pytest.raises(ValueError, match=r"cuda:5 \(rank 1\) does not exist: 4 GPUs are visible"):
        assign_devices("cuda,cuda:5", 2, 1, visible_gpus=4)
    with pytest.raises(ValueError, match=r"3 ranks on plain cuda need 3 GPUs besides the 1 named, but 3 are visible"):
        assign_devices("cuda:0,cuda,cuda,cuda", 2, 2, visible_gpus=3)
    with pytest.raises(ValueError, match=r"'tpu' \(rank 1\) is not cpu, cuda or cuda:N"):
        assign_devices("cpu,tpu", 2, 1, visible_gpus=1)
    with pytest.raises(ValueError, match=r"--device: expected cpu, cuda, cuda:N or a comma-separated list"):
        assign_devices("gpu", 1, 1, visible_gpus=1)


def test_the_flag_is_named_as_the_caller_says() -> None:
    with pytest.raises(ValueError, match=r"^services.worker.device cuda:1: 2 ranks cannot share one GPU"):
        assign_devices("cuda:1", 2, 1, visible_gpus=4, flag="services.worker.device")


def test_spares_take_the_gpus_no_rank_uses() -> None:
    assert spare_devices(["cpu", "cpu"], 2, visible_gpus=0) == ["cpu", "cpu"]
    assert spare_devices(["cuda:0", "cuda:2"], 2, visible_gpus=4) == ["cuda:1", "cuda:3"]
    with pytest.raises(ValueError) as e:
        spare_devices(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 2, visible_gpus=5)
    assert "--spares 2: each spare needs a GPU of its own, but the 4 ranks (--device) use 4 of the 5 visible GPUs, " \
           "leaving 1" in str(e.value)  # fmt: skip


def test_one_worker_checks_its_own_device() -> None:
    assert check_worker_device("cpu", 0) == "cpu"
    assert check_worker_device("cuda", 1) == "cuda:0"  # plain cuda: GPU 0, as in a container that sees one
    assert check_worker_device("cuda:3", 4) == "cuda:3"
    with pytest.raises(ValueError, match=r"^--device cuda:4: GPU 4 does not exist: 4 GPUs are visible"):
        check_worker_device("cuda:4", 4)
    with pytest.raises(ValueError, match=r"^--device cuda: GPU 0 does not exist: 0 GPUs are visible"):
        check_worker_device("cuda", 0)
    with pytest.raises(ValueError, match=r"^--device: expected cpu, cuda or cuda:N, got 'cuda,cuda'"):
        check_worker_device("cuda,cuda", 2)


def test_visible_gpu_count_asks_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert device_map.visible_gpu_count() == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_map.visible_gpu_count() == 0
