"""Which stages a resuming sequence replays on, from the cache ids the topology publishes (gateway/retention.py)."""

from __future__ import annotations

from dataclasses import replace

from gateway.fanout import MeshView
from gateway.retention import StageRange, lost_stages
from tests.unit.gateway.fakes import FakeMesh


def with_shard(view: MeshView, i: int, **changes: str) -> MeshView:
    shards = list(view.shards)
    shards[i] = replace(shards[i], **changes)
    return replace(view, shards=tuple(shards))


def test_a_cache_id_counts_on_whichever_worker_holds_it() -> None:
    mesh = FakeMesh(pp=3, tp=1)
    mesh.cache_ids = ["a", "b", "c"]
    old = mesh.view()
    # A slot handed over with its cache (ShardAssignment.kv_from): another worker, the same id. Nothing is lost.
    assert lost_stages(old, with_shard(old, 1, worker_id="spare", address="127.0.0.1:9")) is None
    # The same worker with a new cache (restarted, or calibrated over kept slots) lost it.
    assert lost_stages(old, with_shard(old, 1, kv_cache_id="b2")) == StageRange(1, 2)
    assert lost_stages(old, with_shard(with_shard(old, 0, kv_cache_id=""), 2, kv_cache_id="c2")) == StageRange(0, 3)
    unknown = with_shard(old, 2, kv_cache_id="")
    assert lost_stages(unknown, unknown) == StageRange(2, 3)  # an id never reported proves nothing
    assert lost_stages(old, replace(old, kv_slots=old.kv_slots + 1)) == StageRange(0, 3)  # another layout
