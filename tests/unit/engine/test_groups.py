"""Stage links agree on their backend through the store, and a side that must stages through host memory.

Each test forms real two-rank Gloo links between two threads, one store client each, as two processes would.
No GPU here: a side "on CUDA" is one whose `groups.device_type` answers "cuda", which is all the negotiation
reads; its copies are then CPU clones through the same staging code.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardmesh.core.layout import ShardSpec
from shardmesh.engine import groups, shm_link
from shardmesh.engine.groups import HostStaging, LinkPlan, ShardGroups, SingleRank, StageLink, plan_link

TIMEOUT = timedelta(seconds=20)
GLOO_CLOSED = r"Connection (closed by peer|reset)"  # what a Gloo peer reads when the other side closed its group


def pretend_cuda(monkeypatch: pytest.MonkeyPatch, *sides: int) -> None:
    """Make the threads of `sides` (named "side0", "side1") announce "cuda"."""
    names = {f"side{s}" for s in sides}
    monkeypatch.setattr(groups, "device_type", lambda d: "cuda" if threading.current_thread().name in names else d.type)


def on_threads(store: dist.TCPStore, names: list[str], fn: Callable[[dist.Store, int], Any],
               timeout: timedelta = TIMEOUT) -> list[Any]:  # fmt: skip
    """`fn(client, i)` in one thread per name (`names[i]`), each with its own store client; results by index."""
    results: list[Any] = [None] * len(names)
    errors: list[BaseException] = []

    def main(i: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timeout)
            results[i] = fn(client, i)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=main, args=(i,), name=name, daemon=True) for i, name in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a thread never finished"
    return results


def on_both_sides(store: dist.TCPStore, fn: Callable[[dist.Store, int], Any]) -> list[Any]:
    """`fn(client, side)` in two threads named side0 and side1, each with its own store client."""
    return on_threads(store, ["side0", "side1"], fn)


def link_pair(store: dist.TCPStore, prefix: str, stagings: tuple[str, str],
              messages: list[torch.Tensor]) -> tuple[list[StageLink], list[torch.Tensor]]:  # fmt: skip
    """Form a link under `prefix`, send `messages` from side 0 to side 1; returns both links and what arrived."""

    def side_main(client: dist.Store, side: int) -> tuple[StageLink, list[torch.Tensor]]:
        pg, plan = groups.form_link(client, prefix, side, torch.device("cpu"), stagings[side], TIMEOUT,
                                    f"side {1 - side}")  # fmt: skip
        link = StageLink(pg, is_sender=side == 0, plan=plan)
        got = []
        for m in messages:
            if side == 0:
                link.send(m)
            else:
                got.append(link.recv(tuple(m.shape), m.dtype, "cpu"))
        return link, got

    (a, _), (b, got) = on_both_sides(store, side_main)
    return [a, b], got


MESSAGES = [torch.randn(5, 8), torch.randn(2, 8), torch.arange(12, dtype=torch.float16).view(3, 4)]
NBYTES = sum(m.numel() * m.element_size() for m in MESSAGES)


def assert_arrived(got: list[torch.Tensor]) -> None:
    assert len(got) == len(MESSAGES)
    for a, b in zip(got, MESSAGES, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "local,local_staging,peer,peer_staging,backend,staged",
    [
        ("cpu", "auto", "cpu", "auto", "gloo", False),
        ("cuda", "auto", "cuda", "auto", "nccl", False),
        ("cuda", "auto", "cpu", "auto", "gloo", True),  # the GPU side of a mixed link copies
        ("cpu", "auto", "cuda", "auto", "gloo", False),  # its CPU side does not
        ("cuda", "auto", "cuda", "host", "gloo", True),  # either side forcing staging takes NCCL away
        ("cuda", "host", "cuda", "auto", "gloo", True),
        ("cpu", "host", "cpu", "auto", "gloo", True),  # forced on a CPU side: copies anyway
        ("cpu", "auto", "cpu", "host", "gloo", False),
    ],
)
def test_plan_link(local: str, local_staging: str, peer: str, peer_staging: str, backend: str, staged: bool) -> None:
    plan = plan_link(local, local_staging, peer, peer_staging)
    assert (plan.backend, plan.staged) == (backend, staged)
    # Only two plain CPU sides may try shared memory (`form_link`).
    assert plan.shareable == (local == peer == "cpu" and local_staging == peer_staging == "auto")
    # The other side computes the same backend and the same shareability from the same two announcements.
    other = plan_link(peer, peer_staging, local, local_staging)
    assert (other.backend, other.shareable) == (backend, plan.shareable)


def test_an_unknown_staging_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--link-staging: 'device' is not one of auto, host"):
        plan_link("cpu", "device", "cpu", "auto")


@pytest.mark.parametrize("transport,backend", [("auto", "shm"), ("gloo", "gloo")])
def test_cpu_sides_link_without_staging_through_shared_memory_or_gloo(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch, transport: str, backend: str
) -> None:  # fmt: skip
    """Two CPU sides on one host share a ring (`shm_link`) unless $SHARDMESH_LINK_TRANSPORT says gloo."""
    monkeypatch.setenv(shm_link.TRANSPORT_ENV, transport)
    links, got = link_pair(store, "t/plain", ("auto", "auto"), MESSAGES)
    assert_arrived(got)
    for link in links:
        assert (link.backend, link.staged, link.staged_bytes) == (backend, False, 0)
        assert link.describe() == f"{backend} direct (cpu <-> cpu)"
    assert links[0].bytes_sent == links[1].bytes_received == NBYTES


def test_forced_host_staging_copies_every_message_on_both_sides(store: dist.TCPStore) -> None:
    links, got = link_pair(store, "t/host", ("host", "host"), MESSAGES)
    assert_arrived(got)
    for link in links:
        assert link.backend == "gloo" and link.staged
        assert link.staged_bytes == NBYTES  # each message once: out of the sender, into the receiver's tensor
        assert link.describe() == "gloo host-staged (cpu <-> cpu)"


def test_a_cuda_side_next_to_a_cpu_side_agrees_on_gloo_and_stages_alone(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    pretend_cuda(monkeypatch, 0)
    links, got = link_pair(store, "t/mixed", ("auto", "auto"), MESSAGES)
    assert_arrived(got)
    sender, receiver = links
    assert (sender.backend, receiver.backend) == ("gloo", "gloo")
    assert sender.staged and sender.staged_bytes == NBYTES
    assert not receiver.staged and receiver.staged_bytes == 0
    assert sender.describe() == "gloo host-staged (cuda <-> cpu)"
    assert receiver.describe() == "gloo direct (cpu <-> cuda)"


def test_a_cpu_sender_feeds_a_cuda_receiver_that_stages(store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_cuda(monkeypatch, 1)
    (sender, receiver), got = link_pair(store, "t/mixed-back", ("auto", "auto"), MESSAGES)
    assert_arrived(got)
    assert not sender.staged and receiver.staged and receiver.staged_bytes == NBYTES


def test_two_cuda_sides_agree_on_nccl_unless_one_forces_host(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Only the negotiation: an NCCL group cannot be built here."""
    pretend_cuda(monkeypatch, 0, 1)

    def negotiate(stagings: tuple[str, str], prefix: str) -> list[LinkPlan]:
        return on_both_sides(store, lambda client, side: groups.negotiate_link(
            client, prefix, side, torch.device("cpu"), stagings[side], TIMEOUT, "peer"))  # fmt: skip

    assert [p.backend for p in negotiate(("auto", "auto"), "t/nccl")] == ["nccl", "nccl"]
    forced = negotiate(("auto", "host"), "t/forced")
    assert [(p.backend, p.staged) for p in forced] == [("gloo", True), ("gloo", True)]


