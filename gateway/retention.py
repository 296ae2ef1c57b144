"""Which stages of a new mesh still hold a resuming sequence's KV cache, and so what its replay must cover.

A worker keeps its KV cache across rendezvous epochs while its shard is unchanged, and publishes the cache's
id in the topology (`ShardAssignment.kv_cache_id`; a new id whenever the contents are not the old ones). A slot
handed over from a serving worker takes the cache with it (`ShardAssignment.kv_from`): the new holder receives
the contents and adopts the id. So a stage whose every tensor-parallel shard shows the same id in the new mesh as
in the mesh the sequence ran on, on whichever worker, still holds the sequence's keys and values, in the same
slot, up to what was cached. The
other stages lost them: the sequence replays its cached positions on the smallest range of stages covering
them (`BatchEntry.first_stage`, `end_stage`); the stage before that range resends what it recorded (its
activation log), and the stages after it skip the replay. No stage lost: nothing is replayed at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.fanout import MeshView


@dataclass(frozen=True)
class StageRange:
    """Stages [first, end) of a pipeline of `pp`."""

    first: int
    end: int

    def union(self, other: StageRange | None) -> StageRange:
        return self if other is None else StageRange(min(self.first, other.first), max(self.end, other.end))

    def entry_fields(self, pp: int) -> tuple[int, int]:
        """(first_stage, end_stage) as a BatchEntry says it: (0, 0) for every stage, end 0 through the last."""
        if self.first == 0 and self.end == pp:
            return 0, 0
        return self.first, 0 if self.end == pp else self.end


def same_layout(old: MeshView, new: MeshView) -> bool:
    """Whether `new` cuts the model into the same shards, with the same slots: a cache can only carry over then."""
    return (old.pp, old.tp, old.kv_slots, old.max_context) == (new.pp, new.tp, new.kv_slots, new.max_context) and [
        s.layers for s in old.shards
    ] == [s.layers for s in new.shards]


def lost_stages(old: MeshView, new: MeshView) -> StageRange | None:
    """The range of stages of `new` that must replay what a sequence had cached on `old` (every stage when the
    layout changed); None when every stage kept it."""
    if not same_layout(old, new):
        return StageRange(0, new.pp)
    lost = {
        b.stage
        for a, b in zip(old.shards, new.shards, strict=True)
        if not a.kv_cache_id or a.kv_cache_id != b.kv_cache_id
    }
    return StageRange(min(lost), max(lost) + 1) if lost else None
