"""`vllm-redeploy sync`: the source node's image and model onto the nodes that lack them, by
hand, with a bar per node (the flow does the same as its step "sync")."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

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
    JsonOption,
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
    as_json: JsonOption = False,
) -> None:
    """Copy the source node's image and model (default: the head's) to every node that lacks
    them or holds another build or other files; files only a target holds are kept."""
    cluster = _choosing(load_or_exit(config), image, model)
    accesses = {n.name: NodeAccess(n, cluster) for n in cluster.nodes}
    report = SyncReport(cluster.name, cluster.sync_source.name, dry_run, as_json)
    report.nodes = {n.name: NodeSync(n.name) for n in cluster.nodes}
    try:
        _sync(cluster, accesses, verify, report)
        if cluster.sync.model == "auto" and cluster.vllm.source.hf_layout:
            _unlinked(cluster, accesses, prune and not dry_run, report)
    except RemoteError as exc:
        report.error = str(exc)
        if not as_json:
            err.print(f"sync failed: {markup_safe(exc)}", highlight=False, soft_wrap=True)
    finally:
        for access in accesses.values():
            access.close()
    if as_json:
        out.print_json(json.dumps(report.as_dict()))
    if report.error is not None or report.problems:
        raise typer.Exit(EXIT_FAILED)


@dataclass
class NodeSync:
    """What one node got (or, on a dry run, would get) from the source."""

    name: str
    image: str | None = None  # why the image is copied; None: it is not
    model_files: int = 0  # the model's files to send
    model_bytes: int = 0
    route: str | None = None
    copied: list[dict[str, Any]] = field(default_factory=list)  # what, bytes, seconds, already
    retimed: int = 0  # files equal by content that got the source's times (--verify)
    unlinked_blobs: int = 0  # a Hugging Face cache's blobs no snapshot links to
    unlinked_bytes: int = 0
    freed_bytes: int = 0  # removed by --prune


@dataclass
class SyncReport:
    """`sync --json`: one object, whatever was copied."""

    cluster: str
    source: str
    dry_run: bool
    as_json: bool
    nodes: dict[str, NodeSync] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    error: str | None = None

    def say(self, text: object) -> None:
        """A line for the person (none with --json): markup-free, as the nodes said it."""
        if not self.as_json:
            out.print(markup_safe(text), highlight=False, soft_wrap=True)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["as_json"]
        data["nodes"] = [asdict(n) for n in self.nodes.values()]
        return data


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
    cluster: ClusterConfig, accesses: dict[str, NodeAccess], verify: bool, report: SyncReport
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
    report.problems += plan.problems
    for problem in plan.problems:
        if not report.as_json:
            err.print(f"[red]{markup_safe(problem)}[/]", highlight=False, soft_wrap=True)
    if suspect is not None:
        _retime(cluster, accesses, equal_but_retimed(source.name, held, suspect), report)
    if not plan.needs:
        report.say(f"every node holds what {plan.source} holds: nothing to copy")
        return
    image_id = next(h.image_id for h in held if h.node == plan.source)
    routes = {
        need.target: route_between(source, accesses[need.target], cluster) for need in plan.needs
    }
    for need in plan.needs:
        node = report.nodes[need.target]
        node.image = need.image or None
        node.model_files, node.model_bytes = len(need.files), need.model_bytes
        node.route = str(routes[need.target])
        report.say(f"{need.describe(cluster.vllm.image)}, {routes[need.target]}")
    if report.dry_run:
        report.say("dry run: nothing was copied")
        return
    copied = _copy_all(cluster, accesses, plan.needs, image_id, routes, report.as_json)
    for c in copied:
        report.nodes[c.target].copied.append(
            {"what": c.what, "bytes": c.bytes, "seconds": round(c.seconds, 3), "already": c.already}
        )
        already = f", {human_bytes(c.already)} already there" if c.what == "model" else ""
        report.say(
            f"{c.target}: {c.what}, {human_bytes(c.bytes)} in {c.seconds:.1f} s ({c.rate}){already}"
        )


def _unlinked(
    cluster: ClusterConfig, accesses: dict[str, NodeAccess], prune: bool, report: SyncReport
) -> None:
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
        node = report.nodes[found.value.node]
        blobs = found.value.model.unlinked()
        node.unlinked_blobs, node.unlinked_bytes = len(blobs), sum(blobs.values())
        if prune:
            node.freed_bytes = remove_unlinked(accesses[node.name], tree, found.value.model)
            report.say(f"{words}: removed, {human_bytes(node.freed_bytes)} freed")
        else:
            report.say(f"{words}: `vllm-redeploy sync --prune` removes them")


def _retime(
    cluster: ClusterConfig,
    accesses: dict[str, NodeAccess],
    retimed: dict[str, dict[str, int]],
    report: SyncReport,
) -> None:
    """The files equal by content but of another time get the source's time on the target
    (not on a dry run): the next run compares times, and would copy them all again."""
    for name, times in sorted(retimed.items()):
        if not times:
            continue
        if not report.dry_run:
            set_times(accesses[name], cluster.vllm.source.tree, times)
        report.nodes[name].retimed = len(times)
        done = "would get" if report.dry_run else "got"
        report.say(f"{name}: {len(times)} file(s) equal by content {done} the source's times")


def _copy_all(
    cluster: ClusterConfig,
    accesses: dict[str, NodeAccess],
    needs: tuple[SyncNeed, ...],
    image_id: str | None,
    routes: dict[str, Route],
    quiet: bool,
) -> list[Copied]:
    source = accesses[cluster.sync_source.name]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=out, transient=False, disable=quiet) as bars:

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
