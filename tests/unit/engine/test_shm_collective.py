"""Tensor-parallel collectives through shared memory: real ranks (threads of this process, or processes) map one
segment, and every rank must get the reference sum, bit for bit the same as every other rank.

The threads each have their own store client, as processes would. The process tests start fresh interpreters
(spawn): one of them is killed with SIGKILL while its peers wait, and they must say which rank died. No test reads
a clock: a failure to notice the death would surface as the group-timeout message instead, which fails the test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardmesh.engine import groups, shm_collective
from shardmesh.engine.groups import GroupCollective, form_tp_collective
from shardmesh.engine.shm_collective import SHM_DIR, ShmCollective, negotiate
from tests.unit.engine.test_groups import on_threads

TIMEOUT = timedelta(seconds=60)


@pytest.fixture(autouse=True, scope="module")
def kernel() -> None:
    if not shm_collective.available():
        pytest.skip(f"no C++ build: {shm_collective.build_error()}")


@pytest.fixture(autouse=True)
def transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(groups.TP_TRANSPORT_ENV, raising=False)


def our_segments() -> set[str]:
    """Segment files this process created (their names carry the creator's pid)."""
    return {p.name for p in SHM_DIR.glob(f"shardmesh-tp-{os.getpid()}-*")}


def on_ranks(store: dist.TCPStore, size: int, fn: Callable[[dist.Store, int], Any]) -> list[Any]:
    """`fn(client, rank)` in `size` threads named rank0.., each with its own store client; results by rank."""
    return on_threads(store, [f"rank{r}" for r in range(size)], fn, TIMEOUT)


def tp_groups(store: dist.TCPStore, size: int, body: Callable[[Any, int], Any], prefix: str = "t") -> list[Any]:
    """Form a CPU tp group of `size` thread ranks (`form_tp_collective`) and run `body(collective, rank)`."""
    return on_ranks(store, size, lambda c, r: body(form_tp_collective(c, prefix, r, size, torch.device("cpu"),
                                                                       TIMEOUT), r))  # fmt: skip


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def reference_sum(size: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every rank's input added in rank order in float32, rounded once to `dtype`."""
    total = rank_input(0, shape, dtype).float()
    for r in range(1, size):
        total = total + rank_input(r, shape, dtype).float()
    return total.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (3, 7, 5)])
