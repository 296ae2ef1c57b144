"""The KV slot pool: built for one mesh, lowest slot first, and only that mesh's slots come back."""

from __future__ import annotations

from gateway.fanout import MeshView
from gateway.slots import SlotPool


def view(placement: str = "epoch-1", kv_slots: int = 3) -> MeshView:
    return MeshView(1, (placement,), 1, 1, kv_slots, 64, 64, 259, ())


def test_slots_are_taken_lowest_first_and_come_back_sorted() -> None:
    pool, mesh = SlotPool(), view()
    assert not pool.serves(mesh) and pool.free_count(mesh, leaving=1) == 3  # not adopted: all will be free
    assert pool.free_count(None, leaving=1) == 0
    pool.adopt(mesh)
    assert pool.serves(mesh) and [pool.take(), pool.take()] == [0, 1]
    assert pool.free_count(mesh, leaving=1) == 2  # slot 2, and one a cancelled request frees at the boundary
    pool.put_back(1)
    assert pool.take() == 1
    pool.release([(mesh, 1), (mesh, 0), (mesh, 0)])
    assert [pool.take(), pool.take(), pool.take()] == [0, 1, 2] and not pool


def test_a_release_from_another_mesh_frees_nothing_here() -> None:
    old, new = view("epoch-1"), view("epoch-2")
    pool = SlotPool()
    pool.adopt(new)
    taken = pool.take()
    pool.release([(old, 2), (view("epoch-2", kv_slots=4), 1)])  # other placement; same placement, other size
    assert pool.free_count(new, leaving=0) == 2 and taken == 0
    pool.clear()
    assert not pool.serves(new) and pool.free_count(new, leaving=0) == 3
