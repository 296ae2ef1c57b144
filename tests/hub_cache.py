"""A Hugging Face hub cache built by hand, laid out as `huggingface_hub` writes it, for tests that resolve models
by id without a network:

    <cache>/models--ORG--NAME/blobs/<sha256>                   file contents, once each
    <cache>/models--ORG--NAME/snapshots/<commit>/<file>        relative symlinks to ../../blobs/<sha256>
    <cache>/models--ORG--NAME/refs/<branch or tag>             the commit it points at (no newline)
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def commit_of(label: str) -> str:
    """A 40-hex commit id (the hub cache takes a revision of that form as a commit, not a branch)."""
    return hashlib.sha1(label.encode()).hexdigest()


def add_revision(cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 skip: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """Put the files of directory `source` (but `skip`) in the cache as `repo_id` at `commit`, named by `refs`;
    returns the snapshot directory."""
    repo = repo_folder(cache, repo_id)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(source.iterdir()):
        if f.name in skip or not f.is_file():
            continue
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        if not (repo / "blobs" / blob).exists():
            (repo / "blobs" / blob).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
