"""Flags that fall back to environment variables, for services that compose runs with `environment:`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any


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
