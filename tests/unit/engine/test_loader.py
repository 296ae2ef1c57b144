"""Loading reads only a shard's bytes, from single or sharded safetensors, and refuses bad files clearly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.kv_cache import KVCache
from shardmesh.engine.loader import build_shard, check_shards
from shardmesh.models.checkpoint import CheckpointError
from tests.checkpoints import FAMILIES, make_checkpoint, make_plain_checkpoint
from tests.unit.engine.served import served_blocks

LAYERS = 4


def _logits(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = build_shard(model_dir, ShardSpec(0, LAYERS, LAYERS), dtype=dtype, progress=False)
    cache: KVCache = model.make_cache(1, dtype, "cpu")
    with torch.inference_mode():
        return model(torch.tensor([1, 5, 9, 13]), BatchLayout.build([Segment(0, 0, 4)]), cache)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("single"), "llama-mha-untied", num_layers=LAYERS)


def test_sharded_index_equals_single_file(ckpt: Path, tmp_path: Path) -> None:
    from tests.checkpoints import load_reference

    load_reference(ckpt).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    assert torch.equal(_logits(tmp_path), _logits(ckpt))


@pytest.mark.parametrize(("family", "tp"), [(f, tp) for f in FAMILIES for tp in (1, 2)])
def test_every_block_served_is_its_checkpoint_slice(tmp_path: Path, family: str, tp: int) -> None:
    """What the shard multiplies by (stacked products split back into blocks) is the checkpoint, sliced as
    the read says: column-parallel blocks by heads or intermediate columns, row-parallel ones by columns."""
    d = make_checkpoint(tmp_path, family, num_layers=2)
    ckpt = load_file(d / "model.safetensors")
    for rank in range(tp):
        spec = ShardSpec(0, 2, 2, rank, tp)
        blocks = served_blocks(build_shard(d, spec, UnboundGroup(rank, tp), progress=False), spec)
        assert {r.source for r, _ in blocks} == set(ckpt)  # every tensor read, none invented
        for r, values in blocks:
            expected = ckpt[r.source][r.index] if r.index is not None else ckpt[r.source]
            assert torch.equal(values, expected), (r.target, r.source)


def test_dtype_converted_while_reading(ckpt: Path) -> None:
    model = build_shard(ckpt, ShardSpec(1, 3, LAYERS), dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert (_logits(ckpt, torch.bfloat16) - _logits(ckpt)).abs().max() < 0.5


def _copy_with(ckpt: Path, dst: Path, edit) -> Path:
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    dst.mkdir()
    (dst / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_names_it(ckpt: Path, tmp_path: Path) -> None:
    d = _copy_with(ckpt, tmp_path / "m", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.2.mlp.up_proj.weight' is missing"):
        build_shard(d, ShardSpec(2, 4, LAYERS), progress=False)
    # A shard that does not need the tensor loads fine: only its own tensors are looked at.
    build_shard(d, ShardSpec(0, 2, LAYERS), progress=False)


def test_wrong_shape_names_file_and_tensor(ckpt: Path, tmp_path: Path) -> None:
    def shrink(t):
        t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:-1].clone()

    d = _copy_with(ckpt, tmp_path / "s", shrink)
    with pytest.raises(CheckpointError) as e:
        check_shards(d, [ShardSpec(0, 4, LAYERS, 1, 2)])
    assert "model.safetensors: tensor 'model.layers.1.self_attn.k_proj.weight' has shape [47, 48]" in str(e.value)
    assert "expected [48, 48]" in str(e.value)


def test_truncated_file(ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "t"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    data = (ckpt / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"t/model.safetensors: not a valid safetensors file"):
        build_shard(d, ShardSpec(0, 1, LAYERS), progress=False)


def test_not_safetensors_and_pickles_refused(ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "p"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle bytes we must never load")
    with pytest.raises(CheckpointError, match=r"pickle-based weights are never loaded"):
        build_shard(d, ShardSpec(0, 1, LAYERS), progress=False)
    (d / "model.safetensors").write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"p/model.safetensors: not a valid safetensors file"):
        build_shard(d, ShardSpec(0, 1, LAYERS), progress=False)


def test_index_pointing_at_missing_file(ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "i"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002.safetensors: listed in .* but missing"):
        build_shard(d, ShardSpec(0, 1, LAYERS), progress=False)


def test_bad_checkpoint_through_cli_is_one_line(ckpt: Path, tmp_path: Path) -> None:
    d = _copy_with(ckpt, tmp_path / "c", lambda t: t.pop("model.norm.weight"))
    r = subprocess.run(
        [sys.executable, "-m", "shardmesh_cli", "generate", "--model", str(d), "--pp", "2", "--token-ids", "1,2",
         "--max-new-tokens", "2", "--json"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode != 0 and r.stdout == ""
    assert "tensor 'model.norm.weight' is missing" in r.stderr and "Traceback" not in r.stderr


# --- memory: a shard costs its own bytes, not the checkpoint's ------------------------------------------

BIG_LAYERS, HIDDEN, FFN, VOCAB = 4, 1024, 4096, 4096

_MEASURE = """
import json, sys
from shardmesh.core.layout import ShardSpec
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.loader import build_shard

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

open("/proc/self/clear_refs", "w").write("5")  # reset the peak: count only what loading adds
before = status("VmRSS")
model = build_shard(sys.argv[1], ShardSpec(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])), progress=False)
# Make every weight page resident (packed oneDNN weights are: packing wrote them).
touched = sum(float(p.sum()) for p in model.parameters() if not p.is_mkldnn)
shard = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_added": status("VmHWM") - before, "shard_bytes": shard}))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_plain_checkpoint(tmp_path_factory.mktemp("big"), layers=BIG_LAYERS, hidden=HIDDEN, ffn=FFN, vocab=VOCAB)


def _peak(checkpoint: Path, start: int, end: int) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(checkpoint), str(start), str(end), str(BIG_LAYERS)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])  # the last line: a first build of the kernels logs before it


def test_peak_rss_of_one_shard_is_its_own_bytes(big_checkpoint: Path) -> None:
    total = (big_checkpoint / "model.safetensors").stat().st_size
    assert total >= 200e6
    m = _peak(big_checkpoint, 1, 2)
    # One middle layer of four: ~67 MB of a ~302 MB checkpoint. Allowance: the shard, 30 % for the
    # allocator's slack, and 64 MB of fixed runtime overhead; and in any case under half the file.
    assert m["shard_bytes"] < total / 4
    assert m["peak_added"] < 1.3 * m["shard_bytes"] + 64e6, m
    assert m["peak_added"] < total / 2, m


def test_peak_rss_of_the_whole_model_holds_each_tensor_once(big_checkpoint: Path) -> None:
    """The same bound for all ~302 MB: a second copy of the weights at any point (e.g. the CPU re-layout
    of the matrices while the loaded originals are still referenced) would exceed it."""
    m = _peak(big_checkpoint, 0, BIG_LAYERS)
    assert m["peak_added"] < 1.3 * m["shard_bytes"] + 64e6, m
