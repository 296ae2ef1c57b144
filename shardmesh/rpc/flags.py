"""Command-line plumbing every shardmesh command shares: flags that fall back to environment variables
(for services that compose runs with `environment:`), and the one error for bad command-line input.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line input (a flag, a model directory), found before anything runs: printed as one line
    `error: ...`, no traceback, exit code `EXIT_USAGE`.

    It lives here, below the services and the `shardmesh` command, so every entry point raises and catches
    the same class: `python -m shardmesh_cli` runs `shardmesh_cli/__main__.py`, and even a module run as
    `__main__` imports this one by its name.
    """


def env_flags(p: argparse.ArgumentParser, prefix: str) -> Callable[..., None]:
    """Returns `flag(name, default, **argparse_kwargs)`; `--heartbeat-interval` reads `<prefix>HEARTBEAT_INTERVAL`.

    argparse converts a string default with the flag's `type`, so values from the environment are
    parsed (and refused) exactly like command-line ones.
    """

    def flag(name: str, default: Any = None, **kw: Any) -> None:
        env = prefix + name.lstrip("-").replace("-", "_").upper()
        kw["help"] = f"{kw.get('help', '')} [env {env}]".strip()
        value = os.environ.get(env, default)
        p.add_argument(name, default=value, required=kw.pop("required", False) and value is None, **kw)

    return flag


# Mutual TLS (`shardmesh.rpc.tls`): the same three flags on every service and tool. A tool falls back to these
# variables; a service reads its own (SHARDMESH_COORDINATOR_TLS_CERT, ...), as for every service flag.
TLS_ENV = {"tls_cert": "SHARDMESH_TLS_CERT", "tls_key": "SHARDMESH_TLS_KEY", "tls_ca": "SHARDMESH_TLS_CA"}


def add_tls_flags(flag: Callable[..., None], role: str) -> None:
    """`--tls-cert`, `--tls-key`, `--tls-ca` on a service's parser (`flag` from `env_flags`); `role` names the
    service ("the coordinator")."""
    flag("--tls-cert", help=f"PEM certificate {role} presents, as a server and to the peers it dials; with --tls-key "
         "and --tls-ca every gRPC connection is mutual TLS and a peer without a certificate signed by the CA is "
         "refused at the handshake; re-read when it changes (default: plaintext; see `shardmesh certs "
         "init`)")  # fmt: skip
    flag("--tls-key", help="the private key of --tls-cert (PEM)")
    flag("--tls-ca", help="the mesh's CA certificate (PEM): a peer's certificate must be signed by it")


def add_client_tls_flags(p: argparse.ArgumentParser) -> None:
    """The same three flags on a tool (status, drain, top, generate --gateway), defaulting to $SHARDMESH_TLS_*."""
    p.add_argument("--tls-cert", default=os.environ.get(TLS_ENV["tls_cert"]),
                   help="client certificate for a mesh that runs mutual TLS, e.g. client.pem of `shardmesh certs "
                        f"init` (default: ${TLS_ENV['tls_cert']})")  # fmt: skip
    p.add_argument("--tls-key", default=os.environ.get(TLS_ENV["tls_key"]),
                   help=f"its private key (default: ${TLS_ENV['tls_key']})")  # fmt: skip
    p.add_argument("--tls-ca", default=os.environ.get(TLS_ENV["tls_ca"]),
                   help=f"the mesh's CA certificate (default: ${TLS_ENV['tls_ca']})")  # fmt: skip


JOIN_TOKEN_ENV = "SHARDMESH_JOIN_TOKEN"  # the join token itself, for every service (`--join-token-file` wins)


def mesh_security(args: argparse.Namespace, logger: Any = None) -> tuple[Any, Any, str | None]:
    """What a service's shared security flags say: (its `TlsFiles` or None, the join tokens it accepts as a
    `TokenSource` or None, the join token it presents or None), from `--tls-cert/--tls-key/--tls-ca`,
    `--join-token-file` and $SHARDMESH_JOIN_TOKEN. Unusable files are a `UsageError` naming the flag."""
    from shardmesh.rpc import tls, tokens

    env = tokens.env_value(JOIN_TOKEN_ENV)
    file = getattr(args, "join_token_file", None)
    try:
        files = tls.from_args(args)
        accepted = tokens.TokenSource.optional("join token", [env] if env else [], file, flag="--join-token-file",
                                               logger=logger)  # fmt: skip
        presented = tokens.presented(env, file, "--join-token-file")
    except (tls.TlsError, tokens.TokenError) as e:
        raise UsageError(str(e)) from None
    return files, accepted, presented
