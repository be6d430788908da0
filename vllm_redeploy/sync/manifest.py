"""A model directory's files as one node holds them: path, size, modification time.

Files a copy has received but not yet put in place wait under ``STAGE`` inside the model
directory (same filesystem: putting one in place is a rename). A copy cut halfway leaves the
files it finished there, and the next copy takes them instead of sending them again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vllm_redeploy.model_source import ModelSource, link_problems
from vllm_redeploy.safe_text import shown

STAGE = ".vllm-redeploy-incoming"
LINKS_REFUSED = 4  # the listing's exit when a link dangles or leaves the tree
SNAPSHOT = re.compile(r"^snapshots/[^/]+/")
BLOBS = "blobs"
CONTENT_NAME = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the model directory
    size: int
    mtime: int  # whole seconds: tar keeps no more

    def same_as(self, other: FileEntry | None) -> bool:
        return other is not None and (self.size, self.mtime) == (other.size, other.mtime)


@dataclass(frozen=True)
class Manifest:
    """What a node holds of the model: ``files`` in place, ``staged`` received by a cut copy,
    and the model's links (path -> canonical target, empty when dangling) within ``tree``."""

    present: bool
    files: dict[str, FileEntry]
    staged: dict[str, FileEntry]
    links: dict[str, str] = field(default_factory=dict)
    tree: str = ""
    outside: tuple[str, ...] = ()  # listed paths that are not inside the tree: never copied
    # The Hugging Face layout: the blob store's files (name -> size) and the revision listed.
    blobs: dict[str, int] = field(default_factory=dict)
    revision: str | None = None
    linked: frozenset[str] = frozenset()  # the blobs a snapshot (of any revision) links to

    def unlinked(self) -> dict[str, int]:
        """The blobs no snapshot links to any more (name -> size): the model held twice."""
        return {name: size for name, size in self.blobs.items() if name not in self.linked}

    def blob_of(self, path: str) -> str | None:
        """The blob whose contents the file ``path`` is (a snapshot's link into ``blobs/``),
        when that blob is named by its hash (the hub names each by its SHA-256, or a small
        file by its git SHA-1): equal names are equal bytes."""
        target = self.links.get(path, "")
        name = target.removeprefix(f"{self.tree}/{BLOBS}/")
        return name if self.tree and name != target and CONTENT_NAME.fullmatch(name) else None

    @property
    def weights_bytes(self) -> int | None:
        """The safetensors files of the model (its top level and one below), in all."""
        sizes = [
            f.size
            for f in self.files.values()
            if f.path.endswith(".safetensors") and SNAPSHOT.sub("", f.path).count("/") <= 1
        ]
        return sum(sizes) if sizes else None

    def link_problems(self) -> list[str]:
        """What no container or copy may follow: unsafe links, and listed paths outside the
        tree (a hostile listing: the source's tar would read them into a target's stage)."""
        found = link_problems(self.tree, self.links) if self.tree else []
        return found + [
            f"{shown(p)} is listed, outside the model's directory" for p in self.outside
        ]


def manifest_argv(source: ModelSource) -> list[str]:
    """Every file of the model (links followed: a Hugging Face snapshot links its files into a
    blob store) and every link, in one answer (ModelSource.listing_script)."""
    return ["sh", "-c", source.listing_script(STAGE), "sh", source.tree]


def parse_manifest(out: str, exit_code: int) -> Manifest:
    """The listing's answer (NUL-ended records: ModelSource.listing_script); a tree (or
    revision) that is not there (exit 3) is absent. A listed path that is absolute or climbs
    out of the tree (``..``) is never taken as the model's: it is kept in ``outside``."""
    files: dict[str, FileEntry] = {}
    staged: dict[str, FileEntry] = {}
    links: dict[str, str] = {}
    outside: list[str] = []
    blobs: dict[str, int] = {}
    linked: set[str] = set()
    revision = None
    tree = ""
    records = iter(out.split("\0"))
    for record in records:
        kind, _, rest = record.partition("\t")
        if kind == "T":
            tree = rest
        elif kind == "R":
            revision = rest or None
        elif kind == "B":
            size, _, name = rest.partition("\t")
            if size.isdigit() and CONTENT_NAME.fullmatch(name):
                blobs[name] = int(size)
        elif kind == "U":
            # Any link whose target is a name in a blobs/ directory keeps that blob: a blob is
            # counted as unlinked only when nothing could name it.
            directory, _, name = rest.rpartition("/")
            if directory.rpartition("/")[2] == BLOBS:
                linked.add(name)
        elif kind == "L":
            target = next(records, "")
            if _inside(path := rest.removeprefix("./")):
                links[path] = target
            else:
                outside.append(rest)
        elif kind == "F":
            size, _, rest = rest.partition("\t")
            mtime, _, raw = rest.partition("\t")
            path = raw.removeprefix("./")
            if not size.isdigit() or not raw:
                continue
            if not _inside(path):
                outside.append(raw)
            elif path.startswith(f"{STAGE}/"):
                entry = FileEntry(path.removeprefix(f"{STAGE}/"), int(size), int(float(mtime)))
                staged[entry.path] = entry
            else:
                files[path] = FileEntry(path, int(size), int(float(mtime)))
    present = exit_code in (0, LINKS_REFUSED) or bool(files)
    return Manifest(
        present, files, staged, links, tree, tuple(outside), blobs, revision, frozenset(linked)
    )


def _inside(path: str) -> bool:
    """Is ``path`` (as listed, relative to the tree) a path inside it?"""
    return bool(path) and not path.startswith("/") and ".." not in path.split("/")


NO_MODEL = Manifest(False, {}, {})
