"""``--verify``: the model files of the same size on the source and a target, compared by
content (SHA-256 on each node; only the digests travel), whatever their modification times."""

from __future__ import annotations

from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.sync.manifest import FileEntry
from vllm_redeploy.sync.plan import Holdings

HASH = 'cd -- "$1" && xargs -0 sha256sum --'
HASH_TIMEOUT_S = 24 * 3600.0  # 122 GB at a disk's 1-3 GB/s is minutes; a slow disk, an hour


def digests(access: NodeAccess, model: str, paths: list[str]) -> dict[str, str]:
    if not paths:
        return {}
    names = b"".join(p.encode() + b"\0" for p in paths)
    found = access.runner.run(
        ["sh", "-c", HASH, "sh", model], stdin=names, timeout=HASH_TIMEOUT_S, check=False
    )
    sums = {}
    for line in found.stdout.splitlines():
        digest, _, path = line.partition("  ")
        if path:
            sums[path] = digest
    return sums


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
    return {
        name: {p for p, d in digests(access, model, alike[name]).items() if d != reference.get(p)}
        for name, access in targets.items()
    }


def _same_size(entry: FileEntry, held: FileEntry | None) -> bool:
    return held is not None and held.size == entry.size
