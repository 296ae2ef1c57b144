"""Tests that need a CUDA device: collected only where one is (`python -m pytest tests/gpu` on a GPU machine; their
last results are in bench/results/*-gpu-*.md). On a machine without CUDA this directory is not collected at all,
so nothing here shows up as skipped."""

from __future__ import annotations

import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
