"""The KV blocks of a paged mesh: which block ids each sequence holds, and an index of cached prompt prefixes.

Every shard's KV cache is a pool of `num_blocks` blocks of `block_size` tokens, the same ids on every stage
(each for its own layers), so one allocator for the whole mesh lives here, in the gateway that already owns
every sequence's token log. A sequence's block table lists its blocks in position order: block i holds
positions [i * block_size, (i + 1) * block_size). The tables travel with every step (`StepEntry.blocks`).

Admission reserves: a sequence is admitted only when the blocks it may still need — its prompt plus
`max_new_tokens`, less what it finds cached — are free or evictable, and the reservation holds them for it.
Blocks are taken from the pool as the sequence grows, so memory written stays close to memory taken, but a
running sequence never finds the pool empty, and no preemption is needed. Why not admit optimistically and
preempt by recomputation (vLLM's way): reservation never throws work away and keeps a request's latency
independent of later arrivals; what it gives up is the blocks reserved for tokens a sequence never writes
when it stops early (TGI makes the same choice). Requests that leave `max_new_tokens` unset get the
gateway's default, not the whole context.

Prefix caching (as vLLM's automatic prefix caching and SGLang's RadixAttention do): every full block whose
tokens and KV are known is indexed by a digest of its tokens chained with the digest of the block before it,
so a digest names a whole prefix, not just a block's content. A new sequence reuses the longest chain of
indexed blocks that its prompt begins with (never the prompt's last token: its logits are still needed), and
only the rest is prefilled. Blocks are reference counted; a cached block no sequence holds stays indexed on a
least-recently-used list and is evicted (forgotten, reused) only when the free list is empty. A block is
indexed only once the step that wrote it has completed on every stage (`commit`), so a sequence that reads
it runs after the writes on each stage.

Pure bookkeeping, no I/O and no locks (the scheduler's lock guards it). When the mesh moves to other workers
(a shard reloads, a spare replaces a lost worker) the index is forgotten (`forget_index`): what the new workers
hold is what running sequences replay into their own blocks, nothing else. Tables survive it, so a sequence
keeps its blocks through a fail-over.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardmesh.core.step import blocks_for

ROOT = b""  # the digest before the first block


def block_digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of a prefix: the prefix before this block (its digest) and this block's tokens.

    SHA-256, not Python's `hash`: a collision would serve one prompt's KV to another (vLLM moved to SHA-256
    for prefix hashes for this reason), and 32 bytes per cached block cost nothing."""
    return hashlib.sha256(previous + array("q", tokens).tobytes()).digest()


@dataclass
class BlockTable:
    """One sequence's blocks: `blocks[i]` holds positions [i * block_size, (i + 1) * block_size)."""

    blocks: list[int] = field(default_factory=list)
    reserved: int = 0  # blocks the pool still holds for this sequence beyond `blocks`
    cached_tokens: int = 0  # leading positions found in the prefix index at admission (not prefilled)
    digests: list[bytes] = field(default_factory=list)  # digest of each leading block that is indexed or committed


@dataclass
class PrefixCounters:
    """Since the gateway started (carried from one pool to the next): what prefix lookups found."""

    lookups: int = 0  # admissions that looked up a prefix
    hits: int = 0  # of which found at least one block
    tokens_looked_up: int = 0  # prompt tokens of those lookups
    tokens_saved: int = 0  # of which found cached (not prefilled)


@dataclass
class PoolStats:
    total: int
    block_size: int
    used: int  # held by at least one sequence
    cached: int  # held by none, kept in the prefix index until evicted
    free: int  # held by none, in no index
    reserved: int  # promised to running sequences, not taken yet
    prefix: PrefixCounters


