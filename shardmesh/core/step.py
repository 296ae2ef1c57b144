"""What one step of the mesh is made of, as plain values: the sequences it advances and how each samples.

A step packs several sequences' new tokens back to back; each sequence's share is a `Segment`. A stage
worker receives them as `StepEntry`s (one per sequence, with its tokens and `SamplingParams`) and the
last stage answers with one `Sampled` token per entry that asked for one. The tensors these describe
live in `shardmesh.engine` (`batch.BatchLayout`, `sampling.sample`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: `length` new tokens at positions [start, start + length)."""

    slot: int
    start: int
    length: int


@dataclass(frozen=True)
class SamplingParams:
    """How a request draws its tokens; the draw at each position depends on `seed` and that position only
    (`engine.sampling.draw_seed`)."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 means no limit
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class StepEntry:
    """One sequence's part of a step: `num_tokens` tokens from position `start_pos`, cached in KV slot `slot`
    (`token_ids` on the first stage only); `skip_sampling` when its last token gets no next token (a prompt
    chunk that is not the prompt's end)."""

    request_id: str
    slot: int
    start_pos: int
    num_tokens: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    skip_sampling: bool = False
    first_stage: int = 0  # a replay on stages [first_stage, end_stage) only (0, 0: every stage); see worker.proto
    end_stage: int = 0  # 0: through the last stage

    def computed_by(self, stage: int, num_stages: int) -> bool:
        """Whether `stage` runs its layers over this entry."""
        return self.first_stage <= stage < (self.end_stage or num_stages)


@dataclass(frozen=True)
class Sampled:
    """The last stage's answer for one entry: the token drawn and its log-probability under the model."""

    request_id: str
    token_id: int
    logprob: float
