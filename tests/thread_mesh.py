"""A whole P × T mesh inside one test process: one thread per rank, real Gloo groups between them.

The groups, links and engines are exactly those the worker processes use; only the process
boundary is missing, which the multi-process tests cover. Threads make the full equivalence matrix
cheap: no interpreter start-up and no torch import per rank.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import Quantization
from shardmesh.core.layout import shard_specs
from shardmesh.engine.groups import form_groups
from shardmesh.engine.loader import build_shard
from shardmesh.engine.stage import StageEngine

_prefixes = itertools.count()


def run_mesh(
    model_dir: Path, pp: int, tp: int, body: Callable[[StageEngine, int], Any], *, max_len: int = 128,
    dtype: torch.dtype = torch.float32, paged: tuple[int, int] | None = None, staging: str = "auto",
    quantization: Quantization = Quantization.NONE, tp_split: tuple[int, ...] = (),
) -> list[Any]:  # fmt: skip
    """Build every shard in its own thread, run `body(engine, rank)` in each, return results by rank. `paged`:
    (num_blocks, block_size) of a paged KV cache instead of two slots. `staging`: every rank's link staging
    (`form_groups`; "host" copies activations through host buffers, as a GPU stage next to a CPU one does).
    `tp_split`: each tp rank's share of the MLP columns and vocabulary (`ShardSpec.tp_split`)."""
    cfg = ModelConfig.from_dir(model_dir)
    specs = [replace(s, tp_split=tp_split) for s in shard_specs(cfg.num_layers, pp, tp)]
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    prefix = f"test{next(_prefixes)}"
    results: list[Any] = [None] * len(specs)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            # Its own store client, as a process would have: one client shared by threads serialises waits.
            client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=60))
            groups = form_groups(client, prefix, specs[rank], rank // tp, pp, torch.device("cpu"), staging,
                                 timedelta(seconds=60))  # fmt: skip
            model = build_shard(model_dir, specs[rank], groups.tp, dtype=dtype, max_len=max_len, progress=False,
                                quantization=quantization)  # fmt: skip
            if paged is None:
                cache = model.make_cache(2, dtype, "cpu")
            else:
                cache = model.make_paged_cache(paged[0], paged[1], dtype, "cpu")
            engine = StageEngine(model, groups, cache, torch.device("cpu"))
            results[rank] = body(engine, rank)
        except BaseException as e:  # surfaced to the test below
            errors.append(e)

    # Named by rank: a test can tell the ranks apart inside code they share (e.g. pretend one is on a GPU).
    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True) for r in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"mesh pp={pp} tp={tp} did not finish")
    return results
