"""The mesh's KV block allocator and prefix index (gateway/blocks.py): pure bookkeeping, checked directly."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.blocks import BlockPool, BlockTable
from shardmesh.core.step import blocks_for

BS = 4


def run(pool: BlockPool, prompt: list[int], max_tokens: int) -> BlockTable:
    """Admit, prefill the prompt and commit it, as the scheduler does once the prefill step completed."""
    table = pool.admit(prompt, max_tokens)
    assert table is not None
    pool.grow(table, len(prompt))
    pool.commit(table, prompt, len(prompt))
    return table


def test_admission_reserves_what_the_sequence_may_need() -> None:
    pool = BlockPool(10, BS)
    a = pool.admit(list(range(5)), 12)  # 3 blocks
    assert a is not None and a.blocks == [] and a.reserved == 3
    assert pool.available() == 7
    assert pool.admit(list(range(5)), 32) is None  # 8 blocks: refused, nothing taken
    assert pool.available() == 7
    b = pool.admit([9] * 20, 28)  # 7 blocks: exactly what is left
    assert b is not None and pool.available() == 0
    pool.grow(a, 5)
    assert a.blocks == [0, 1] and a.reserved == 1
    with pytest.raises(ValueError, match="need 2 more blocks, 1 are reserved"):
        pool.grow(a, 13)
    pool.release(a)
    assert pool.available() == 3 and pool.stats().used == 0


def test_a_shared_prefix_is_found_and_only_whole_blocks_before_the_last_token() -> None:
    pool = BlockPool(32, BS)
    system = list(range(100, 110))  # 2 full blocks and 2 tokens
    first = run(pool, [*system, 1, 2, 3], 16)
    second = pool.admit([*system, 7, 8], 16)
    assert second is not None
    assert second.blocks == first.blocks[:2] and second.cached_tokens == 8
    # The whole prompt cached: its last token is still computed, so the last full block is not reused.
    exact = pool.admit(system[:8], 12)
    assert exact is not None and exact.blocks == first.blocks[:1] and exact.cached_tokens == 4
    # Same tokens at another position of the chain are another prefix.
    shifted = pool.admit([0] * 4 + system, 20)
    assert shifted is not None and shifted.blocks == []
    # A block's tokens after another first block: another prefix too, although that first block is cached.
    other = run(pool, [5] * 4 + [9], 8)
    assert other.blocks != first.blocks[:1]
    mixed = pool.admit([5] * 4 + system[4:8] + [1], 12)
    assert mixed is not None and mixed.blocks == other.blocks[:1]
    stats = pool.stats()
    assert (stats.prefix.lookups, stats.prefix.hits, stats.prefix.tokens_saved) == (6, 3, 16)


def test_released_cached_blocks_stay_until_evicted_least_recently_used_first() -> None:
    pool = BlockPool(4, BS)
    a = run(pool, list(range(9)), 9)  # 3 blocks, 2 of them full and indexed
    pool.release(a)
    assert pool.stats().cached == 2 and pool.stats().free == 2
    hit = pool.admit(list(range(9)), 9)
    assert hit is not None and hit.cached_tokens == 8
    pool.release(hit)
    # A newcomer needing all 4 blocks evicts the cached ones, the later prefix block first.
    big = pool.admit([50] * 16, 16)
    assert big is not None
    pool.grow(big, 12)
    assert pool.stats().cached == 1  # 2 free blocks, then the second cached block went
    assert pool.admit(list(range(9)), 9) is None  # the pool is promised to `big`
    pool.grow(big, 16)
    pool.release(big)
    again = pool.admit(list(range(9)), 9)
    assert again is not None and again.cached_tokens == 0  # both prefix blocks were evicted


def test_a_cached_block_held_by_the_newcomer_does_not_count_as_available() -> None:
    pool = BlockPool(3, BS)
    a = run(pool, [*range(8), 1], 9)
    pool.release(a)  # blocks 0, 1 cached, 2 free
    # A hit on both cached blocks needs 1 more block: 3 available (2 evictable + 1 free), less the 2 it holds.
    b = pool.admit([*range(8), 5], 9)
    assert b is not None and b.reserved == 1
    assert pool.available() == 0
    assert pool.admit([3], 1) is None


def test_the_same_prefix_computed_twice_is_indexed_once() -> None:
    pool = BlockPool(8, BS)
    prompt = list(range(5))
    a, b = pool.admit(prompt, 5), pool.admit(prompt, 5)  # both admitted before either finished prefill
    assert a is not None and b is not None
    for t in (a, b):
        pool.grow(t, 5)
    pool.commit(a, prompt, 5)
    pool.commit(b, prompt, 5)
    pool.release(a)
    pool.release(b)
    s = pool.stats()
    assert (s.cached, s.free) == (1, 7)


def test_commit_indexes_generated_blocks_too_for_the_next_turn() -> None:
    pool = BlockPool(8, BS)
    log = list(range(6))
    t = pool.admit(log, 12)
    assert t is not None
    pool.grow(t, 6)
    pool.commit(t, log, 6)  # 1 full block
    log += [40, 41, 42]  # decoded: positions 6..8; the last token's KV is not computed yet
    pool.grow(t, 9)
    pool.commit(t, log, 8)
    assert len(t.digests) == 2
    pool.release(t)
    nxt = pool.admit([*log, 7, 7], 16)
    assert nxt is not None and nxt.cached_tokens == 8


def test_reset_forgets_everything_but_the_counters() -> None:
    pool = BlockPool(4, BS)
    run(pool, list(range(9)), 9)
    run(pool, list(range(9)), 12)
    pool.reset()
    s = pool.stats()
    assert (s.used, s.cached, s.free, s.reserved) == (0, 0, 4, 0)
    assert (s.prefix.lookups, s.prefix.hits) == (2, 1)
    assert pool.admit(list(range(9)), 9).cached_tokens == 0  # type: ignore[union-attr]


def test_bad_arguments_name_the_numbers() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        BlockPool(4, 0)
    with pytest.raises(ValueError, match=r"max_tokens \(3\) is below the prompt's length \(5\)"):
        BlockPool(4, 4).admit([1] * 5, 3)


class PoolMachine(RuleBasedStateMachine):
    """Random admissions, growth, commits and releases over a small vocabulary (so prefixes repeat): every
    block is held, cached or free, exactly once; references equal the tables holding a block; a reused prefix
    block was committed for exactly those tokens; growth within a reservation never fails."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, BS)
        self.live: list[tuple[BlockTable, list[int], int]] = []  # table, token log, positions computed
        self.written: dict[int, tuple[int, ...]] = {}  # block -> the prefix its KV was computed for

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=14), extra=st.integers(0, 10))
    def admit(self, prompt: list[int], extra: int) -> None:
        table = self.pool.admit(prompt, len(prompt) + extra)
        if table is None:
            return
        for i, block in enumerate(table.blocks):  # a reused block holds the KV of this very prefix
            assert self.written[block] == tuple(prompt[: (i + 1) * BS])
        self.live.append((table, list(prompt), table.cached_tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Compute some positions of a live sequence (prefill or decode), then commit them."""
        i = data.draw(st.integers(0, len(self.live) - 1))
        table, log, computed = self.live[i]
        limit = (len(table.blocks) + table.reserved) * BS
        if computed >= len(log):  # decode: a new token joins the log, if the reservation allows
            if len(log) >= limit:
                return
            log.append(data.draw(st.integers(0, 1)))
        upto = data.draw(st.integers(computed + 1, len(log)))
        self.pool.grow(table, upto)
        for p in range(computed, upto):
            self.written[table.blocks[p // BS]] = tuple(log[: (p // BS + 1) * BS]) if p % BS == BS - 1 else ()
        self.pool.commit(table, log, upto)
        self.live[i] = (table, log, upto)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        table, _, _ = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.pool.release(table)

    @invariant()
    def accounting(self) -> None:
        held: dict[int, int] = {}
        for table, _, _ in self.live:
            for block in table.blocks:
                held[block] = held.get(block, 0) + 1
        s = self.pool.stats()
        assert s.used == len(held)
        assert s.used + s.cached + s.free == s.total
        assert s.reserved == sum(t.reserved for t, _, _ in self.live)
        assert self.pool.available() >= 0
        for table, log, _ in self.live:
            assert len(table.blocks) == len(set(table.blocks))
            assert len(table.blocks) <= blocks_for(len(log), BS)  # blocks are taken as the sequence grows


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_forget_index_keeps_what_sequences_hold() -> None:
    pool = BlockPool(6, BS)
    done = run(pool, list(range(9)), 9)
    pool.release(done)  # 2 cached blocks
    live = run(pool, [7] * 9, 12)  # 3 blocks held, 2 of them indexed
    pool.forget_index()
    s = pool.stats()
    assert (s.used, s.cached, s.free) == (3, 0, 3)
    assert pool.admit([7] * 9, 9).cached_tokens == 0  # type: ignore[union-attr]
    pool.grow(live, 12)
    pool.release(live)  # no longer indexed: its blocks are free, not cached
    assert pool.stats().cached == 0
