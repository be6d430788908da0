"""Models in the Hugging Face cache's layout, as ``hf download`` leaves them:
``HUB/models--ORG--NAME/blobs/<hash>`` holds the contents, ``snapshots/<revision>/<file>`` are
relative links into ``../../blobs/``, and ``refs/main`` names the revision."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path


def repo_dir(hub: Path, repo_id: str) -> Path:
    return hub / f"models--{repo_id.replace('/', '--')}"


def write_snapshot(hub: Path, repo_id: str, files: Mapping[str, bytes]) -> Path:
    """The model's files written as a revision of ``repo_id`` (named by their contents, as a
    commit is), ``refs/main`` pointing at it; returns the snapshot directory."""
    repo = repo_dir(hub, repo_id)
    digest = hashlib.sha1()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    revision = digest.hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def snapshot_of(directory: Path, hub: Path, repo_id: str) -> Path:
    """A plain model directory's files as a revision in ``hub``."""
    files = {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }
    return write_snapshot(hub, repo_id, files)