class BlockPool:
    """The mesh's KV blocks. Not thread-safe: the scheduler's lock guards it."""

    def __init__(self, num_blocks: int, block_size: int, counters: PrefixCounters | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.counters = counters or PrefixCounters()
        self.reset()

    def reset(self) -> None:
        """Nothing held, nothing indexed: the KV behind every block id is gone (a new mesh)."""
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # a stack: the lowest id goes first
        self._refs = [0] * self.num_blocks
        self._index: dict[bytes, int] = {}  # prefix digest -> block
        self._digest: dict[int, bytes] = {}  # block -> its digest, for indexed blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed blocks nobody holds, oldest use first
        self._reserved = 0

    # -- admission ------------------------------------------------------------------------------------------

    def available(self) -> int:
        """Blocks a new sequence could still be promised: free or evictable, less those promised already."""
        return len(self._free) + len(self._evictable) - self._reserved

    def admit(self, prompt: Sequence[int], max_tokens: int, lookup: bool = True) -> BlockTable | None:
        """A table for a sequence that may grow to `max_tokens` positions (prompt included), holding the longest
        cached prefix of `prompt` (none without `lookup`), with the rest of its blocks reserved; None when the
        pool cannot promise them (nothing is taken then)."""
        if max_tokens < len(prompt):
            raise ValueError(f"max_tokens ({max_tokens}) is below the prompt's length ({len(prompt)})")
        hit, digests = self._match(prompt) if lookup else ([], [])
        need = blocks_for(max_tokens, self.block_size) - len(hit)
        # Blocks of the hit that sit on the evictable list stop being available once this sequence holds them.
        held_evictable = sum(1 for b in hit if self._refs[b] == 0)
        if need > self.available() - held_evictable:
            return None
        for b in hit:
            self._hold(b)
        self._reserved += need
        if lookup:
            c = self.counters
            c.lookups += 1
            c.hits += bool(hit)
            c.tokens_looked_up += len(prompt)
            c.tokens_saved += len(hit) * self.block_size
        return BlockTable(list(hit), need, len(hit) * self.block_size, digests)

    def _match(self, prompt: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The indexed blocks `prompt` begins with, leaving at least its last token to compute."""
        bs = self.block_size
        hit: list[int] = []
        digests: list[bytes] = []
        digest = ROOT
        for i in range((len(prompt) - 1) // bs):
            digest = block_digest(digest, prompt[i * bs : (i + 1) * bs])
            block = self._index.get(digest)
            if block is None:
                break
            hit.append(block)
            digests.append(digest)
        return hit, digests

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    # -- growth ---------------------------------------------------------------------------------------------

    def grow(self, table: BlockTable, tokens: int) -> None:
        """Give `table` blocks until it holds `tokens` positions, from its reservation."""
        need = blocks_for(tokens, self.block_size) - len(table.blocks)
        if need > table.reserved:
            raise ValueError(f"{tokens} positions need {need} more blocks, {table.reserved} are reserved")
        for _ in range(need):
            table.blocks.append(self._take())
        table.reserved -= max(need, 0)
        self._reserved -= max(need, 0)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # the least recently used cached block: its prefix is forgotten
            block, _ = self._evictable.popitem(last=False)
            del self._index[self._digest.pop(block)]
        self._refs[block] = 1
        return block

    # -- prefix index ---------------------------------------------------------------------------------------

    def commit(self, table: BlockTable, tokens: Sequence[int], computed: int) -> None:
        """Index the full blocks of `table` whose KV every stage has written: the sequence's first `computed`
        positions, whose tokens are `tokens[:computed]`. Call once the step that wrote them has completed."""
        bs = self.block_size
        full = min(computed, len(tokens)) // bs
        digest = table.digests[-1] if table.digests else ROOT
        for i in range(len(table.digests), min(full, len(table.blocks))):
            digest = block_digest(digest, tokens[i * bs : (i + 1) * bs])
            table.digests.append(digest)
            block = table.blocks[i]
            if digest not in self._index and block not in self._digest:
                self._index[digest] = block
                self._digest[block] = digest
            # Otherwise another sequence indexed the same prefix first: this block stays private and is freed
            # at release, and later sequences share the indexed one.

    # -- release --------------------------------------------------------------------------------------------

    def release(self, table: BlockTable) -> None:
        """The sequence ended: its blocks are dropped (kept in the index when indexed) and its reservation
        returned. The table is empty afterwards, so a second release does nothing."""
        for block in reversed(table.blocks):  # later blocks are the least useful prefixes: evicted first
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        self._reserved -= table.reserved
        table.blocks, table.reserved, table.digests = [], 0, []

    def shares(self, table: BlockTable) -> bool:
        """Whether another table holds one of this table's blocks too (a prefix they share)."""
        return any(self._refs[b] > 1 for b in table.blocks)

    def forget_index(self) -> None:
        """The KV behind the blocks is no longer what the index says (the mesh moved to other workers, which
        rebuild it by replay): no prefix is found any more, and cached blocks nobody holds are free. Blocks held
        by sequences stay theirs; they replay their logs into them."""
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._index.clear()
        self._digest.clear()

    # -- observation ----------------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        used = sum(1 for r in self._refs if r > 0)
        return PoolStats(self.num_blocks, self.block_size, used, len(self._evictable), len(self._free), self._reserved,
                         PrefixCounters(**vars(self.counters)))  # fmt: skip
