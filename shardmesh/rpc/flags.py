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
