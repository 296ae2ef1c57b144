"""Pipeline links through shared memory: two sides (threads of this process, or processes) map one ring, and what
one sends the other receives, byte for byte, in order, however it is chunked; the negotiation picks the ring on
both sides or on neither; and a waiting side learns at once that its peer closed the link or died.

The threads each have their own store client, as processes would. No test reads a clock: a failure to notice a
close or a death would surface as the group-timeout message instead (60 s here), which fails the test.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardmesh.core.layout import ShardSpec
from shardmesh.engine import shm_collective, shm_link
from shardmesh.engine.groups import StageLink, form_groups, form_link
from shardmesh.engine.shm_collective import SHM_DIR
from shardmesh.engine.shm_link import ShmLinkWire
from tests.unit.engine.test_groups import on_both_sides

TIMEOUT = timedelta(seconds=60)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def kernel() -> None:
    if shm_link._unavailable():
        pytest.skip(shm_link._unavailable())


@pytest.fixture(autouse=True)
def transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shm_link.TRANSPORT_ENV, raising=False)


def our_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"shardmesh-link-{os.getpid()}-*")}


def link(client: dist.Store, side: int, prefix: str = "l", staging: str = "auto",
         timeout: timedelta = TIMEOUT) -> StageLink:  # fmt: skip
    """This side of a CPU link formed as stages form theirs: side 0 sends."""
    wire, plan = form_link(client, prefix, side, CPU, staging, timeout, f"side {1 - side}")
    return StageLink(wire, is_sender=side == 0, plan=plan)


MESSAGES = [
    torch.randn(1, 576),  # a decode step's hidden state
    torch.randn(16, 576).to(torch.bfloat16),
    torch.randn(300, 576),  # 675 KiB: three chunks of a 256 KiB slot
    torch.tensor([5, 49151, 0], dtype=torch.int64),  # drawn tokens, as the loop carries them
    torch.empty(0, 576),
]


def test_what_one_side_sends_the_other_receives_in_order_across_chunks_and_ring_wraps(store) -> None:
    sent = MESSAGES * 3  # more messages than slots, some bigger than a slot: the ring wraps many times

    def body(client: dist.Store, side: int) -> Any:
        end = link(client, side)
        assert (end.backend, end.describe()) == ("shm", "shm direct (cpu <-> cpu)")
        if side == 0:
            for x in sent:
                end.send(x)
            return end.bytes_sent
        return [end.recv(tuple(x.shape), x.dtype, CPU) for x in sent]

    nbytes, received = on_both_sides(store, body)
    assert nbytes == sum(x.numel() * x.element_size() for x in sent)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(received, sent, strict=True))
    assert our_segments() == set()


def test_a_sender_runs_ahead_by_the_ring_and_then_waits_for_the_receiver(store) -> None:
    """`slots` messages go in with nobody reading (a `full` pipeline's next micro-batch while the next stage still
    computes); one more waits for room, here until the group timeout, since the receiver never reads."""

    def body(client: dist.Store, side: int) -> Any:
        end = link(client, side, timeout=timedelta(seconds=1))
        if side == 1:
            client.wait(["sent"])
            return [end.recv((4,), torch.float32, CPU) for _ in range(shm_link.SLOTS)]
        for i in range(shm_link.SLOTS):
            end.send(torch.full((4,), float(i)))
        with pytest.raises(RuntimeError, match=r"side 1 \(pid \d+\) did not come within the group timeout of 1 s"):
            end.send(torch.zeros(4))
        client.set("sent", "1")
        with pytest.raises(RuntimeError, match="the link broke earlier"):
            end.send(torch.zeros(4))
        return None

    _, received = on_both_sides(store, body)
    assert [x.tolist() for x in received] == [[float(i)] * 4 for i in range(shm_link.SLOTS)]


def test_a_message_of_another_size_than_expected_is_refused_naming_both(store) -> None:
    def body(client: dist.Store, side: int) -> str:
        end = link(client, side)
        if side == 0:
            end.send(torch.zeros(2, dtype=torch.int64))
            return ""
        with pytest.raises(RuntimeError) as e:
            end.recv((4,), torch.int64, CPU)
        return str(e.value)

    assert "sent 16 bytes where side 1 expected a message of 32" in on_both_sides(store, body)[1]


def test_a_side_that_closes_the_link_is_named_by_the_side_waiting_on_it(store) -> None:
    def body(client: dist.Store, side: int) -> str:
        end = link(client, side)
        if side == 0:
            client.wait(["waiting"])
            end.close("a step failed part-way")
            with pytest.raises(RuntimeError, match="closed the link: a step failed part-way"):
                end.send(torch.zeros(1))
            return ""
        client.set("waiting", "1")  # just before it waits: a close before the wait is read just the same
        with pytest.raises(RuntimeError) as e:
            end.recv((1,), torch.float32, CPU)
        return str(e.value)

    assert "side 0 (pid " in (msg := on_both_sides(store, body)[1]) and "closed the link (its epoch broke)" in msg


# ---- which transport ----------------------------------------------------------------------------------------


def test_cpu_stages_get_a_ring_on_their_links_and_their_loop(store) -> None:
    def body(client: dist.Store, stage: int) -> dict[str, str]:
        shard = ShardSpec(0, 2, 4) if stage == 0 else ShardSpec(2, 4, 4)
        return form_groups(client, "v1", shard, stage, 2, CPU).describe_links()

    first, last = on_both_sides(store, body)
    assert first == {"next_link": "shm direct (cpu <-> cpu)", "loop_link": "shm direct (cpu <-> cpu)"}
    assert last == {"prev_link": "shm direct (cpu <-> cpu)", "loop_link": "shm direct (cpu <-> cpu)"}


def test_gloo_on_both_sides_when_the_variable_says_so(store, monkeypatch) -> None:
    monkeypatch.setenv(shm_link.TRANSPORT_ENV, "gloo")
    assert [end.backend for end in on_both_sides(store, lambda c, s: link(c, s))] == ["gloo", "gloo"]


@pytest.mark.parametrize("side", [0, 1])
def test_gloo_on_both_sides_when_one_refuses_or_forces_host_staging(store, monkeypatch, side) -> None:
    """One side's $SHARDMESH_LINK_TRANSPORT=gloo (the other's auto) refuses for both; one side's forced host
    staging makes the link unshareable on both, without a negotiation the other side would wait in."""
    monkeypatch.setattr(shm_link, "transport", lambda: "gloo" if threading.current_thread().name == f"side{side}"
                        else "auto")  # fmt: skip

    def body(client: dist.Store, me: int) -> tuple[str, str]:
        refused = link(client, me, prefix="g")
        staged = link(client, me, prefix="h", staging="host" if me == side else "auto")
        return refused.backend, staged.backend

    assert on_both_sides(store, body) == [("gloo", "gloo")] * 2
    assert our_segments() == set()


def test_a_side_that_cannot_map_the_ring_keeps_both_on_gloo_or_fails_both_when_shm_is_forced(
    store, monkeypatch
) -> None:
    attach = shm_collective.attach_segment

    def attach_or_fail(*args: Any) -> Any:
        if threading.current_thread().name == "side1":
            raise FileNotFoundError("no such file in this /dev/shm")
        return attach(*args)

    monkeypatch.setattr(shm_collective, "attach_segment", attach_or_fail)
    assert [end.backend for end in on_both_sides(store, lambda c, s: link(c, s))] == ["gloo", "gloo"]
    monkeypatch.setenv(shm_link.TRANSPORT_ENV, "shm")

    def forced(client: dist.Store, side: int) -> str:
        with pytest.raises(RuntimeError) as e:
            link(client, side, prefix="f")
        return str(e.value)

    for msg in on_both_sides(store, forced):
        assert msg.startswith("SHARDMESH_LINK_TRANSPORT=shm, but the two sides of link f cannot share memory: ")
        assert "rank 1: cannot map rank 0's segment: no such file" in msg
    assert our_segments() == set()


def test_the_transport_variable_rejects_other_values(monkeypatch) -> None:
    monkeypatch.setenv(shm_link.TRANSPORT_ENV, "rdma")
    with pytest.raises(ValueError, match=r"SHARDMESH_LINK_TRANSPORT='rdma' is not one of auto, shm, gloo"):
        shm_link.transport()


# ---- sides as processes -------------------------------------------------------------------------------------


def process_side(port: int, side: int, victim: int, out: Any) -> None:
    """One side in its own interpreter: side 0 sends a message and then another; side 1 receives both. `victim` (a
    side, or -1) kills itself once the first message went through."""
    torch.set_num_threads(1)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    end = link(client, side, prefix=f"proc/{victim}")
    try:
        if side == 0:
            end.send(torch.arange(6, dtype=torch.float32))
            client.wait([f"received/{victim}"])
            if victim == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if victim == 1:
                client.wait([f"dying/{victim}"])
                while True:  # until the receiver's death shows: a kill is not instantaneous
                    end.send(torch.ones(2))
            end.send(torch.ones(2))
            out.put((side, type(end.wire).__name__, [], ""))
        else:
            first = end.recv((6,), torch.float32, CPU).tolist()
            client.set(f"received/{victim}", "1")
            if victim == 1:
                client.set(f"dying/{victim}", "1")
                os.kill(os.getpid(), signal.SIGKILL)
            end.recv((2,), torch.float32, CPU)
            out.put((side, type(end.wire).__name__, first, ""))
    except RuntimeError as e:
        out.put((side, type(end.wire).__name__, [], str(e)))


def run_sides(store: dist.TCPStore, victim: int) -> tuple[dict[int, tuple], list[int]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=process_side, args=(store.port, s, victim, out), daemon=True) for s in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {s: tuple(rest) for s, *rest in (out.get(timeout=120) for _ in range(1 if victim >= 0 else 2))}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got, [p.pid or 0 for p in procs]


def test_processes_pass_messages_and_a_killed_side_is_named_by_the_other(store) -> None:
    got, pids = run_sides(store, victim=-1)
    assert got == {0: ("ShmLinkWire", [], ""), 1: ("ShmLinkWire", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "")}
    # The victim is a zombie until joined here, after the other side answered: the check must see through that.
    got, pids = run_sides(store, victim=0)
    kind, _, error = got[1]
    assert kind == "ShmLinkWire" and f"side 0 (pid {pids[0]}) died while side 1 waited" in error
    # A sender does not hand messages to a dead receiver (the ring has room for four): its send fails naming it.
    got, pids = run_sides(store, victim=1)
    kind, _, error = got[0]
    assert kind == "ShmLinkWire" and f"side 1 (pid {pids[1]}) died while side 0 waited" in error
    assert not any(SHM_DIR.glob(f"shardmesh-link-{pids[0]}-*"))


@pytest.mark.parametrize("with_pidfd", [True, False], ids=["pidfd", "kill-and-proc"])
def test_a_peer_killed_and_not_yet_reaped_is_dead_to_either_check(monkeypatch, with_pidfd) -> None:
    """A wire tells a dead peer by a pidfd's poll where it can have one, else by kill(pid, 0) and /proc; both must see
    through a zombie. The peer here is a child process, killed and not reaped until the end."""
    if not with_pidfd:
        monkeypatch.setattr(shm_link, "pidfd", lambda pid: -1)
    elif shm_link.pidfd(os.getppid()) < 0:
        pytest.skip("no pidfd on this kernel: the kill-and-proc case covers the check")
    child = subprocess.Popen(["sleep", "600"])
    segment = shm_collective.create_segment(shm_link.segment_bytes(), "link")
    try:
        receiver, sender = ShmLinkWire(segment, 1, child.pid, TIMEOUT), ShmLinkWire(segment, 0, child.pid, TIMEOUT)
        assert (receiver.peer_fd >= 0) == with_pidfd
        child.kill()
        with pytest.raises(RuntimeError, match=rf"side 0 \(pid {child.pid}\) died while side 1 waited"):
            receiver.recv_into(torch.empty(4))
        with pytest.raises(RuntimeError, match=rf"side 1 \(pid {child.pid}\) died while side 0 waited"):
            sender.send(torch.ones(4))
        fd = sender.peer_fd
        del receiver, sender
        gc.collect()
        if fd >= 0:  # the wire's pidfd goes with it
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        child.kill()
        child.wait()
        segment.close()
        (SHM_DIR / segment.name).unlink(missing_ok=True)


def test_a_wire_refuses_device_or_strided_tensors(store) -> None:
    wires = on_both_sides(store, lambda c, s: link(c, s, prefix="t").wire)
    assert isinstance(wires[0], ShmLinkWire)
    with pytest.raises(ValueError, match="contiguous host tensors"):
        wires[0].send(torch.randn(4, 4).t())
