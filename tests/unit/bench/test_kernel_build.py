"""bench/kernel_build.py: its table (each kernel's median over rounds, the ratio of the ways, the total), the header
its baseline compiles against, and its refusal of kernels it does not know."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench import kernel_build

ROOT = Path(__file__).resolve().parents[3]


def test_the_table_sets_each_kernel_against_its_extension_h_build_of_the_same_round() -> None:
    rounds = [{"link": {"lean": 10.0, "extension.h": 30.0}, "cpu": {"lean": 30.0, "extension.h": 50.0}},
              {"link": {"lean": 14.0, "extension.h": 28.0}, "cpu": {"lean": 26.0, "extension.h": 52.0}}]  # fmt: skip
    md, data = kernel_build.report({"date": "2026-11-30", "cpu": "cpu", "cpu_id": "id", "cores": 2, "torch": "t"},
                                   ["link", "cpu"], rounds)  # fmt: skip
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| ")}
    assert rows["link"] == "| link | 12.0 | 29.0 | 0.42× |"  # ratios 1/3 and 1/2: median 0.42
    assert rows["cpu"] == "| cpu | 28.0 | 51.0 | 0.55× |"  # ratios 0.6 and 0.5
    assert data["total"] == {"lean": 40.0, "extension.h": 80.0} and "| **0.50×** |" in md


def test_the_baseline_puts_torch_extension_h_first_and_the_lean_build_does_not(monkeypatch) -> None:
    from shardmesh.engine import native

    lean = kernel_build.kernel("link").bound_source
    assert lean.startswith(native.HEADERS) and "torch/extension.h" not in lean
    seen: list[str] = []

    def module(self: native.InlineKernel) -> object:
        seen.append(self.bound_source)
        return object()

    monkeypatch.setattr(native.InlineKernel, "module", module)
    monkeypatch.setattr(native, "HEADERS", native.HEADERS)  # restored after the child's change below
    assert kernel_build.child("link", "extension.h")["seconds"] >= 0
    assert seen[0].startswith("#include <torch/extension.h>\n" + lean)


def test_an_unknown_kernel_is_refused_before_anything_is_built() -> None:
    r = subprocess.run([sys.executable, "bench/kernel_build.py", "--kernels", "link,gemm"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--kernels" in r.stderr and "gemm" in r.stderr
