"""`vllm-redeploy sync`: the source node's image and model onto the nodes that lack them, by
hand, with a bar per node (the flow does the same as its step "sync")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from deployments.cli.common import (
    EVERYDAY,
    EXIT_FAILED,
    ConfigOption,
    app,
    err,
    load_or_exit,
    markup_safe,
    out,
)
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.nodes import NodeAccess, RemoteError, fan_out
from vllm_redeploy.sync import (
    Copied,
    Holdings,
    Route,
    SyncNeed,
    human_bytes,
    plan_sync,
    planned_bytes,
    route_between,
    survey,
    sync_target,
)
from vllm_redeploy.sync.prune import prune as remove_unlinked
from vllm_redeploy.sync.prune import unlinked_words
from vllm_redeploy.sync.verify import differing, equal_but_retimed, set_times


@app.command(rich_help_panel=EVERYDAY)
def sync(
    config: ConfigOption = Path("cluster.toml"),
    image: Annotated[
        bool, typer.Option("--image", help="The image only (with --model: both).")
    ] = False,
    model: Annotated[
        bool, typer.Option("--model", help="The model only (with --image: both).")
    ] = False,
    verify: Annotated[
        bool,
        typer.Option("--verify", help="Also compare the model's files by content (SHA-256)."),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be copied, change nothing.")
    ] = False,
    prune: Annotated[
        bool,
        typer.Option(
            "--prune",
            help="Also remove the blobs of a Hugging Face cache that no snapshot links to.",
        ),
    ] = False,
) -> None:
    """Copy the source node's image and model (default: the head's) to every node that lacks
    them or holds another build or other files; files only a target holds are kept."""
    cluster = _choosing(load_or_exit(config), image, model)
    accesses = {n.name: NodeAccess(n, cluster) for n in cluster.nodes}
    try:
        _sync(cluster, accesses, verify, dry_run)
        if cluster.sync.model == "auto" and cluster.vllm.source.hf_layout:
            _unlinked(cluster, accesses, prune and not dry_run)
    except RemoteError as exc:
        err.print(f"sync failed: {markup_safe(exc)}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED) from None
    finally:
        for access in accesses.values():
            access.close()


def _choosing(cluster: ClusterConfig, image: bool, model: bool) -> ClusterConfig:
    """By hand, the flags choose (neither: both), whatever [sync] says for the flow."""
    both = not image and not model
    chosen = cluster.sync.model_copy(
        update={
            "image": "auto" if image or both else "off",
            "model": "auto" if model or both else "off",
        }
    )
    return cluster.model_copy(update={"sync": chosen})


def _sync(
    cluster: ClusterConfig, accesses: dict[str, NodeAccess], verify: bool, dry_run: bool
) -> None:
    surveyed = fan_out(cluster.nodes, lambda n: survey(accesses[n.name], cluster))
    failed = [o.error for o in surveyed if o.error is not None]
    if failed:
        raise failed[0]
    held: list[Holdings] = [o.value for o in surveyed if o.value is not None]
    source = accesses[cluster.sync_source.name]
    suspect = None
    if verify and cluster.sync.model == "auto":
        others = {name: a for name, a in accesses.items() if name != source.name}
        suspect = differing(source, others, cluster.vllm.source.tree, held)
    plan = plan_sync(cluster, held, suspect)
    for problem in plan.problems:
        err.print(f"[red]{markup_safe(problem)}[/]", highlight=False, soft_wrap=True)
    if suspect is not None:
        _retime(cluster, accesses, equal_but_retimed(source.name, held, suspect), dry_run)
    if not plan.needs:
        out.print(f"every node holds what {plan.source} holds: nothing to copy")
        if plan.problems:
            raise typer.Exit(EXIT_FAILED)
        return
    image_id = next(h.image_id for h in held if h.node == plan.source)
    routes = {
        need.target: route_between(source, accesses[need.target], cluster) for need in plan.needs
    }
    for need in plan.needs:
        out.print(
            f"{markup_safe(need.describe(cluster.vllm.image))}, {markup_safe(routes[need.target])}",
            highlight=False,
            soft_wrap=True,
        )
    if dry_run:
        out.print("dry run: nothing was copied")
        return
    copied = _copy_all(cluster, accesses, plan.needs, image_id, routes)
    for c in copied:
        already = f", {human_bytes(c.already)} already there" if c.what == "model" else ""
        out.print(
            f"{c.target}: {c.what}, {human_bytes(c.bytes)} in {c.seconds:.1f} s ({c.rate})"
            f"{already}",
            highlight=False,
        )


def _unlinked(cluster: ClusterConfig, accesses: dict[str, NodeAccess], prune: bool) -> None:
    """Each node's blobs that no snapshot links to, as the nodes hold them now (after the
    copies: a blob the copy linked again is kept); removed with ``prune``."""
    tree = cluster.vllm.source.tree
    surveyed = fan_out(cluster.nodes, lambda n: survey(accesses[n.name], cluster))
    for found in surveyed:
        if found.value is None:
            continue
        words = unlinked_words(found.value.node, tree, found.value.model)
        if words is None:
            continue
        if prune:
            freed = remove_unlinked(accesses[found.value.node], tree, found.value.model)
            out.print(f"{markup_safe(words)}: removed, {human_bytes(freed)} freed", highlight=False)
        else:
            out.print(
                f"{markup_safe(words)}: `vllm-redeploy sync --prune` removes them", highlight=False
            )


def _retime(
    cluster: ClusterConfig,
    accesses: dict[str, NodeAccess],
    retimed: dict[str, dict[str, int]],
    dry_run: bool,
) -> None:
    """The files equal by content but of another time get the source's time on the target
    (not on a dry run): the next run compares times, and would copy them all again."""
    for name, times in sorted(retimed.items()):
        if not times:
            continue
        if not dry_run:
            set_times(accesses[name], cluster.vllm.source.tree, times)
        done = "would get" if dry_run else "got"
        out.print(
            f"{name}: {len(times)} file(s) equal by content {done} the source's times",
            highlight=False,
        )


def _copy_all(
    cluster: ClusterConfig,
    accesses: dict[str, NodeAccess],
    needs: tuple[SyncNeed, ...],
    image_id: str | None,
    routes: dict[str, Route],
) -> list[Copied]:
    source = accesses[cluster.sync_source.name]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=out, transient=False) as bars:

        def one(need: SyncNeed) -> list[Copied]:
            total = planned_bytes(source, need, cluster.vllm.image if image_id else None)
            bar = bars.add_task(need.target, total=total or None)
            copied = sync_target(
                source,
                accesses[need.target],
                cluster,
                need,
                image_id,
                routes[need.target],
                lambda done: bars.update(bar, completed=done),
            )
            bars.update(
                bar,
                completed=sum(c.bytes for c in copied),
                total=sum(c.bytes for c in copied) or None,
            )
            return copied

        with ThreadPoolExecutor(max_workers=len(needs)) as pool:
            futures = [pool.submit(one, need) for need in needs]
            return [c for f in futures for c in f.result()]
