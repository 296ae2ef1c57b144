"""What one step of the mesh is made of, as plain values: the sequences it advances and how each samples.

A step packs several sequences' new tokens back to back; each sequence's share is a `Segment`. A stage
worker receives them as `StepEntry`s (one per sequence, with its tokens and `SamplingParams`) and the
last stage answers with one `Sampled` token per entry that asked for one. The tensors these describe
live in `shardmesh.engine` (`batch.BatchLayout`, `sampling.sample`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Rows the compiled CPU forward (`shardmesh.engine.cpu_decode`) takes through the layers at a time: a longer step goes
# a chunk of rows at a time, so that its float32 scratch is that of this many rows (the planner counts it,
# `shardmesh.planning.memory`).
CPU_ROW_CHUNK = 1024


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks of `block_size` that hold positions [0, positions): block i holds [i * block_size, (i + 1) *
    block_size)."""
    return -(-positions // block_size)


def written_blocks(blocks: tuple[int, ...], start: int, length: int, block_size: int) -> tuple[int, ...]:
    """The blocks of a block table that positions [start, start + length) are written into."""
    return blocks[start // block_size : blocks_for(start + length, block_size)]


def check_block_table(blocks: tuple[int, ...], start: int, length: int, block_size: int, num_blocks: int | None,
                      name: str) -> None:  # fmt: skip
    """Raise a ValueError naming `name` unless `blocks` cover positions [0, start + length) in blocks of
    `block_size` (block i holds positions [i * block_size, (i + 1) * block_size)), each id below `num_blocks`
    (None: not checked here). More blocks than needed are allowed (a block allocated ahead); they are not read."""
    end = start + length
    needed = blocks_for(end, block_size)
    if len(blocks) < needed:
        raise ValueError(f"{name}: positions [0, {end}) need {needed} blocks of {block_size} tokens, the block "
                         f"table has {len(blocks)}")  # fmt: skip
    if num_blocks is not None and blocks and max(blocks[:needed]) >= num_blocks:
        bad = next(b for b in blocks[:needed] if b >= num_blocks)
        raise ValueError(f"{name}: block id {bad} is out of range: the KV cache has {num_blocks} blocks")


def _check_block_ids(blocks: tuple[int, ...], name: str) -> None:
    """What a block table must be whatever the cache: ids >= 0, none twice (two positions in one cell)."""
    if blocks and min(blocks) < 0:
        raise ValueError(f"{name}: block ids must be >= 0, got {min(blocks)}")
    if len(set(blocks)) != len(blocks):
        twice = next(b for i, b in enumerate(blocks) if b in blocks[:i])
        raise ValueError(f"{name}: block id {twice} appears twice in the block table")


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: `length` new tokens at positions [start, start + length).

    `slot` addresses a slot KV cache (`engine.kv_cache.KVCache`); `blocks` a paged one (`PagedKVCache`): the
    sequence's block table, covering positions [0, start + length). Positions before `start` may be in blocks
    another sequence wrote (a shared prefix): they are read, never written; only [start, start + length) is."""

    slot: int
    start: int
    length: int
    blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 0:
            raise ValueError(f"{self.name}: start and length must be >= 0")
        _check_block_ids(self.blocks, self.name)

    @property
    def name(self) -> str:
        return f"segment (slot {self.slot}, positions [{self.start}, {self.start + self.length}))"

    def check_blocks(self, block_size: int, num_blocks: int | None = None) -> None:
        check_block_table(self.blocks, self.start, self.length, block_size, num_blocks, self.name)


def penalized(repetition_penalty: float, frequency_penalty: float, presence_penalty: float) -> bool:
    """Whether these penalties make a draw depend on the sequence's token history (the worker's `SamplingParams`
    and the gateway's `Sampling` both ask)."""
    return repetition_penalty != 1 or frequency_penalty != 0 or presence_penalty != 0


MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's and vLLM's bound)
MAX_DECODE_STEPS = 64  # decode steps in one Step call: tokens a client waits for at once, and a bound on waste
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for frequency_penalty and presence_penalty


@dataclass(frozen=True)
class SamplingParams:
    """How a request draws its tokens; the draw at each position depends on `seed` and that position only
    (`engine.sampling.draw_seed`), and on the sequence's tokens before it when a penalty is set
    (`engine.penalties`). Order: penalties, then temperature, top-k, top-p, min-p (transformers' order)."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 means no limit
    seed: int | None = None
    repetition_penalty: float = 1.0  # transformers': over the prompt and the generated tokens; 1 means none
    frequency_penalty: float = 0.0  # OpenAI's: logit -= frequency_penalty * count, generated tokens only
    presence_penalty: float = 0.0  # OpenAI's: logit -= presence_penalty * (count > 0), generated tokens only
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one; 0 means none
    top_logprobs: int = 0  # also return this many most likely tokens (raw distribution) at each position
    prompt_len: int = 0  # positions before it are the prompt (frequency and presence penalties skip them)

    def __post_init__(self) -> None:
        # `not x >= 0` rather than `x < 0` so NaN is refused too.
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {value}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty is set: the draw then depends on the sequence's token history."""
        return penalized(self.repetition_penalty, self.frequency_penalty, self.presence_penalty)


@dataclass(frozen=True)
class StepEntry:
    """One sequence's part of a step: `num_tokens` tokens from position `start_pos`, cached in KV slot `slot`;
    `skip_sampling` when its last token gets no next token (a prompt chunk that is not the prompt's end).
    `token_ids` are what the first stage embeds and what the last stage records for the penalties, so an
    entry with a penalty must carry them; other entries may leave them out on the stages after the first."""

    request_id: str
    slot: int
    start_pos: int
    num_tokens: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    skip_sampling: bool = False
    first_stage: int = 0  # a replay on stages [first_stage, end_stage) only (0, 0: every stage); see worker.proto
    end_stage: int = 0  # 0: through the last stage
    blocks: tuple[int, ...] = ()  # the block table of a paged KV cache, covering [0, start_pos + num_tokens)

    def __post_init__(self) -> None:
        if self.sampling.penalized and len(self.token_ids) != self.num_tokens:
            raise ValueError(f"{len(self.token_ids)} token_ids for num_tokens={self.num_tokens}: the last stage "
                             f"records them for the sampling's penalties")  # fmt: skip
        _check_block_ids(self.blocks, f"request {self.request_id!r}")

    def check_blocks(self, block_size: int, num_blocks: int | None = None) -> None:
        """Whether the block table covers this entry's positions in a paged cache of `num_blocks` blocks."""
        check_block_table(self.blocks, self.start_pos, self.num_tokens, block_size, num_blocks,
                          f"request {self.request_id!r}")  # fmt: skip

    @property
    def segment(self) -> Segment:
        """This entry's share of the packed step."""
        return Segment(self.slot, self.start_pos, self.num_tokens, self.blocks)

    def computed_by(self, stage: int, num_stages: int) -> bool:
        """Whether `stage` runs its layers over this entry."""
        return self.first_stage <= stage < (self.end_stage or num_stages)


@dataclass(frozen=True)
class Sampled:
    """The last stage's answer for one entry: the token drawn and its log-probability under the model, and the
    `top_logprobs` most likely tokens there as (token id, log-probability), most likely first, when asked."""

    request_id: str
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
