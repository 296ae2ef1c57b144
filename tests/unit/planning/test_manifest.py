"""The deployment manifest: good and bad files (one line per problem, naming the field), the committed JSON
Schema, and fields that are valid alone but not for the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardmesh.planning.manifest import SCHEMA_PATH, schema_text
from shardmesh_cli.main import main

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests" / "data" / "configs"


def test_committed_schema_is_a_fresh_export() -> None:
    assert SCHEMA_PATH == ROOT / "compose" / "manifest.schema.json"
    fresh = schema_text()
    assert SCHEMA_PATH.read_text() == fresh, "run: shardmesh plan --manifest-schema > compose/manifest.schema.json"


BAD = {
    "bounds and unknown fields": (
        "model: {path: /m}\nparallelism: {tensor: 0, pipline: 2}\nserving: {kv_slots: 0, max_queue: 2.5}\n",
        ["parallelism.tensor: must be 'auto' or an integer >= 1, got 0",
         "parallelism.pipline: unknown field; expected one of: tensor, pipeline, tensor_split",
         "serving.kv_slots: must be >= 1, got 0", "serving.max_queue: must be an integer, got 2.5"],
    ),
    "tensor split dims": (
        "model: {path: /m}\nparallelism: {tensor_split: {attention: hidden, mlp: rows}}\n",
        ["parallelism.tensor_split.attention: attention can only be split by 'heads' (query and key/value heads; "
         "q/k/v column-parallel, o_proj row-parallel); got 'hidden'",
         "parallelism.tensor_split.mlp: mlp can only be split by 'intermediate' (the intermediate dimension; "
         "gate/up column-parallel, down_proj row-parallel); got 'rows'"],
    ),
    "nodes and sizes": (
        "model: {path: /m, dtype: int8}\nnodes:\n  - {name: a, devices: [{count: 2, memory: 80 gigs}]}\n"
        "  - {name: a, devices: []}\nplacement: {node_order: [b]}\n",
        ["model.dtype: must be 'float32', 'bfloat16' or 'float16', got 'int8'",
         "nodes[0].devices[0].memory: must be a size like 80GiB, 48GB or 512MiB, or a number of bytes, got '80 gigs'",
         "nodes[1].devices: must list at least 1 item(s)"],
    ),
    "cross-field": (
        "model: {path: /m}\nnodes:\n  - {name: a, devices: [{memory: 8GiB}]}\n"
        "  - {name: a, devices: [{memory: 8GiB}]}\nplacement: {node_order: [b]}\n",
        ["nodes[1].name: duplicate node name 'a'", "placement.node_order[0]: unknown node 'b'; nodes: a"],
    ),
    "services and telemetry": (
        "model: {path: /m}\nservices: {gateway: {listen: nohost}, worker: {device: tpu}}\n"
        "telemetry: {otlp_endpoint: collector, metrics_port: 70000}\n",
        ["telemetry.otlp_endpoint: must be a URL like http://collector:4317, got 'collector'",
         "telemetry.metrics_port: must be <= 65535, got 70000",
         "services.gateway.listen: must be host:port, got 'nohost'",
         "services.worker.device: must be cpu, cuda or cuda:N, got 'tpu'"],
    ),
    "missing and wrong types": (
        "version: 2\nmdl: {}\nnodes: {a: 1}\n",
        ["version: must be 1, got 2", "model: is required", "nodes: must be a list, got {'a': 1}",
         "mdl: unknown field; expected one of: version, model, parallelism, nodes, placement, serving, telemetry, "
         "services"],
    ),
    "paged KV cache": (
        "model: {path: /m}\nserving: {kv_block_size: -16, kv_cache_memory: 2 gigs}\n",
        ["serving.kv_block_size: must be >= 0, got -16",
         "serving.kv_cache_memory: must be a size like 80GiB, 48GB or 512MiB, or a number of bytes, got '2 gigs'"],
    ),
    "KV memory without blocks": (
        "model: {path: /m}\nserving: {kv_cache_memory: 2GiB}\n",
        ["serving.kv_cache_memory: sizes a paged KV cache, set serving.kv_block_size too (the slot cache is sized by "
         "kv_slots and max_context)"],
    ),
    "not a mapping": ("- just\n- a list\n", ["(top level): must be a mapping of key: value, got list"]),
    "YAML syntax": ("model: {path: /m\n",
                    ["not valid YAML: line 2, column 1: expected ',' or '}', but got '<stream end>'"]),
    "duplicate key": ("model: {path: /m}\nserving: {kv_slots: 2}\nserving: {kv_slots: 3}\n",
                      ["not valid YAML: line 3, column 1: key 'serving' given twice"]),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_manifest_is_one_line_per_error(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, expected = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["plan", "--manifest", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {path}: {line}" for line in expected], err


def test_bad_manifest_through_a_real_process(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: /m}\nparallelism: {tensor: -2}\n")
    r = subprocess.run([sys.executable, "-m", "shardmesh_cli", "plan", "--manifest", str(path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == f"error: {path}: parallelism.tensor: must be 'auto' or an integer >= 1, got -2\n"


def test_manifest_against_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fields valid on their own but not for this model, or not plannable, still name the field."""
    cases = {
        "parallelism: {tensor: auto, pipeline: 2}\n": "parallelism.tensor: 'auto' needs nodes to plan on",
        "parallelism: {tensor: 3, pipeline: 1}\n": "parallelism.tensor: 3 is not valid for this model; valid: [1, 2, 4",
        "parallelism: {tensor: 1, pipeline: 81}\n": "parallelism.pipeline: must be <= 80",
        "serving: {max_context: 9000}\nparallelism: {tensor: 1, pipeline: 1}\n": "serving.max_context: must be <= 8192",
        "": "model.path: 'nowhere' is neither a directory",
    }
    for i, (extra, msg) in enumerate(cases.items()):
        path = tmp_path / f"m{i}.yaml"
        path.write_text(f"model: {{path: {CONFIGS / 'llama-3-70b' if extra else 'nowhere'}}}\n{extra}")
        assert main(["plan", "--manifest", str(path)]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: {msg}") and err.count("\n") == 1, err
    # Infeasible: exit 1 with what is missing; and flags the manifest sets are refused, not overridden.
    path = tmp_path / "small.yaml"
    path.write_text(f"model: {{path: {CONFIGS / 'llama-3-70b'}}}\nnodes: [{{name: a, devices: [{{memory: 8GiB}}]}}]\n")
    assert main(["plan", "--manifest", str(path)]) == 1
    assert "does not fit on a:1x8GiB" in capsys.readouterr().err
    assert main(["plan", "--manifest", str(path), "--dtype", "bfloat16", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--dtype: the manifest sets this (model.dtype); --tp: the manifest sets this (parallelism.tensor)" in err
