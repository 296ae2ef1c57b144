"""Safetensors headers read without torch: the same tensors safetensors lists, and the files it refuses."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from shardmesh.models.checkpoint import Checkpoint, CheckpointError, TensorRead, read_header


def _write(path: Path, header: dict, data_len: int) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_len)
    return path


def test_headers_list_what_safetensors_lists(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {
        "w": torch.arange(12.0).reshape(3, 4),
        "h": torch.arange(5.0).to(torch.bfloat16),
        "i": torch.arange(4).reshape(2, 2),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = Checkpoint(tmp_path).tensors
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        theirs = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}  # noqa: SIM118
    assert {name: (t.shape, t.dtype) for name, t in ours.items()} == theirs
    assert ours["w"].nbytes == 48 and ours["h"].nbytes == 10 and ours["i"].nbytes == 32
    data = (tmp_path / "model.safetensors").read_bytes()
    for name, t in tensors.items():  # each tensor's bytes start at its offset in the file
        assert (
            data[ours[name].offset : ours[name].offset + ours[name].nbytes]
            == t.contiguous().view(torch.uint8).numpy().tobytes()
        )


def test_reading_headers_imports_no_torch(tmp_path: Path) -> None:
    _write(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, 16)
    code = f"import sys; from shardmesh.models.checkpoint import Checkpoint; Checkpoint({str(tmp_path)!r}); " \
           "assert 'torch' not in sys.modules, 'torch imported'"  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
BAD = {
    "data past the end": ({"w": F32_2x2}, 8),
    "bytes past the data": ({"w": F32_2x2}, 24),
    "offsets not the shape": ({"w": {**F32_2x2, "data_offsets": [0, 12]}}, 12),
    "overlapping tensors": ({"w": F32_2x2, "v": {**F32_2x2, "data_offsets": [8, 24]}}, 24),
    "unknown dtype": ({"w": {**F32_2x2, "dtype": "F12"}}, 16),
    "negative dim": ({"w": {**F32_2x2, "shape": [-2, -2]}}, 16),
    "not an object": ([1, 2], 0),
}


@pytest.mark.parametrize("case", list(BAD))
def test_refused_as_safetensors_refuses_it(tmp_path: Path, case: str) -> None:
    from safetensors import safe_open

    header, data_len = BAD[case]
    path = _write(tmp_path / "model.safetensors", header, data_len)
    # safetensors raises its own error types; the point is that we are not stricter than it.
    with pytest.raises(Exception), safe_open(path, framework="numpy"):  # noqa: B017
        pass
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a valid safetensors file"):
        read_header(path)


def test_header_length_beyond_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match=r"header length \d+ does not fit a file of 10 bytes"):
        read_header(path)


def test_a_read_knows_the_shape_of_its_slice() -> None:
    assert TensorRead("t", "s", (8, 6), None).shape == (8, 6)
    assert TensorRead("t", "s", (8, 6), (slice(2, 5),)).shape == (3, 6)
    assert TensorRead("t", "s", (8, 6), (slice(None), slice(4, 6))).numel == 16
    assert TensorRead("t", "s", (8,), (slice(6, 20),)).shape == (2,)
