"""Every relative link in the README and docs/ leads somewhere: the file exists, and a `#fragment` names a heading
of that file (as GitHub makes heading ids). Sections move between these files; a link left pointing at the old place
should fail here, not on a reader."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache  # a page's headings, read once however many links point into it
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()):
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def test_slug_follows_github() -> None:
    assert slug("tp=3 on two cores: at its floor (2026-11-28)") == "tp3-on-two-cores-at-its-floor-2026-11-28"
    assert slug("The `turns` boundary ÷ pp=1") == "the-turns-boundary--pp1"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{target}: no heading with that id in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)
