"""Generate the Python code for the shardmesh protos: `python protos/generate.py` (or `make protos`).

Sources: protos/shardmesh/v1/*.proto, package `shardmesh.v1`, imported by each other as
"shardmesh/v1/<name>.proto" (the directory mirrors the package, as protobuf tooling expects).

Output: shardmesh/proto/v1/<name>_pb2.py (messages), <name>_pb2.pyi (typed stubs, mypy-protobuf),
<name>_pb2_grpc.py (service stubs and servicers) and <name>_pb2_grpc.pyi, imported as
`shardmesh.proto.v1.<name>_pb2`.

Why one rewrite step: protoc names a generated module after its proto file's path, so the code it
writes for "shardmesh/v1/gateway.proto" says `from shardmesh.v1 import common_pb2`. `shardmesh` is
our own Python package, so that path would land inside it at shardmesh/v1, mixing generated code
with hand-written code. We generate into a temporary directory and rewrite only Python module
paths, `shardmesh.v1.<name>_pb2` -> `shardmesh.proto.v1.<name>_pb2`; the serialized descriptors
are left untouched, so the proto file names ("shardmesh/v1/common.proto"), the package and the
fully qualified names on the wire ("shardmesh.v1.Coordinator") stay what the .proto files say.

`--check` generates into a temporary directory and compares with the committed files (exit 1 and
a list of differences when they are stale); tests/unit/rpc/test_protos.py does the same.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE_DIR = Path("shardmesh") / "v1"  # relative to PROTO_ROOT; mirrors `package shardmesh.v1`
DEFAULT_OUT = ROOT / "shardmesh" / "proto"  # Python package shardmesh.proto
PY_PACKAGE = "shardmesh.proto.v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")

INIT_FILES = {
    Path("__init__.py"): '"""Generated protobuf and gRPC modules: `python protos/generate.py`."""\n',
    Path("v1") / "__init__.py": '"""Package shardmesh.v1. Generated: edit protos/shardmesh/v1/*.proto instead."""\n',
}

# `from shardmesh.v1 import x_pb2` at the start of a line, and dotted `shardmesh.v1.x_pb2[_grpc]`
# module references (stubs' annotations, `_builder.BuildTopDescriptorsAndMessages(..., 'shardmesh.v1.x_pb2')`).
# Neither pattern can match inside a serialized descriptor: there, "shardmesh.v1" is followed by a
# message or enum name, never by a module name ending in _pb2.
_FROM_IMPORT = re.compile(r"^from shardmesh\.v1 import ", re.MULTILINE)
_DOTTED_MODULE = re.compile(r"(?<![\w.])shardmesh\.v1\.(\w+_pb2(?:_grpc)?)\b")
# The file path grpc's version-mismatch error message names.
_MODULE_FILE = re.compile(r"(?<![\w/])shardmesh/v1/(\w+_pb2(?:_grpc)?\.py)\b")


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT, in a stable order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def _plugin(name: str) -> str:
    """A protoc plugin from the running interpreter's environment (the venv), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        raise SystemExit(f"error: {name} not found next to {sys.executable} or on PATH: pip install mypy-protobuf")
    return found


def rewrite_module_paths(text: str) -> str:
    """Point generated imports at shardmesh.proto.v1 instead of shardmesh.v1 (see the module docstring)."""
    text = _FROM_IMPORT.sub(f"from {PY_PACKAGE} import ", text)
    text = _DOTTED_MODULE.sub(rf"{PY_PACKAGE}.\1", text)
    return _MODULE_FILE.sub(rf"{PY_PACKAGE.replace('.', '/')}/\1", text)


def _run_protoc(files: list[Path], out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/duration.proto etc.
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out=quiet:{out}",
        f"--mypy_grpc_out=quiet:{out}",
        *(str(f) for f in files),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("error: protoc failed (its message is above)")


def generate(out: Path) -> list[Path]:
    """Write the generated package into `out` (the directory that is `shardmesh.proto`).

    Returns the files written, relative to `out`. Stale generated files in out/v1 are removed.
    """
    files = proto_files()
    if not files:
        raise SystemExit(f"error: no .proto files under {PROTO_ROOT / PROTO_PACKAGE_DIR}")
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="shardmesh-protoc-") as tmp:
        _run_protoc(files, Path(tmp))
        produced = sorted((Path(tmp) / PROTO_PACKAGE_DIR).iterdir())
        (out / "v1").mkdir(parents=True, exist_ok=True)
        for src in produced:
            rel = Path("v1") / src.name
            (out / rel).write_text(rewrite_module_paths(src.read_text()))
            written.append(rel)
    for rel, text in INIT_FILES.items():
        (out / rel).write_text(text)
        written.append(rel)
    for stale in (out / "v1").iterdir():
        if stale.name.endswith(GENERATED_SUFFIXES) and Path("v1") / stale.name not in written:
            stale.unlink()
    return sorted(written)


def compare(expected: Path, actual: Path) -> list[str]:
    """Differences between two generated trees, as human-readable lines (empty when identical)."""
    problems = []
    exp = {p.relative_to(expected) for p in expected.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    act = {p.relative_to(actual) for p in actual.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    problems += [f"missing: {actual / p}" for p in sorted(exp - act)]
    problems += [f"not generated (stale?): {actual / p}" for p in sorted(act - exp)]
    problems += [
        f"differs: {actual / p}" for p in sorted(exp & act) if not filecmp.cmp(expected / p, actual / p, shallow=False)
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output package directory (default {DEFAULT_OUT})")
    ap.add_argument("--check", action="store_true", help="only check that --out matches a fresh generation")
    args = ap.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory(prefix="shardmesh-proto-check-") as tmp:
            generate(Path(tmp))
            problems = compare(Path(tmp), args.out)
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("generated protos are stale: run `python protos/generate.py`", file=sys.stderr)
        return 1 if problems else 0
    for rel in generate(args.out):
        print(args.out / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
