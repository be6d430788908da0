"""The blobs of a Hugging Face cache that no snapshot links to any more (a revision replaced, a
snapshot deleted by hand): the model held twice. Listed by every `sync`; removed only when the
operator asks (`sync --prune`), never by a run."""

from __future__ import annotations

from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.safe_text import one_line
from vllm_redeploy.sync.copy import SyncFailed
from vllm_redeploy.sync.manifest import BLOBS, Manifest
from vllm_redeploy.sync.plan import human_bytes

# $1: the model's tree; the rest: names in its blobs/ (content names: no slash, no dot-dot).
REMOVE = 'cd -- "$1/blobs" || exit 1; shift; rm -f -- "$@"'


def unlinked_words(node: str, tree: str, model: Manifest) -> str | None:
    """One line on the node's unlinked blobs; None when there are none."""
    blobs = model.unlinked()
    if not blobs:
        return None
    names = sorted(blobs)
    shown = ", ".join(n[:12] for n in names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    return (
        f"{node}: {len(blobs)} blob(s) in {tree}/{BLOBS} that no snapshot links to, "
        f"{human_bytes(sum(blobs.values()))} ({shown})"
    )


def prune(access: NodeAccess, tree: str, model: Manifest) -> int:
    """Remove the node's unlinked blobs; the bytes freed."""
    blobs = model.unlinked()
    if not blobs:
        return 0
    done = access.runner.run(["sh", "-c", REMOVE, "sh", tree, *sorted(blobs)], check=False)
    if not done.ok:
        raise SyncFailed(
            access.name,
            f"could not remove the unlinked blobs in {tree}/{BLOBS} on {access.name}: "
            f"{one_line(done.stderr or done.stdout or f'exit code {done.exit_code}')}",
        )
    return sum(blobs.values())
