"""Where a node holds the model, in each form ``[vllm] model`` may name it.

- A plain directory of files: that directory is the model's tree.
- A Hugging Face snapshot, ``.../models--ORG--NAME/snapshots/<revision>`` (``hf download``
  writes its files as relative links into ``../../blobs/``): the tree is the ``models--``
  directory, which is what a container must get for the links to resolve; vLLM serves the
  snapshot.
- The ``models--ORG--NAME`` directory itself, or a repo id ``ORG/NAME`` with ``[vllm]
  hf_cache`` naming the hub directory: the revision is the one ``refs/main`` names on each node;
  vLLM resolves it itself from the cache (offline: the files we checked are the ones served).

The tree is mounted read-only at its own path; its files (the manifest, what a sync copies)
are those of the one revision, with paths relative to the tree.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
CACHE_DIR = re.compile(r"^models--([A-Za-z0-9][A-Za-z0-9._-]*)--([A-Za-z0-9][A-Za-z0-9._-]*)$")
REF = "refs/main"
# vLLM and huggingface_hub read the cache without asking the Hub (nothing is downloaded at night).
OFFLINE = "HF_HUB_OFFLINE"
HUB_CACHE = "HF_HUB_CACHE"


@dataclass(frozen=True)
class ModelSource:
    tree: str  # the directory mounted and synced: a plain directory, or models--ORG--NAME
    revision: str | None = None  # a snapshot named in the configuration
    repo_id: str | None = None  # ORG/NAME, for the forms vLLM resolves from the cache

    @property
    def cached(self) -> bool:
        """The revision is refs/main's on each node (vLLM resolves it)."""
        return self.repo_id is not None

    @property
    def hf_layout(self) -> bool:
        return self.revision is not None or self.cached

    @property
    def snapshot(self) -> str | None:
        if self.revision is None:
            return None
        return posixpath.join(self.tree, "snapshots", self.revision)

    @property
    def serve(self) -> str:
        """What `vllm serve` gets (and, as vLLM does, the served name unless one is set)."""
        return self.repo_id or self.snapshot or self.tree

    def env(self) -> dict[str, str]:
        if not self.cached:
            return {}
        return {HUB_CACHE: posixpath.dirname(self.tree), OFFLINE: "1"}

    def mount(self) -> str:
        return f"{self.tree}:{self.tree}:ro"

    def where(self) -> str:
        """The model's files as a person looks for them."""
        if self.cached:
            return f"{self.tree} (the revision its {REF} names)"
        return self.snapshot or self.tree

    def listing_script(self, stage: str) -> str:
        """A shell script (the tree is ``$1``) that prints records, each ended by a NUL (the
        one byte no file name holds; a newline, a ``\\r`` or a tab may be in one): first
        ``T<tab>tree``, its canonical path; per link ``L<tab>path`` then ``target``
        (``readlink -e``: empty when it dangles); then, unless a link dangles or leaves the
        tree (exit 4: nothing is followed out of it), per file of the model, links followed,
        ``F<tab>size<tab>mtime<tab>path``. In the Hugging Face layout, first each file of
        ``blobs/`` as ``B<tab>size<tab>name`` and the target of every snapshot's link (of
        every revision) as ``U<tab>target``, then ``R<tab>revision``: the snapshot listed.
        Exit 3: the tree, or its revision, is not there. Paths are relative to the tree;
        files a cut copy left under ``stage`` are listed too."""
        if self.cached:
            parts = (
                "rev=$(cat -- refs/main 2>/dev/null)\n"
                'case $rev in ""|*[!A-Za-z0-9._-]*|.|..) exit 3;; esac\n'
                'need="snapshots/$rev"; set -- refs/main "$need"\n'
            )
        elif self.revision:
            parts = f'need={shlex.quote("snapshots/" + self.revision)}; set -- "$need"\n'
        else:
            parts = "need=.; set -- .\n"
        if self.hf_layout:
            # The blob store, even where the revision is not there: its contents are named by
            # their hashes, so equal bytes are seen without reading them.
            parts = (
                "find blobs -mindepth 1 -maxdepth 1 -type f -printf 'B\\t%s\\t%f\\0' "
                "2>/dev/null\n"
                "find snapshots -type l -printf 'U\\t%l\\0' 2>/dev/null\n"
                + parts
                + "printf 'R\\t%s\\0' \"${need#snapshots/}\"\n"
            )
        # A plain directory's walk from "." takes its stage in; a revision's does not.
        staged = (
            f'[ -d {shlex.quote(stage)} ] && set -- "$@" {shlex.quote(stage)}\n'
            if self.hf_layout
            else ""
        )
        return (
            'cd -- "$1" 2>/dev/null || exit 3\n'
            f"{parts}"
            '[ -d "$need" ] || exit 3\n'
            "tree=$(pwd -P)\n"
            "printf 'T\\t%s\\0' \"$tree\"\n"
            f"{staged}"
            'find "$@" -type l -exec sh -c \''
            't=$1; shift; bad=0; for l; do r=$(readlink -e -- "$l"); '
            'printf "L\\t%s\\0%s\\0" "$l" "$r"; '
            'case $r/ in "$t"/*) ;; *) bad=1;; esac; done; exit $bad'
            '\' sh "$tree" {} + || exit 4\n'
            "find -L \"$@\" -type f -printf 'F\\t%s\\t%T@\\t%p\\0' 2>/dev/null\n"
            "exit 0\n"
        )


def model_source(model: str, hf_cache: str | None) -> ModelSource:
    """``[vllm] model`` (and ``[vllm] hf_cache``) read as one of the forms above; ValueError,
    in words for the operator, when it names none."""
    if REPO_ID.fullmatch(model):
        if hf_cache is None:
            raise ValueError(
                f"[vllm] model {model!r} is a Hugging Face repo id, so the nodes must hold it in "
                "a Hugging Face cache: set [vllm] hf_cache to that cache's hub directory (where "
                "`hf download` put it, e.g. /home/nvidia/.cache/huggingface/hub), or set model "
                "to the model's directory"
            )
        org, name = model.split("/")
        return ModelSource(posixpath.join(hf_cache, f"models--{org}--{name}"), None, model)
    path = posixpath.normpath(model)
    if not model.startswith("/"):
        raise ValueError(
            f"[vllm] model {model!r} is neither an absolute directory nor a repo id ORG/NAME"
        )
    parent, revision = posixpath.split(path)
    tree, snapshots = posixpath.split(parent)
    if snapshots == "snapshots" and CACHE_DIR.fullmatch(posixpath.basename(tree)):
        return ModelSource(tree, revision)
    if found := CACHE_DIR.fullmatch(posixpath.basename(path)):
        return ModelSource(path, None, f"{found.group(1)}/{found.group(2)}")
    return ModelSource(path)


def link_problems(tree: str, links: dict[str, str]) -> list[str]:
    """The links of the model that a container or a copy cannot follow safely: dangling ones,
    and ones that resolve outside ``tree`` (canonical), which no copy may carry to the nodes."""
    problems = []
    inside = tree.rstrip("/") + "/"
    for path, target in sorted(links.items()):
        if not target:
            problems.append(f"{path} is a dangling link (its target is not there)")
        elif not (target + "/").startswith(inside):
            problems.append(f"{path} links outside the model's directory, to {target}")
    return problems
