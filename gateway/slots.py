"""The KV slot pool: which of the workers' KV slots are free for a new request.

The gateway owns the slots: a request gets one at admission and keeps the same slot on every shard until
it is released there. The pool is built for one mesh (its placement and `kv_slots`); a request released
from an older mesh gives nothing back to it. Not thread-safe: the scheduler's lock guards it.
"""

from __future__ import annotations

from typing import Any

from gateway.fanout import MeshView


def _pool_key(view: MeshView) -> tuple[Any, int]:
    return view.placement, view.kv_slots, view.kv_blocks, view.kv_block_size


class SlotPool:
    def __init__(self) -> None:
        self._free: list[int] = []
        self._built_for: tuple[Any, int] | None = None  # (placement, kv_slots) the free list was built for

    def serves(self, view: MeshView) -> bool:
        """Whether the pool was built for this mesh's slots."""
        return self._built_for == _pool_key(view)

    def adopt(self, view: MeshView) -> None:
        """Every slot of `view` free (nothing holds one there yet)."""
        self._free = list(range(view.kv_slots))
        self._built_for = _pool_key(view)

    def clear(self) -> None:
        """No pool at all: rebuilt from `kv_slots` at the next adoption."""
        self._free, self._built_for = [], None

    def free_count(self, view: MeshView | None, leaving: int) -> int:
        """Slots free on `view` at the next step boundary: those free now plus the `leaving` ones running
        requests give back there; all of them on a mesh not adopted yet (they will be free then)."""
        if view is None:
            return 0
        if not self.serves(view):
            return view.kv_slots
        return len(self._free) + leaving

    def __bool__(self) -> bool:
        return bool(self._free)

    def take(self, wanted: int | None = None) -> int:
        """`wanted` when it is free (a resuming sequence whose cache some workers kept there), else the lowest."""
        if wanted is not None and wanted in self._free:
            self._free.remove(wanted)
            return wanted
        return self._free.pop(0)

    def put_back(self, slot: int) -> None:
        """Undo `take`: the slot goes first again."""
        self._free.insert(0, slot)

    def release(self, released: list[tuple[MeshView, int]]) -> None:
        """Free the slots these (mesh, slot) pairs held, those on the mesh the pool serves."""
        for view, slot in released:
            if self._built_for == _pool_key(view) and slot not in self._free:
                self._free.append(slot)
        self._free.sort()
