"""The protos are documented, and the committed generated code is exactly what `protos/generate.py` writes.

Comments are checked on protoc's own view of the files (`--include_source_info`): a comment counts
only if protoc attaches it to the element as a leading comment, which is also what ends up in the
generated stubs' docstrings.
"""

from __future__ import annotations

import filecmp
import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = ROOT / "protos"
PROTO_FILES = sorted((PROTO_ROOT / "shardmesh" / "v1").glob("*.proto"))
COMMITTED = ROOT / "shardmesh" / "proto"
MODULES = [p.stem for p in PROTO_FILES]

# Field numbers of the repeated fields in descriptor.proto that make up a SourceCodeInfo path.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MSG_FIELD, _MSG_NESTED, _MSG_ENUM, _MSG_ONEOF = 2, 3, 4, 8
_ENUM_VALUE, _SERVICE_METHOD = 2, 2


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_committed_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    out = tmp_path / "proto"
    result = subprocess.run(
        [sys.executable, str(PROTO_ROOT / "generate.py"), "--out", str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    fresh, committed = _files(out), _files(COMMITTED)
    assert fresh == committed, f"only fresh: {sorted(fresh - committed)}; only committed: {sorted(committed - fresh)}"
    stale = [str(p) for p in sorted(fresh) if not filecmp.cmp(out / p, COMMITTED / p, shallow=False)]
    assert not stale, f"stale generated files (run `python protos/generate.py`): {stale}"


@pytest.mark.parametrize("name", MODULES)
def test_generated_modules_import_under_shardmesh_proto(name: str) -> None:
    """Imports point at shardmesh.proto.v1, while proto file names and packages stay shardmesh/v1."""
    pb2 = importlib.import_module(f"shardmesh.proto.v1.{name}_pb2")
    importlib.import_module(f"shardmesh.proto.v1.{name}_pb2_grpc")
    assert pb2.DESCRIPTOR.name == f"shardmesh/v1/{name}.proto"
    assert pb2.DESCRIPTOR.package == "shardmesh.v1"
    for message in pb2.DESCRIPTOR.message_types_by_name.values():
        assert getattr(pb2, message.name).__module__ == f"shardmesh.proto.v1.{name}_pb2"
    for path in COMMITTED.glob("v1/*.py*"):
        assert "from shardmesh.v1 import" not in path.read_text(), path


def test_services_have_the_agreed_rpcs() -> None:
    from shardmesh.proto.v1 import coordinator_pb2, gateway_pb2, worker_pb2

    def rpcs(module: object, service: str) -> set[str]:
        return set(module.DESCRIPTOR.services_by_name[service].methods_by_name)  # type: ignore[attr-defined]

    assert rpcs(gateway_pb2, "Gateway") == {"Generate", "GenerateStream", "GetModelInfo"}
    assert rpcs(coordinator_pb2, "Coordinator") == {
        "Register", "Heartbeat", "Deregister", "WatchTopology", "GetTopology", "ReportFailure", "Drain"
    }  # fmt: skip
    assert rpcs(worker_pb2, "StageWorker") == {"Step", "Release", "GetShardInfo", "Calibrate"}
    assert coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name == "shardmesh.v1.Coordinator"


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "set.pb"
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", "--include_source_info", f"--descriptor_set_out={out}"]
    assert protoc.main([*args, *(str(p.relative_to(PROTO_ROOT)) for p in PROTO_FILES)]) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _elements(f: descriptor_pb2.FileDescriptorProto) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every documentable element of a file: (a readable name, its SourceCodeInfo path)."""

    def enum(e: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...], scope: str) -> Iterator:
        yield f"enum {scope}{e.name}", path
        for i, v in enumerate(e.value):
            yield f"enum value {scope}{e.name}.{v.name}", (*path, _ENUM_VALUE, i)

    def message(m: descriptor_pb2.DescriptorProto, path: tuple[int, ...], scope: str) -> Iterator:
        if m.options.map_entry:  # synthesized by protoc for a map<,> field; the field carries the comment
            return
        name = f"{scope}{m.name}"
        yield f"message {name}", path
        for i, fld in enumerate(m.field):
            yield f"field {name}.{fld.name}", (*path, _MSG_FIELD, i)
        synthetic = {fld.oneof_index for fld in m.field if fld.proto3_optional}  # `optional` makes a hidden oneof
        for i, o in enumerate(m.oneof_decl):
            if i not in synthetic:
                yield f"oneof {name}.{o.name}", (*path, _MSG_ONEOF, i)
        for i, nested in enumerate(m.nested_type):
            yield from message(nested, (*path, _MSG_NESTED, i), f"{name}.")
        for i, e in enumerate(m.enum_type):
            yield from enum(e, (*path, _MSG_ENUM, i), f"{name}.")

    for i, m in enumerate(f.message_type):
        yield from message(m, (_FILE_MESSAGE, i), "")
    for i, e in enumerate(f.enum_type):
        yield from enum(e, (_FILE_ENUM, i), "")
    for i, s in enumerate(f.service):
        yield f"service {s.name}", (_FILE_SERVICE, i)
        for j, method in enumerate(s.method):
            yield f"rpc {s.name}.{method.name}", (_FILE_SERVICE, i, _SERVICE_METHOD, j)


def test_every_element_has_a_leading_comment(tmp_path: Path) -> None:
    files = [f for f in _descriptor_set(tmp_path).file if f.name.startswith("shardmesh/")]
    assert sorted(f.name for f in files) == [f"shardmesh/v1/{n}.proto" for n in MODULES]
    undocumented, checked = [], 0
    for f in files:
        comments = {tuple(loc.path): loc.leading_comments.strip() for loc in f.source_code_info.location}
        for name, path in _elements(f):
            checked += 1
            if not comments.get(path):
                undocumented.append(f"{f.name}: {name}")
    assert checked > 150  # the walk really saw the files
    assert not undocumented, "elements without a leading // comment:\n" + "\n".join(undocumented)


def test_protos_live_in_a_versioned_package() -> None:
    for path in PROTO_FILES:
        assert "\npackage shardmesh.v1;\n" in path.read_text(), path