def test_a_peer_that_never_announces_itself_is_named(store: dist.TCPStore) -> None:
    with pytest.raises(RuntimeError, match=r"link t/alone: stage 1 tp rank 0 did not announce its device within 0.2 s "
                       r"\(--group-timeout\)"):  # fmt: skip
        groups.negotiate_link(store, "t/alone", 0, torch.device("cpu"), "auto", timedelta(seconds=0.2),
                              "stage 1 tp rank 0")  # fmt: skip


def test_staging_buffers_are_reused_and_received_tensors_are_not() -> None:
    staging = HostStaging()
    big = staging.to_host(torch.ones(4, 8))
    small = staging.to_host(torch.full((2, 8), 2.0))
    assert small.data_ptr() == big.data_ptr()  # one buffer per dtype, cut to each shape
    first = staging.from_host(small, "cpu")
    staging.to_host(torch.full((2, 8), 3.0))  # the next message overwrites the buffer ...
    assert torch.equal(first, torch.full((2, 8), 2.0))  # ... not what was handed out
    assert staging.bytes == 4 * 8 * 4 + 2 * 8 * 4 * 3 and staging.copies == 4


def test_form_groups_links_neighbouring_stages_and_describes_them(store: dist.TCPStore) -> None:
    """pp=2, tp=1 through `form_groups`: the middle of the API the worker and the offline ranks call."""

    def rank_main(client: dist.Store, rank: int) -> ShardGroups:
        spec = ShardSpec(rank * 2, rank * 2 + 2, 4, 0, 1)
        return groups.form_groups(client, "t/fg", spec, rank, 2, torch.device("cpu"), "host" if rank else "auto",
                                  TIMEOUT)  # fmt: skip

    first, second = on_both_sides(store, rank_main)
    assert isinstance(first.tp, SingleRank) and first.prev is None and second.next is None
    # A side forcing host staging keeps its link on Gloo (both sides agree); the loop (last stage to first, for
    # the tokens of several decode steps per call) never stages, token ids, and two ends on one host share memory.
    assert first.describe_links() == {
        "next_link": "gloo direct (cpu <-> cpu)",
        "loop_link": "shm direct (cpu <-> cpu)",
    }
    assert second.describe_links() == {"prev_link": "gloo host-staged (cpu <-> cpu)",
                                       "loop_link": "shm direct (cpu <-> cpu)"}  # fmt: skip
    into, back = first.loop, second.loop
    assert into is not None and back is not None
    drawn = torch.tensor([7, 11, 13])
    got = on_threads(store, ["first", "last"],
                     lambda _, i: back.send(drawn) if i else into.recv((3,), torch.int64, "cpu"))  # fmt: skip
    assert torch.equal(got[0], drawn) and (into.messages_received, back.messages_sent) == (1, 1)
    with pytest.raises(ValueError, match="--link-staging: 'gpu'"):
        groups.form_groups(store, "t/bad", ShardSpec(0, 4, 4, 0, 1), 0, 1, torch.device("cpu"), "gpu")


