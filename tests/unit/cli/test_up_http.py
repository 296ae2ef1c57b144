"""`shardmesh up` and the OpenAI-compatible HTTP API: on by default at a free loopback port, where `--http-listen`
says, or off; the model id as given; the manifest's `services.gateway.http_listen` and `model.served_model_name`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from shardmesh.planning.manifest import ManifestError
from shardmesh_cli import main as cli
from shardmesh_cli import up

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


def _mesh(tmp_path: Path) -> up.LocalMesh:
    return up.LocalMesh(tmp_path)


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_http_is_on_by_default_at_a_free_loopback_port(tmp_path: Path) -> None:
    mesh = _mesh(tmp_path)
    flags = up._http_flags(mesh, argparse.Namespace(model="smollm2-135m-instruct"))
    host, port = _flag(flags, "--http-listen").rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and mesh.http == f"127.0.0.1:{port}"
    assert _flag(flags, "--served-model-name") == "smollm2-135m-instruct"  # --model as given, not its directory
    assert up.http_url(mesh.http) == f"http://127.0.0.1:{port}/v1"


def test_http_where_asked_named_as_asked_or_off(tmp_path: Path) -> None:
    mesh = _mesh(tmp_path)
    args = argparse.Namespace(model="./m", http_listen="0.0.0.0:8123", served_model_name="chat")
    flags = up._http_flags(mesh, args)
    assert _flag(flags, "--http-listen") == "0.0.0.0:8123" and _flag(flags, "--served-model-name") == "chat"
    assert mesh.http == "127.0.0.1:8123"  # a wildcard bind is reached on loopback from here
    wildcard_any_port = up._http_flags(_mesh(tmp_path), argparse.Namespace(model="m", http_listen="0.0.0.0:0"))
    assert _flag(wildcard_any_port, "--http-listen").startswith("0.0.0.0:")
    assert not _flag(wildcard_any_port, "--http-listen").endswith(":0")
    off = _mesh(tmp_path)
    # No HTTP, but the name clients see in metrics and spans is still the model as given, not its directory.
    assert up._http_flags(off, argparse.Namespace(model="m", no_http=True)) == ["--served-model-name", "m"]
    assert off.http == ""


def test_up_checks_its_http_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["up", "--model", "m", "--http-listen", "nowhere"]) == 2
    assert "--http-listen: expected host:port" in capsys.readouterr().err
    assert cli.main(["up", "--model", "m", "--http-listen", "127.0.0.1:8000", "--no-http"]) == 2
    assert "give one or the other" in capsys.readouterr().err


def _manifest(tmp_path: Path, served_model_name: str | None = None, **gateway: object) -> Path:
    model = {"path": str(CONFIGS / "llama-3-8b")}
    if served_model_name is not None:
        model["served_model_name"] = served_model_name
    data = {"model": model, "parallelism": {"pipeline": 1, "tensor": 1}, "services": {"gateway": gateway}}
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_manifest_sets_the_http_api(tmp_path: Path) -> None:
    def args_of(path: Path, *extra: str) -> argparse.Namespace:
        args = cli.build_parser().parse_args(["up", "--manifest", str(path), *extra])
        return up.args_from_manifest(args, args.up_defaults)[0]

    default = args_of(_manifest(tmp_path))
    assert (default.http_listen, default.no_http) == ("127.0.0.1:0", False)
    assert default.served_model_name == str(CONFIGS / "llama-3-8b")  # model.path, as written
    fixed = args_of(_manifest(tmp_path, "llama-3-8b", http_listen="0.0.0.0:8000"))
    assert (fixed.http_listen, fixed.no_http, fixed.served_model_name) == ("0.0.0.0:8000", False, "llama-3-8b")
    off = args_of(_manifest(tmp_path, http_listen=None))
    assert off.no_http and "--http-listen" not in up._http_flags(_mesh(tmp_path), off)
    with pytest.raises(ManifestError, match="--http-listen: the manifest sets this"):
        args_of(_manifest(tmp_path), "--http-listen", "127.0.0.1:9000")