@pytest.mark.parametrize("spin_s", [0.0, shm_collective.SPIN_S], ids=["yield", "spin"])
def test_all_reduce_is_the_rank_order_sum_on_every_rank_bit_for_bit(store, dtype, shape, spin_s) -> None:
    def body(tp: Any, rank: int) -> tuple[str, list[torch.Tensor], tuple[int, int]]:
        tp.spin_s = spin_s  # either wait, whatever this host's cores would pick
        outs = [tp.all_reduce(rank_input(rank, shape, dtype)) for _ in range(5)]  # both buffers, twice over
        return tp.describe(), outs, (tp.calls, tp.bytes)

    results = on_ranks(store, 3, lambda c, r: body(form_tp_collective(c, "t", r, 3, torch.device("cpu"),
                                                                       TIMEOUT), r))  # fmt: skip
    expected = reference_sum(3, shape, dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    for described, outs, (calls, nbytes) in results:
        assert described.startswith("shm")
        for out in outs:
            assert out.dtype == dtype and out.shape == shape
            assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
        assert (calls, nbytes) == (5, 5 * expected.numel() * elem)
    assert our_segments() == set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_add_is_the_residual_plus_the_sum_as_the_two_ops_round_it(store, dtype) -> None:
    """A row-parallel product's end and its residual in one call: bit for bit `x + all_reduce(partial)`, written over
    `partial`. Tensors the segment does not carry in one call (a residual of another dtype, a strided partial) take
    the two ops, and the ranks stay in step for the next call."""
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(7)).to(dtype)

    def body(tp: Any, rank: int) -> list[tuple[torch.Tensor, bool]]:
        calls = [(rank_input(rank, (16, 576), dtype), x), (rank_input(rank, (1, 576), dtype), x[:1]),
                 (rank_input(rank, (16, 576), dtype), x.double()),  # another dtype: the long way
                 (rank_input(rank, (576, 16), dtype).t(), x),  # strided: the long way
                 (rank_input(rank, (16, 576), dtype), x)]  # fmt: skip
        return [(got, got.data_ptr() == partial.data_ptr()) for partial, residual in calls
                for got in [tp.all_reduce_add(partial, residual)]]  # fmt: skip

    expected = [x + reference_sum(3, (16, 576), dtype), x[:1] + reference_sum(3, (1, 576), dtype),
                x.double() + reference_sum(3, (16, 576), dtype),
                x + reference_sum(3, (576, 16), dtype).t(), x + reference_sum(3, (16, 576), dtype)]  # fmt: skip
    for outs in tp_groups(store, 3, body):
        for (got, _), want in zip(outs, expected, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert [in_place for _, in_place in outs] == [True, True, False, False, True]


def test_bfloat16_sums_round_as_torch_at_ties_overflow_and_nan(store) -> None:
    """The sums are rounded to bfloat16 as torch rounds them where rounding is delicate: sums exactly halfway between
    two bfloat16 numbers (to the even one, down and up), a sum within float32's range but past bfloat16's largest (to
    infinity), infinities, NaN staying NaN, signed zeros, denormals; with the residual added and rounded again.
    Compared bit for bit but for NaN's bits (torch's own conversions differ there: 0x7fc0 scalar, 0xffff vectorized),
    over 1500 values: past one chunk of the sum."""
    # rank by rank: 1 + 2**-8 (halfway: down to 1), 1 + 2**-7 + 2**-8 (halfway: up to 1 + 2**-6), 3.4e38, inf, -inf,
    # NaN, +0, -0, 3e-40
    per_rank = [[1.0, 1 + 2**-7, 1.7e38, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, 0.5],
                [2**-8, 2**-8, 1.7e38, 1.0, 1.0, 1.0, -0.0, -0.0, 1e-40, 2**-9],
                [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, -0.0, 1e-40, 2**-9]]  # fmt: skip

    def inputs(rank: int) -> torch.Tensor:
        return torch.tensor(per_rank[rank] * 150).to(torch.bfloat16)

    residual = torch.tensor([0.5, -0.25, 1.0, 3.0, 2**-9, -7.0, 0.0, -0.0, 1.5, -1e-40] * 150).to(torch.bfloat16)

    def body(tp: Any, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tp.all_reduce(inputs(rank)), tp.all_reduce_add(inputs(rank), residual)

    total = inputs(0).float() + inputs(1).float() + inputs(2).float()
    want_sum, want_add = total.to(torch.bfloat16), residual + total.to(torch.bfloat16)
    assert want_sum[:3].tolist() == [1.0, 1 + 2**-6, float("inf")]  # the cases are what they say
    for got_sum, got_add in tp_groups(store, 3, body):
        for got, want in ((got_sum, want_sum), (got_add, want_add)):
            nan = want.isnan()
            assert bool(nan.any()) and torch.equal(got.isnan(), nan)
            assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_a_rank_spins_only_when_its_group_has_a_core_per_rank() -> None:
    # More ranks than cores: the peer a rank waits for may be queued on its core, so it yields at once.
    assert shm_collective.spin_seconds(3, cores=2) == 0.0
    assert shm_collective.spin_seconds(2, cores=2) == shm_collective.SPIN_S
    assert shm_collective.spin_seconds(3, cores=16) == shm_collective.SPIN_S
    assert shm_collective.spin_seconds(3) == shm_collective.spin_seconds(3, cores=len(os.sched_getaffinity(0)))


def test_all_gather_concatenates_every_rank_along_the_last_dim(store) -> None:
    shape = (2, 4, 6)
    outs = tp_groups(store, 3, lambda tp, r: tp.all_gather(rank_input(r, shape)))
    expected = torch.cat([rank_input(r, shape) for r in range(3)], dim=-1)
    for out in outs:
        assert torch.equal(out, expected)


def small_groups(store: dist.TCPStore, size: int, capacity: int, body: Callable[[ShmCollective, int], Any]) -> list:
    """Thread ranks over a segment with `capacity`-byte slots, with the Gloo group behind it, as form_groups makes."""

    def main(client: dist.Store, rank: int) -> Any:
        pg = groups.Backend("gloo", TIMEOUT).group(client, "small", rank, size)
        shm, reason = negotiate(client, "small/shm", rank, size, TIMEOUT, GroupCollective(pg, rank, size),
                                capacity=capacity)  # fmt: skip
        assert shm is not None, reason
        return body(shm, rank)

    return on_ranks(store, size, main)


def test_tensors_above_a_slot_go_through_in_chunks_with_the_same_result(store) -> None:
    # 4 KiB slots: 1000 float32 (4000 B) fit in one, 2500 need three; a 40-float row fits, 2000 floats do not.
    def body(tp: ShmCollective, rank: int) -> list[torch.Tensor]:
        return [tp.all_reduce(rank_input(rank, (2500,))), tp.all_reduce(rank_input(rank, (5, 700), torch.bfloat16)),
                tp.all_gather(rank_input(rank, (300, 40))), tp.all_gather(rank_input(rank, (2, 2000)))]  # fmt: skip

    results = small_groups(store, 2, 4096, body)
    expected = [reference_sum(2, (2500,), torch.float32), reference_sum(2, (5, 700), torch.bfloat16),
                torch.cat([rank_input(r, (300, 40)) for r in range(2)], -1),
                torch.cat([rank_input(r, (2, 2000)) for r in range(2)], -1)]  # fmt: skip
    for outs in results:
        for out, want in zip(outs, expected, strict=True):
            assert torch.equal(out, want)


def test_other_dtypes_go_over_the_gloo_group(store) -> None:
    outs = small_groups(store, 2, 4096, lambda tp, r: tp.all_reduce(torch.full((3,), r + 1, dtype=torch.int64)))
    for out in outs:
        assert out.tolist() == [3, 3, 3]


def test_a_rank_that_never_arrives_times_out_naming_it_and_breaks_the_group(store) -> None:
    def body(client: dist.Store, rank: int) -> str:
        pg = groups.Backend("gloo", TIMEOUT).group(client, "late", rank, 2)
        shm, _ = negotiate(client, "late/shm", rank, 2, timedelta(seconds=1), GroupCollective(pg, rank, 2))
        assert shm is not None
        if rank == 1:
            return ""  # never joins the collective
        errors = []
        for _ in range(2):
            with pytest.raises(RuntimeError) as e:
                shm.all_reduce(torch.ones(4))
            errors.append(str(e.value))
        return "\n".join(errors)

    message = on_ranks(store, 2, body)[0]
    assert f"rank 1 (pid {os.getpid()}) did not arrive within the group timeout of 1 s" in message
    assert "the group broke earlier" in message


def test_a_rank_that_closes_the_group_is_named_by_the_rank_waiting_for_it(store) -> None:
    """Rank 1 closes the group (its epoch broke) instead of arriving: rank 0, waiting in an all-reduce, reads that
    in the segment and raises naming it, before the group timeout (30 s here, which the message would name); the
    closed rank's own later calls raise, and so does the Gloo group under it."""

    def body(client: dist.Store, rank: int) -> list[str]:
        pg = groups.Backend("gloo", TIMEOUT).group(client, "closed", rank, 2)
        fallback = GroupCollective(pg, rank, 2)
        shm, _ = negotiate(client, "closed/shm", rank, 2, timedelta(seconds=30), fallback)
        assert shm is not None
        errors = []
        if rank == 1:
            shm.close("a step failed part-way")
            for call in (lambda: shm.all_reduce(torch.ones(4)), lambda: fallback.all_reduce(torch.ones(4))):
                with pytest.raises(RuntimeError) as e:
                    call()
                errors.append(str(e.value))
            return errors
        with pytest.raises(RuntimeError) as e:
            shm.all_reduce(torch.ones(4))
        return [str(e.value)]

    waiting, closed = on_ranks(store, 2, body)
    assert f"rank 1 (pid {os.getpid()}) closed the group (its epoch broke) while rank 0 waited" in waiting[0]
    assert "the group broke earlier (rank 1 closed the group: a step failed part-way)" in closed[0]
    assert closed[1] == "the process group was closed: a step failed part-way"


def test_transport_env_forces_gloo_or_shm_and_rejects_other_values(store, monkeypatch) -> None:
    monkeypatch.setenv(groups.TP_TRANSPORT_ENV, "gloo")
    assert all(isinstance(tp, GroupCollective) for tp in tp_groups(store, 2, lambda tp, r: tp, "g"))
    monkeypatch.setenv(groups.TP_TRANSPORT_ENV, "shm")
    assert all(isinstance(tp, ShmCollective) for tp in tp_groups(store, 2, lambda tp, r: tp, "s"))
    monkeypatch.setenv(groups.TP_TRANSPORT_ENV, "nvlink")
    with pytest.raises(ValueError, match=r"SHARDMESH_TP_TRANSPORT='nvlink' is not one of auto, shm, gloo"):
        groups.tp_transport()


def test_a_gpu_group_never_negotiates_shared_memory(store, monkeypatch) -> None:
    monkeypatch.setenv(groups.TP_TRANSPORT_ENV, "nvlink")  # not even read for a GPU group
    monkeypatch.setattr(groups.Backend, "for_device", classmethod(lambda cls, d, t: cls("gloo", t)))
    got = on_ranks(store, 2, lambda c, r: form_tp_collective(c, "gpu", r, 2, torch.device("cuda"), TIMEOUT))
    assert all(isinstance(tp, GroupCollective) for tp in got)


def refuse_on_rank1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 (the thread named rank1) cannot map rank 0's segment, as on another host."""
    attach = shm_collective.attach_segment

    def attach_or_fail(*args: Any) -> Any:
        if threading.current_thread().name == "rank1":
            raise FileNotFoundError("no such file in this /dev/shm")
        return attach(*args)

    monkeypatch.setattr(shm_collective, "attach_segment", attach_or_fail)


def test_auto_falls_back_to_gloo_on_every_rank_when_one_cannot_map(store, monkeypatch) -> None:
    refuse_on_rank1(monkeypatch)
    outs = tp_groups(store, 3, lambda tp, r: (type(tp), tp.all_reduce(torch.full((2,), float(r)))))
    assert [kind for kind, _ in outs] == [GroupCollective] * 3
    assert all(out.tolist() == [3.0, 3.0] for _, out in outs)
    assert our_segments() == set()


def test_forced_shm_fails_on_every_rank_with_the_reason(store, monkeypatch) -> None:
    refuse_on_rank1(monkeypatch)
    monkeypatch.setenv(groups.TP_TRANSPORT_ENV, "shm")

    def body(client: dist.Store, rank: int) -> str:
        with pytest.raises(RuntimeError) as e:
            form_tp_collective(client, "f", rank, 2, torch.device("cpu"), TIMEOUT)
        return str(e.value)

    for message in on_ranks(store, 2, body):
        assert "SHARDMESH_TP_TRANSPORT=shm" in message and "rank 1: cannot map rank 0's segment" in message


def test_without_the_kernel_every_rank_keeps_gloo(store, monkeypatch) -> None:
    monkeypatch.setattr(shm_collective, "available", lambda: threading.current_thread().name != "rank1")
    reasons = on_ranks(store, 2, lambda c, r: negotiate(c, "k", r, 2, TIMEOUT, object())[1])
    assert all(reason.startswith("rank 1: no C++ build") for reason in reasons)
    assert our_segments() == set()


def test_a_rank_that_never_reports_leaves_no_segment_behind(store) -> None:
    with pytest.raises(RuntimeError, match="rank 1 did not report within 1 s"):
        negotiate(store, "alone", 0, 2, timedelta(seconds=1), object())
    assert our_segments() == set()


# ---- ranks as processes -------------------------------------------------------------------------------------


def process_rank(port: int, rank: int, size: int, victim: int, out: Any) -> None:
    """One rank in its own interpreter: form the group, then all-reduce; `victim` kills itself instead."""
    torch.set_num_threads(1)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    tp = form_tp_collective(client, "proc", rank, size, torch.device("cpu"), TIMEOUT)
    try:
        first = tp.all_reduce(rank_input(rank, (16, 576)))
        client.set(f"done/{rank}", "1")
        if rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        client.wait([f"done/{r}" for r in range(size)])  # the victim has passed its first collective too
        tp.all_reduce(torch.ones(576))
        out.put((rank, type(tp).__name__, first.numpy().tobytes(), ""))
    except RuntimeError as e:
        out.put((rank, type(tp).__name__, b"", str(e)))


def run_processes(store: dist.TCPStore, size: int, victim: int) -> tuple[dict[int, tuple], list[int]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=process_rank, args=(store.port, r, size, victim, out), daemon=True)
             for r in range(size)]  # fmt: skip
    for p in procs:
        p.start()
    survivors = size - (victim >= 0)
    try:
        got = {r: tuple(rest) for r, *rest in (out.get(timeout=120) for _ in range(survivors))}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got, [p.pid or 0 for p in procs]


def test_processes_get_the_same_sum_bit_for_bit(store) -> None:
    got, pids = run_processes(store, 3, victim=-1)
    expected = reference_sum(3, (16, 576), torch.float32).numpy().tobytes()
    assert got == {r: ("ShmCollective", expected, "") for r in range(3)}
    assert not any(SHM_DIR.glob(f"shardmesh-tp-{pids[0]}-*"))


def test_a_killed_peer_process_is_named_by_the_ranks_waiting_for_it(store) -> None:
    # The victim is a zombie until joined here, after the survivors answered: the wait must see through that.
    got, pids = run_processes(store, 3, victim=1)
    assert set(got) == {0, 2}
    for kind, _, error in got.values():
        assert kind == "ShmCollective"
        assert f"rank 1 (pid {pids[1]}) died while" in error
    assert not any(SHM_DIR.glob(f"shardmesh-tp-{pids[0]}-*"))
