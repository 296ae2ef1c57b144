"""What the deployment tests (compose, Kubernetes) share: the CLI's surface, as the files they check must match it."""

from __future__ import annotations

import argparse
import os
import re

import pytest

ENV_IN_HELP = re.compile(r"\[env ([A-Z0-9_]+)\]")  # how the flag helpers name a flag's variable in its help


def subparsers() -> dict[str, argparse.ArgumentParser]:
    from shardmesh_cli.main import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def cli_surface(sub: str) -> tuple[set[str], set[str]]:
    """(option strings, SHARDMESH_* variables) of `shardmesh SUB`, the variables as the helpers name
    them in each flag's help ("... [env SHARDMESH_WORKER_LISTEN]")."""
    parser = subparsers()[sub]
    options = {s for a in parser._actions for s in a.option_strings}
    env = {m for a in parser._actions for m in ENV_IN_HELP.findall(a.help or "")}
    return options, env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No SHARDMESH_* setting of this process leaks into a parser (the flag helpers read os.environ)."""
    for key in list(os.environ):
        if key.startswith("SHARDMESH_"):
            monkeypatch.delenv(key)
    return monkeypatch