def test_a_closed_link_fails_its_waiting_peer_at_once_and_raises_on_use(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Side 0 closes its end of a Gloo link instead of sending: side 1's receive fails on the closed connection, not
    at the group timeout (20 s here, which the message would name), and side 0's own later use raises naming why it
    closed. (A shared-memory link's close: tests/unit/engine/test_shm_link.py.) Side 0 closes only once both sides
    have formed the link: closed while side 1 still connected, side 1's forming failed instead (a fresh clone's run
    beside a busy loop, 2026-12-01)."""
    monkeypatch.setenv(shm_link.TRANSPORT_ENV, "gloo")

    def side_main(client: dist.Store, side: int) -> str:
        pg, plan = groups.form_link(client, "t/closed", side, torch.device("cpu"), "auto", TIMEOUT, f"side {1 - side}")
        link = StageLink(pg, is_sender=side == 0, plan=plan)
        client.set(f"t/closed/formed{side}", "1")
        client.wait([f"t/closed/formed{1 - side}"])  # both formed: the close is the only thing side 1 meets
        if side == 0:
            link.close("its epoch broke")
            with pytest.raises(RuntimeError, match="the process group was closed: its epoch broke"):
                link.send(torch.ones(3))
            return ""
        with pytest.raises(RuntimeError) as e:
            link.recv((3,), torch.float32, "cpu")
        return str(e.value)

    # The peer's socket closed: Gloo reads it as "Connection closed by peer" or, when the close raced unread bytes,
    # "Connection reset"; either way not the group timeout.
    assert re.search(GLOO_CLOSED, on_both_sides(store, side_main)[1])
