"""`services.security` of a manifest: each service's command line carries its own certificate of `tls_dir`, the join
token file (and the gateway the API key file), paths read from the manifest's directory; each command parses and
validates through the service's own parser; `coordinator --manifest` and `up --manifest` take the same."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest
import yaml

from shardmesh.planning import deploy
from shardmesh.planning.manifest import load_manifest
from shardmesh.rpc.flags import UsageError
from shardmesh_cli import certs

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


@pytest.fixture
def manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key in ("SHARDMESH_JOIN_TOKEN", "SHARDMESH_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    certs.init(tmp_path / "tls")
    (tmp_path / "join").write_text("the-join-token\n")
    (tmp_path / "keys").write_text("key-1\nkey-2\n")
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(CONFIGS / "llama-3-8b")}, "parallelism": {"pipeline": 1, "tensor": 1},
        "services": {"coordinator": {"listen": "127.0.0.1:50051"},
                     "security": {"tls_dir": "tls", "join_token_file": "join", "api_key_file": "keys"}},
    }))  # fmt: skip
    return path


def _parsed(command: str) -> argparse.Namespace:
    from shardmesh_cli.main import build_parser

    argv = shlex.split(command)
    assert argv[0] == "shardmesh"
    return build_parser().parse_args(argv[1:])


def test_each_service_gets_its_own_certificate_and_the_tokens(manifest: Path) -> None:
    from coordinator import app as coordinator_app
    from gateway import app as gateway_app
    from shardworker import app as worker_app

    tls = manifest.parent / "tls"
    commands = deploy.service_commands(deploy.resolve(load_manifest(manifest), manifest))
    coordinator, worker, gateway = (_parsed(c) for c in commands)
    for args, service in ((coordinator, "coordinator"), (worker, "worker"), (gateway, "gateway")):
        assert (args.tls_cert, args.tls_key, args.tls_ca) == (str(tls / f"{service}.pem"), str(tls / f"{service}.key"),
                                                              str(tls / "ca.pem"))  # fmt: skip
        assert args.join_token_file == str(manifest.parent / "join")
    assert gateway.api_key_file == str(manifest.parent / "keys")
    cfg = coordinator_app.build_config(coordinator)
    assert cfg.tls is not None and cfg.join_token == "the-join-token"
    assert cfg.join_tokens.check("Bearer the-join-token").value == "ok"
    assert worker_app.build_config(worker).join_token == "the-join-token"
    gw = gateway_app.build_config(gateway)
    assert gw.tls.cert == tls / "gateway.pem" and gw.api_keys.check("Bearer key-2").value == "ok"


def test_coordinator_and_up_take_the_manifest_security(manifest: Path) -> None:
    from coordinator import app as coordinator_app
    from shardmesh_cli import up

    defaults = _parsed("shardmesh coordinator")
    out = coordinator_app.from_manifest(_parsed(f"shardmesh coordinator --manifest {manifest}"), defaults)
    assert out.tls_cert == str(manifest.parent / "tls" / "coordinator.pem")
    assert out.join_token_file == str(manifest.parent / "join")
    given = _parsed(f"shardmesh coordinator --manifest {manifest} --tls-cert other.pem")
    with pytest.raises(UsageError, match=r"--tls-cert: set by --manifest \(services.security\)"):
        coordinator_app.from_manifest(given, defaults)
    up_args = _parsed(f"shardmesh up --manifest {manifest}")
    out, _ = up.args_from_manifest(up_args, up_args.up_defaults)
    assert (out.tls, out.tls_dir) == (True, str(manifest.parent / "tls"))
    assert (out.join_token_file, out.api_key_file) == (str(manifest.parent / "join"), str(manifest.parent / "keys"))
