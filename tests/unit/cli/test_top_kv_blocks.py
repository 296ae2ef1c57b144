"""`shardmesh top` on a paged mesh: the gateway's KV blocks and prefix-cache counters, read from its real metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from gateway.blocks import BlockPool
from gateway.observe import GatewayMetrics
from shardmesh_cli.top import Metrics, _kv_block_lines


def _scrape(metrics: GatewayMetrics) -> Metrics:
    return Metrics.parse(generate_latest(metrics.registry).decode())


def test_top_shows_blocks_and_prefix_hits_of_a_paged_mesh() -> None:
    pool = BlockPool(10, 4)
    first = pool.admit(list(range(9)), 12)  # 3 blocks reserved, no hit
    assert first is not None
    pool.grow(first, 9)
    pool.commit(first, list(range(9)), 9)
    pool.release(first)  # 2 cached, 8 free
    second = pool.admit([*range(8), 42], 9)  # hits both cached blocks: 8 of its 9 tokens
    assert second is not None
    line = _kv_block_lines(_scrape(GatewayMetrics(lambda: (0, 1, 3, True), None, pool.stats)))
    assert line == ["  KV blocks per shard 10 × 4 tokens: used 2, cached 0, free 8 (reserved 1)   prefix hits 50% "
                    "of 2 prompts, tokens saved 8 (44% of prompt tokens)"]  # fmt: skip


def test_top_shows_nothing_of_blocks_on_a_mesh_of_slots() -> None:
    assert _kv_block_lines(_scrape(GatewayMetrics(lambda: (0, 1, 3, True), None, lambda: None))) == []
