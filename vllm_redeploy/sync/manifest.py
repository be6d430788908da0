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
    tree = ""
    records = iter(out.split("\0"))
    for record in records:
        kind, _, rest = record.partition("\t")
        if kind == "T":
            tree = rest
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
    return Manifest(present, files, staged, links, tree, tuple(outside))


def _inside(path: str) -> bool:
    """Is ``path`` (as listed, relative to the tree) a path inside it?"""
    return bool(path) and not path.startswith("/") and ".." not in path.split("/")


NO_MODEL = Manifest(False, {}, {})
