"""A model directory's files as one node holds them: path, size, modification time.

Files a copy has received but not yet put in place wait under ``STAGE`` inside the model
directory (same filesystem: putting one in place is a rename). A copy cut halfway leaves the
files it finished there, and the next copy takes them instead of sending them again.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGE = ".vllm-redeploy-incoming"


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the model directory
    size: int
    mtime: int  # whole seconds: tar keeps no more

    def same_as(self, other: FileEntry | None) -> bool:
        return other is not None and (self.size, self.mtime) == (other.size, other.mtime)


@dataclass(frozen=True)
class Manifest:
    """What a node holds of the model: ``files`` in place, ``staged`` received by a cut copy."""

    present: bool
    files: dict[str, FileEntry]
    staged: dict[str, FileEntry]

    @property
    def weights_bytes(self) -> int | None:
        """The safetensors files of the model (its top level and one below), in all."""
        sizes = [
            f.size
            for f in self.files.values()
            if f.path.endswith(".safetensors") and f.path.count("/") <= 1
        ]
        return sum(sizes) if sizes else None


def manifest_argv(model: str) -> list[str]:
    """Every file of the model directory (links followed: a Hugging Face snapshot links its
    files into a blob store), one per line: path, size, mtime, tab-separated."""
    return ["find", "-L", model, "-type", "f", "-printf", "%P\\t%s\\t%T@\\n"]


def parse_manifest(out: str, exit_code: int) -> Manifest:
    """``find``'s answer; a directory that is not there (non-zero exit, no line) is absent."""
    files: dict[str, FileEntry] = {}
    staged: dict[str, FileEntry] = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        path, size, mtime = parts[0], int(parts[1]), int(float(parts[2]))
        if path.startswith(f"{STAGE}/"):
            entry = FileEntry(path.removeprefix(f"{STAGE}/"), size, mtime)
            staged[entry.path] = entry
        else:
            files[path] = FileEntry(path, size, mtime)
    return Manifest(exit_code == 0 or bool(files), files, staged)


NO_MODEL = Manifest(False, {}, {})
