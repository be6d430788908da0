"""What each node lacks of the source's image and model, from what every node holds."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.model_source import REF
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.sync.manifest import (
    BLOBS,
    FileEntry,
    Manifest,
    manifest_argv,
    parse_manifest,
)


@dataclass(frozen=True)
class Holdings:
    """One node's image ID under the configured tag (None: no such image) and its model files."""

    node: str
    image_id: str | None
    model: Manifest


@dataclass(frozen=True)
class SyncNeed:
    """What one target gets from the source."""

    target: str
    image: str = ""  # why the image is copied ("" : it is not)
    old_image_id: str | None = None  # the build the tag named before, kept (untagged)
    files: tuple[FileEntry, ...] = ()  # the source's files to send
    staged: tuple[str, ...] = ()  # files a cut copy left complete: put in place, not sent
    reasons: dict[str, int] = field(default_factory=dict)  # "missing": 3, "size differs": 1
    # What else a cut copy left under STAGE (a file it was receiving, or one the model no longer
    # has): removed before the copy, so it neither lingers nor takes the room the copy needs.
    partial: tuple[FileEntry, ...] = ()
    # The Hugging Face layout: the snapshot's links to make (path, relative target in blobs/),
    # the bytes of the blobs they name that the target holds already, and its revision when it
    # is not the source's.
    links: tuple[tuple[str, str], ...] = ()
    already: int = 0
    revisions: tuple[str | None, str] | None = None  # (the target's, the source's) when unlike

    @property
    def model_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def model(self) -> bool:
        return bool(self.files or self.staged or self.partial or self.links)

    def describe(self, image: str) -> str:
        parts = []
        if self.image:
            parts.append(f"image {image} ({self.image})")
        if self.model:
            why = ", ".join(f"{n} {r}" for r, n in self.reasons.items())
            staged = f", {len(self.staged)} already received" if self.staged else ""
            if self.partial:
                cut = human_bytes(sum(f.size for f in self.partial))
                staged += f", {len(self.partial)} partial ({cut}) removed first"
            if self.already:
                staged += f", {human_bytes(self.already)} already there by content"
            if self.links:
                staged += f", {len(self.links)} link(s) into its blobs"
            parts.append(
                f"model: {len(self.files)} file(s), {human_bytes(self.model_bytes)} ({why}{staged})"
            )
            if self.revisions:
                held, wanted = self.revisions
                parts.append(
                    f"revision {wanted[:12]} (the source's), where it has "
                    f"{held[:12] if held else 'none'}"
                )
        return f"{self.target}: " + "; ".join(parts)


@dataclass(frozen=True)
class SyncPlan:
    source: str
    needs: tuple[SyncNeed, ...]
    problems: tuple[str, ...]  # why something that differs cannot be copied


def plan_sync(
    config: ClusterConfig, holdings: list[Holdings], differing: dict[str, set[str]] | None = None
) -> SyncPlan:
    """The copies that make every node hold the source's image and model. ``differing``
    (``--verify``'s checksums): per node, the files of the same size whose content differs;
    given, it decides instead of the modification times."""
    source_name = config.sync_source.name
    source = next(h for h in holdings if h.node == source_name)
    image_on = config.sync.image == "auto"
    model_on = config.sync.model == "auto"
    problems = []
    if image_on and source.image_id is None and any(h.image_id for h in holdings):
        problems.append(
            f"the source {source_name} lacks the image {config.vllm.image} itself: pull it "
            "there, or name a node that holds it as sync.source"
        )
    if model_on and (bad := source.model.link_problems()):
        problems.append(
            f"the source {source_name}: {unsafe_links(config, bad)}; nothing was copied"
        )
    elif model_on and not source.model.files:
        problems.append(
            f"the source {source_name} has no file under {config.vllm.source.where()}: put "
            "the model there, or name a node that holds it as sync.source"
        )
    needs = []
    for target in holdings:
        if target.node == source_name:
            continue
        image, old = "", None
        if image_on and source.image_id and target.image_id != source.image_id:
            if target.image_id is None:
                image = "missing"
            else:
                image, old = f"another build: {target.image_id[:19]}", target.image_id
        model = _ModelNeed(source.model, target.model)
        if model_on and source.model.files:
            suspect = None if differing is None else differing.get(target.node, set())
            for entry in sorted(source.model.files.values(), key=lambda f: f.path):
                model.add(entry, suspect)
        need = SyncNeed(
            target.node,
            image,
            old,
            tuple(model.files),
            tuple(model.staged),
            model.reasons,
            model.partial(),
            tuple(model.links),
            model.already,
            model.revisions(),
        )
        if need.image or need.model:
            needs.append(need)
    return SyncPlan(source_name, tuple(needs), tuple(problems))


