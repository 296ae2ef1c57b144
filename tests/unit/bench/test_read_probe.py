"""bench/read_probe.py: the read probe reads every word of its buffer, and the bytes it is given are those one decode
step of one stream reads (checked against `transformers`' own count of the model's parameters)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench import read_probe
from tests.checkpoints import make_checkpoint


def _xor_up_to(n: int) -> int:
    """0 ^ 1 ^ ... ^ (n - 1), in closed form."""
    m = n - 1
    return [m, 1, m + 1, 0][m % 4]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("words", [1, 7, 1 << 17, (1 << 17) + 13])
def test_the_probe_reads_every_word_of_its_buffer(threads: int, words: int) -> None:
    """Its buffer holds 0, 1, 2, ... and the probe folds every word it reads with xor: the result is the xor of all
    of them only if no word was left out or read twice (the threads' shares and their tails)."""
    assert read_probe.folded(words * 8, threads) == _xor_up_to(words)
    rates = read_probe.measure(words * 8, threads, passes=3)
    assert len(rates) == 3 and all(math.isfinite(r) and r > 0 for r in rates)


@pytest.mark.parametrize(("family", "dtype"), [("llama-gqa-tied", "float32"), ("llama-mha-untied", "bfloat16")])
def test_the_bytes_are_those_one_step_reads(tmp_path: Path, family: str, dtype: str) -> None:
    """Every parameter once (a tied head is the embedding, read whole by the head), less the embedding where the head
    is a matrix of its own (a step gathers one row of it), at the dtype's size."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path, family)
    model = AutoModelForCausalLM.from_pretrained(path)
    params = sum(p.numel() for p in model.parameters())  # a tied weight counted once
    if not model.config.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    assert read_probe.weight_bytes(path, dtype) == params * size


def test_no_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors in"):
        read_probe.weight_bytes(tmp_path, "float32")


def test_the_floor_is_the_bytes_at_the_median_rate() -> None:
    assert read_probe.floor_ms(10**9, [10.0, 20.0, 40.0]) == pytest.approx(50.0)
