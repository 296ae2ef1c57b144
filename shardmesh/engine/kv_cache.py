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
