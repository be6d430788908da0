"""`vllm-redeploy logs`: the group's containers' logs across nodes, each line prefixed by its
node and role, without knowing a container's name; ``-f`` follows them all at once."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.text import Text

from deployments.cli.common import (
    EVERYDAY,
    EXIT_CONFIG,
    EXIT_FAILED,
    ConfigOption,
    app,
    duration_s,
    err,
    load_or_exit,
    out,
)
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.group_logs import LogSource, chosen, group_logs, read
from vllm_redeploy.nodes import RemoteError
from vllm_redeploy.safe_text import for_terminal, shown

COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red")


@app.command(rich_help_panel=EVERYDAY)
def logs(
    config: ConfigOption = Path("cluster.toml"),
    node: Annotated[
        list[str] | None,
        typer.Option("--node", metavar="NODE", help="Only this node (repeat for several)."),
    ] = None,
    role: Annotated[
        list[str] | None,
        typer.Option(
            metavar="ROLE",
            help="Only this member (repeat for several): leader or follower (vLLM's own "
            "launcher); ray-head, ray-worker or engine (Ray).",
        ),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")
    ] = False,
    since: Annotated[
        str | None,
        typer.Option(metavar="DURATION", help="Only lines of the last DURATION, e.g. 10m, 2h."),
    ] = None,
    tail: Annotated[
        str, typer.Option(metavar="N", help="The last N lines of each container, or all.")
    ] = "100",
) -> None:
    """The group's logs across nodes, each line prefixed by its node and role (the engine's,
    the ranks', Ray's), without knowing a container's name. Exit 1 when a node cannot be read."""
    cluster = load_or_exit(config)
    lines = _tail(tail)
    after = time.time() - duration_s("--since", since) if since else None
    names = [n.name for n in cluster.nodes]
    if unknown := [n for n in node or [] if n not in names]:
        _refuse(f"--node {shown(unknown[0])}: not a node of {cluster.name} (its nodes: "
                f"{', '.join(names)})", EXIT_CONFIG)  # fmt: skip
    try:
        found = group_logs(cluster)
    except KeyboardInterrupt:  # Ctrl-C while the nodes are asked: nothing to say
        _interrupted()
    if unknown := [r for r in role or [] if r not in found.roles]:
        _refuse(f"--role {shown(unknown[0])}: the group runs on {found.plan.backend}, whose "
                f"members are {', '.join(found.roles)}", EXIT_CONFIG)  # fmt: skip
    for name, why in found.unreachable:
        err.print(f"{name}: not read: {for_terminal(why)}", markup=False, highlight=False)
    sources = chosen(found, node or (), role or ())
    if not sources:
        where = ", ".join(node or names) + (" as " + ", ".join(role) if role else "")
        _refuse(f"{cluster.name}: no container of the group on {where}: it is not running "
                "there (`vllm-redeploy status` shows what runs)", EXIT_FAILED)  # fmt: skip
    width = max(len(s.label) for s in sources)
    prefixes = {
        s: Text(s.label.ljust(width) + " | ", COLOURS[i % len(COLOURS)])
        for i, s in enumerate(sources)
    }
    try:
        if follow:
            broke = _follow(cluster, sources, prefixes, after, lines)
        else:
            broke = _each(cluster, sources, prefixes, after, lines)
    except KeyboardInterrupt:
        _interrupted()
    if broke or found.unreachable:
        raise typer.Exit(EXIT_FAILED)


def _interrupted() -> NoReturn:
    """Ctrl-C: gone at once, as `docker logs -f` is. Not through the interpreter's exit: the
    reader threads sit in the nodes' sockets, and on a loaded controller such an exit once
    took more than 30 s (a full run of the suite on 2 cores)."""
    out.file.flush()
    err.file.flush()
    os._exit(130)


def _refuse(said: str, code: int) -> NoReturn:
    err.print(said, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _tail(text: str) -> int | str:
    if text == "all":
        return text
    if text.isdigit():
        return int(text)
    err.print(f"--tail {shown(text)}: give a number of lines, or all", markup=False)
    raise typer.Exit(EXIT_CONFIG)


def _show(prefix: Text, line: str) -> None:
    out.print(prefix + Text(for_terminal(line)), highlight=False, soft_wrap=True)


def _each(
    cluster: ClusterConfig,
    sources: list[LogSource],
    prefixes: dict[LogSource, Text],
    after: float | None,
    lines: int | str,
) -> bool:
    """One container after the other, in the plan's order; True when one could not be read."""
    broke = False
    for source in sources:
        try:
            for line in read(cluster, source, since=after, tail=lines):
                _show(prefixes[source], line)
        except RemoteError as exc:
            _broke(source, exc)
            broke = True
    return broke


def _follow(
    cluster: ClusterConfig,
    sources: list[LogSource],
    prefixes: dict[LogSource, Text],
    after: float | None,
    lines: int | str,
) -> bool:
    """Every container at once, each line as it comes, until they all stop (or Ctrl-C)."""
    lines_in: queue.Queue[tuple[LogSource, str | RemoteError | None]] = queue.Queue()

    def pump(source: LogSource) -> None:
        try:
            for line in read(cluster, source, follow=True, since=after, tail=lines):
                lines_in.put((source, line))
            lines_in.put((source, None))
        except RemoteError as exc:
            lines_in.put((source, exc))

    for source in sources:
        threading.Thread(target=pump, args=(source,), daemon=True, name="logs").start()
    left, broke = len(sources), False
    while left:
        try:
            # Timed: the kernel may hand Ctrl-C's signal to a reader thread, and the main thread
            # sees it only when it runs again; an untimed wait with no new line never does.
            source, item = lines_in.get(timeout=0.2)
        except queue.Empty:
            continue
        if isinstance(item, str):
            _show(prefixes[source], item)
            continue
        left -= 1
        if item is not None:
            _broke(source, item)
            broke = True
    return broke


def _broke(source: LogSource, exc: RemoteError) -> None:
    err.print(f"{source.label}: {for_terminal(exc)}", markup=False, highlight=False)
