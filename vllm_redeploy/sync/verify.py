"""``--verify``: the model files of the same size on the source and a target, compared by
content (SHA-256 on each node; only the digests travel), whatever their modification times. A
file found equal gets the source's time on the target, so that the next run, which compares
sizes and times, agrees and copies nothing."""

from __future__ import annotations

from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.sync.manifest import FileEntry
from vllm_redeploy.sync.plan import Holdings

# One digest per path on stdin (NUL-ended), in order, each NUL-ended (empty for a file that
# cannot be read): the paths never come back, so no byte of a name is parsed from the output.
HASH = (
    'cd -- "$1" && xargs -0 -r -n 1 sh -c '
    '\'d=$(sha256sum < "$0") && printf "%s\\0" "${d%% *}" || printf "\\0"\''
)
# Each NUL-ended (path, seconds) pair on stdin: the file's modification time set (links followed,
# as the listing follows them: a snapshot's link stands for its blob).
RETIME = (
    'cd -- "$1" && while IFS= read -r -d "" p && IFS= read -r -d "" t; do '
    'touch -m -d "@$t" -- "$p" || exit 1; done'
)
HASH_TIMEOUT_S = 24 * 3600.0  # 122 GB at a disk's 1-3 GB/s is minutes; a slow disk, an hour


def digests(access: NodeAccess, model: str, paths: list[str]) -> dict[str, str]:
    if not paths:
        return {}
    names = b"".join(p.encode() + b"\0" for p in paths)
    found = access.runner.run(
        ["sh", "-c", HASH, "sh", model], stdin=names, timeout=HASH_TIMEOUT_S, check=False
    )
    sums = found.stdout.split("\0")[: len(paths)]
    if len(sums) < len(paths):  # cut short: what has no digest counts as differing
        return {}
    return {path: digest for path, digest in zip(paths, sums, strict=True) if digest}


def differing(
    source: NodeAccess, targets: dict[str, NodeAccess], model: str, held: list[Holdings]
) -> dict[str, set[str]]:
    """Per target, the files of the same size as the source's whose content differs."""
    by_node = {h.node: h for h in held}
    mine = by_node[source.name].model.files
    alike = {
        name: [
            p for p, entry in mine.items() if _same_size(entry, by_node[name].model.files.get(p))
        ]
        for name in targets
    }
    wanted = sorted({p for paths in alike.values() for p in paths})
    reference = digests(source, model, wanted)
    found = {}
    for name, access in targets.items():
        theirs = digests(access, model, alike[name])
        # A file without a digest on either side (unreadable, gone) is never taken as equal.
        found[name] = {p for p in alike[name] if not theirs.get(p) or theirs[p] != reference.get(p)}
    return found


def _same_size(entry: FileEntry, held: FileEntry | None) -> bool:
    return held is not None and held.size == entry.size


def equal_but_retimed(
    source: str, held: list[Holdings], suspect: dict[str, set[str]]
) -> dict[str, dict[str, int]]:
    """Per target, the files ``--verify`` found equal whose time differs from the source's:
    path -> the source's time."""
    by_node = {h.node: h for h in held}
    mine = by_node[source].model.files
    found = {}
    for name, differs in suspect.items():
        theirs = by_node[name].model.files
        found[name] = {
            p: entry.mtime
            for p, entry in mine.items()
            if _same_size(entry, theirs.get(p)) and p not in differs
            and theirs[p].mtime != entry.mtime
        }  # fmt: skip
    return found


def set_times(access: NodeAccess, model: str, times: dict[str, int]) -> None:
    """Give each file of ``times`` on the node its time (the source's)."""
    if not times:
        return
    pairs = b"".join(f"{p}\0{t}\0".encode() for p, t in sorted(times.items()))
    access.runner.run(["bash", "-c", RETIME, "bash", model], stdin=pairs, timeout=600)
