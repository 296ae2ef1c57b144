"""The topology as versioned data: its protobuf round trip, the wire enums it refuses, the limits it carries, and
the store that hands the newest version to waiting watchers."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace

import pytest

from coordinator import placement
from coordinator.placement import WorkerView
from shardmesh.core.topology import ModelSpec, ServingLimits, ShardState, Topology, TopologyStore
from shardmesh.proto.v1 import common_pb2, coordinator_pb2

MODEL = ModelSpec("/models/tiny", "float32", "LlamaForCausalLM", 4, 32, 100, 128)
LIMITS = ServingLimits(kv_slots=4, max_context=128, max_batch_tokens=128)
PENDING, LOADING, READY, UNHEALTHY = ShardState.PENDING, ShardState.LOADING, ShardState.READY, ShardState.UNHEALTHY


def view(worker_id: str, reported: ShardState = READY, applied: int = 0, timed_out: bool = False, inc: int = 1):
    return WorkerView(worker_id, f"10.0.0.1:{5000 + len(worker_id)}", inc, reported, applied, timed_out)


def _build(slots: placement.Slots, workers: dict[str, WorkerView], epoch: int | None, version: int = 7) -> Topology:
    return placement.build_topology(version=version, model=MODEL, pp=2, tp=2, limits=LIMITS, store_host="127.0.0.1",
                                    store_port=29500, slots=slots, workers=workers, epoch=epoch)  # fmt: skip


def test_topology_round_trips_through_protobuf() -> None:
    workers = {w: view(w, READY, applied=7) for w in "abcd"}
    for topo in (_build(("a", "b", "c", "d"), workers, epoch=7), _build(("a", None, "c", "d"), workers, None)):
        pb = topo.to_pb()
        assert Topology.from_pb(coordinator_pb2.Topology.FromString(pb.SerializeToString())) == topo
        assert pb.HasField("rendezvous") == (topo.rendezvous is not None)
    assert topo.to_pb().model.dtype == common_pb2.DTYPE_FLOAT32
    assert topo.to_pb().stages[1].shards[0].state == common_pb2.SHARD_STATE_PENDING


def test_shard_state_from_pb_rejects_unspecified() -> None:
    assert ShardState.from_pb(common_pb2.SHARD_STATE_READY) is READY
    with pytest.raises(ValueError, match="UNSPECIFIED"):
        ShardState.from_pb(common_pb2.SHARD_STATE_UNSPECIFIED)
    with pytest.raises(ValueError):
        ShardState.from_pb(99)


def test_store_wakes_watchers_on_publish_and_close() -> None:
    first = _build((None,) * 4, {}, None, version=1)
    store = TopologyStore(first)
    assert store.wait_newer(0, timeout=0) == first
    assert store.wait_newer(1, timeout=0.01) is None
    assert store.wait_newer(42, timeout=0) == first  # from an earlier coordinator: start over
    got: list[Topology | None] = []
    waiter = threading.Thread(target=lambda: got.append(store.wait_newer(1, timeout=5)))
    waiter.start()
    time.sleep(0.05)
    second = _build((None,) * 4, {}, None, version=2)
    store.publish(second)
    waiter.join(timeout=5)
    assert got == [second]
    with pytest.raises(ValueError, match="not newer"):
        store.publish(first)
    waiter = threading.Thread(target=lambda: got.append(store.wait_newer(2, timeout=5)))
    waiter.start()
    store.close()
    waiter.join(timeout=5)
    assert got[-1] is None and store.closed


def test_serving_limits_refuse_what_no_shard_can_allocate() -> None:
    assert ServingLimits.from_pb(LIMITS.to_pb()) == LIMITS
    for field in ("kv_slots", "max_context", "max_batch_tokens"):
        with pytest.raises(ValueError, match=f"^{field} must be >= 1, got 0$"):
            ServingLimits(**{"kv_slots": 4, "max_context": 128, "max_batch_tokens": 128, field: 0})


def test_paged_serving_limits_need_blocks_that_hold_one_whole_sequence() -> None:
    paged = ServingLimits(kv_slots=4, max_context=128, max_batch_tokens=128, kv_block_size=16, kv_blocks=8)
    assert paged.paged and not LIMITS.paged and ServingLimits.from_pb(paged.to_pb()) == paged
    cases = {
        "kv_block_size must be >= 0 (0: slots), got -1": {"kv_block_size": -1},
        "kv_blocks must be 0 with the slot cache (kv_block_size 0), got 8": {"kv_block_size": 0},
        "kv_blocks must be >= 1 with kv_block_size 16, got 0": {"kv_blocks": 0},
        "kv_blocks: 7 blocks × 16 tokens = 112 tokens, fewer than one sequence of max_context 128 needs (8 blocks)":
            {"kv_blocks": 7},
    }  # fmt: skip
    for message, change in cases.items():
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            replace(paged, **change)
    assert replace(paged, max_context=100, kv_blocks=7).kv_blocks == 7  # 112 tokens hold 100