class _ModelNeed:
    """What one target lacks of the source's model files, taken file by file."""

    def __init__(self, source: Manifest, target: Manifest) -> None:
        self.source, self.target = source, target
        self.files: list[FileEntry] = []
        self.staged: list[str] = []
        self.reasons: dict[str, int] = {}
        self.links: list[tuple[str, str]] = []
        self.already = 0
        self.blobs: set[str] = set()  # the blobs planned or found: each is sent once
        self.revised = source.revision is not None and source.revision != target.revision

    def add(self, entry: FileEntry, suspect: set[str] | None) -> None:
        if (blob := self.source.blob_of(entry.path)) is not None:
            self._add_link(entry, blob)
        elif entry.path == REF and self.source.revision is not None:
            if self.revised:  # a file of one line: its time says nothing of its content
                self._send(entry, "another revision")
        elif why := _differs(entry, self.target, suspect):
            self._send(entry, why)

    def _add_link(self, entry: FileEntry, blob: str) -> None:
        """A snapshot's file is a link into the blob store: the blob is sent only where the
        target lacks it (same name, same bytes), and the link is made where it is not there."""
        held = self.target.blobs.get(blob) == entry.size
        if held and self.target.blob_of(entry.path) == blob:
            return
        directory = entry.path.rpartition("/")[0]
        self.links.append((entry.path, posixpath.relpath(f"{BLOBS}/{blob}", directory)))
        if blob in self.blobs:
            return
        self.blobs.add(blob)
        if held:
            self.already += entry.size
            self._count("linked to a blob already there")
        else:
            self._send(FileEntry(f"{BLOBS}/{blob}", entry.size, entry.mtime), "blob missing")

    def _send(self, entry: FileEntry, why: str) -> None:
        if entry.same_as(self.target.staged.get(entry.path)):
            self.staged.append(entry.path)
            return
        self.files.append(entry)
        self._count(why)

    def _count(self, why: str) -> None:
        self.reasons[why] = self.reasons.get(why, 0) + 1

    def revisions(self) -> tuple[str | None, str] | None:
        if not self.revised or self.source.revision is None:
            return None
        return (self.target.revision, self.source.revision)

    def partial(self) -> tuple[FileEntry, ...]:
        return tuple(e for p, e in sorted(self.target.staged.items()) if p not in self.staged)


def _differs(entry: FileEntry, model: Manifest, suspect: set[str] | None) -> str:
    held = model.files.get(entry.path)
    if held is None:
        return "missing"
    if held.size != entry.size:
        return "size differs"
    if suspect is not None:  # checksums were compared: they decide
        return "content differs" if entry.path in suspect else ""
    if held.mtime != entry.mtime:
        return "modified at another time"
    return ""


def survey(access: NodeAccess, config: ClusterConfig) -> Holdings:
    """Ask one node for its image ID and its model files."""
    found = access.runner.run(manifest_argv(config.vllm.source), check=False)
    return Holdings(
        access.name,
        access.docker.image_id(config.vllm.image),
        parse_manifest(found.stdout, found.exit_code or 0),
    )


def unsafe_links(config: ClusterConfig, problems: list[str]) -> str:
    """One sentence on the model's links that no container or copy may follow."""
    shown = "; ".join(problems[:3]) + (
        f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    )
    return (
        f"the model in {config.vllm.source.tree} has links that cannot be followed: {shown}. "
        "Every link must resolve inside the model's directory (a Hugging Face snapshot's "
        "into its models-- directory's blobs): download it again (`hf download`), or put the "
        "files themselves there"
    )


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
