"""The KV cache of one shard: keys and values of every sequence it serves, for its own layers."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Static keys and values for `num_slots` sequences of up to `max_len` tokens, per local layer.

    Allocated once, up front, so memory use is known before the first request and never grows.
    Shape per layer: (num_slots, kv_heads, max_len, head_dim).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, 2, num_slots, kv_heads, max_len, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots

    def keys(self, layer: int) -> Tensor:
        return self.data[layer, 0]

    def values(self, layer: int) -> Tensor:
        return self.data[layer, 1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class ActivationLog:
    """What a stage that is not the last sent on, per slot and position: its output hidden states.

    Why: when the next stage's worker is lost, its replacement must rebuild the KV cache of every running
    sequence, and the input it needs for that is exactly what this stage once sent it. With the log, this
    stage resends those rows instead of recomputing them (and the stages before it do nothing), so a
    replay costs the lost stage's layers only (`StageEngine.step`, `BatchEntry.first_stage`).

    Shape (num_slots, max_len, hidden). Allocated uninitialized: a row is read only after the step that
    wrote it, and untouched pages cost no memory until a sequence reaches them.
    """

    def __init__(self, num_slots: int, max_len: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.data = torch.empty((num_slots, max_len, hidden), dtype=dtype, device=device)

    def record(self, slots: Tensor, positions: Tensor, rows: Tensor) -> None:
        """Write `rows` (T, hidden) at (slots[i], positions[i])."""
        self.data[slots, positions] = rows

    def rows(self, slot: int, start: int, length: int) -> Tensor:
        """The rows recorded for positions [start, start + length) of `slot`."""
        return self.data[slot, start : start + length]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
