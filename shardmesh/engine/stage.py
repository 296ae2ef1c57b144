"""One pipeline stage at work: receive activations, run the shard, pass them on (or return logits).

The same engine serves the offline launcher (`shardmesh generate`) and the stage-worker service:
whoever drives it decides the batch (`BatchLayout`), and every stage of one step must be given the
same layout, because the layout is what tells a stage the shape of the activations it receives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.groups import ShardGroups
from shardmesh.engine.kv_cache import KVCache
from shardmesh.engine.model import Transformer


class StageEngine:
    def __init__(self, model: Transformer, groups: ShardGroups, cache: KVCache, device: torch.device) -> None:
        if model.is_first != (groups.prev is None) or model.is_last != (groups.next is None):
            raise ValueError("model layer range and pipeline position disagree")
        self.model, self.groups, self.cache, self.device = model, groups, cache, device
        self.dtype = next(model.parameters()).dtype

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @torch.inference_mode()
    def step(self, batch: BatchLayout, token_ids: Tensor | None = None, all_logits: bool = False) -> Tensor | None:
        """Run one step. The first stage takes `token_ids` (T,); the last returns logits (B, vocab),
        or (T, vocab) with `all_logits`."""
        if self.is_first:
            if token_ids is None or token_ids.shape != (batch.num_tokens,):
                raise ValueError(f"first stage needs {batch.num_tokens} token ids for this batch")
            x = token_ids.to(self.device)
        else:
            assert self.groups.prev is not None
            x = self.groups.prev.recv((batch.num_tokens, self.model.cfg.hidden_size), self.dtype, self.device)
        out = self.model(x, batch, self.cache, all_logits=all_logits)
        if self.is_last:
            return out
        assert self.groups.next is not None
        self.groups.next.send(out)
        return None
