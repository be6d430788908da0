"""What a redeploy did, and how far it is while it runs. No Prefect here.

``RunSummary`` is the plain record the flow fills step by step; ``render_markdown`` turns it into
the run's summary (the flow's ``<cluster>-summary`` artifact and the last screen of
``vllm-redeploy run``).

Live progress: the flow reports each step starting, ending or failing, and the weight loading,
through ``report``; whoever runs the flow in this process (the CLI) listens with ``listening``.
Nobody listening (a worker, the UI, a schedule) costs nothing, and a listener that raises never
breaks the run.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from vllm_redeploy.gpus import GpuReport
from vllm_redeploy.launch.backend import GroupStatus
from vllm_redeploy.parsers.vllm_log import LoadProgress
from vllm_redeploy.probe import ProbeVerdict
from vllm_redeploy.safe_text import fenced, one_line
from vllm_redeploy.sync import Copied
from vllm_redeploy.sync.plan import human_bytes
from vllm_redeploy.transport import TransportVerdict

PROBE_WORDS = 12


class MemoryLike(Protocol):
    """What the memory step reports for one node (``tasks.memory.MemoryReport``)."""

    @property
    def node(self) -> str: ...
    def summary(self) -> str: ...


class StopLike(Protocol):
    """What the stop-autostart step reports for one node (``tasks.stop_autostart.StopReport``)."""

    @property
    def node(self) -> str: ...
    @property
    def units_stopped(self) -> tuple[str, ...]: ...
    @property
    def units_disabled(self) -> tuple[str, ...]: ...
    @property
    def removed(self) -> tuple[str, ...]: ...
    @property
    def own_removed(self) -> tuple[str, ...]: ...


@dataclass
class RunSummary:
    """What one run did; every field but the first two is filled as the steps complete."""

    cluster: str
    mode: str
    action: str = "redeployed"
    steps: dict[str, float] = field(default_factory=dict)  # step -> seconds, in order
    notes: list[str] = field(default_factory=list)
    stopped: Sequence[StopLike] = ()
    gpus: Sequence[GpuReport] = ()
    memory: Sequence[MemoryLike] = ()
    group: GroupStatus | None = None  # what the backend said of the group it settled (Ray)
    backend: str | None = None  # the launch backend and why it was chosen
    transport: TransportVerdict | None = None
    node_ips: dict[str, str] = field(default_factory=dict)  # fabric IP -> node name
    endpoint: str | None = None  # e.g. http://head:30000/v1
    model: str | None = None  # the served name
    image: str | None = None
    image_id: str | None = None
    vllm_version: str | None = None
    load_s: float | None = None
    loader: str | None = None  # the weight loader and why it was chosen
    load_format: str | None = None  # the loader's name ("default": vLLM's own)
    weights_s: float | None = None  # vLLM's own "Loading weights took N seconds"
    compile_cache: str | None = None  # where the caches live, and warm or cold at this start
    probe: ProbeVerdict | None = None
    synced: Sequence[Copied] = ()  # what the sync step copied, per target and kind
    failed_step: str | None = None
    failure: str | None = None

    @property
    def title(self) -> str:
        return f"{self.cluster}: {self.action}"

    @property
    def total_s(self) -> float:
        return round(sum(self.steps.values()), 2)


def render_markdown(summary: RunSummary) -> str:
    """The summary as markdown; the first line is ``# <cluster>: <action>``."""
    lines = [f"# {summary.title}", ""]
    if summary.failure is not None:
        lines += [fenced(summary.failure), ""]
    lines += [
        f"Mode `{summary.mode}`, {len(summary.steps)} steps in {summary.total_s:g} s.",
        "",
        "| step | seconds |",
        "| --- | --- |",
    ]
    for name, seconds in summary.steps.items():
        mark = " (failed)" if name == summary.failed_step else ""
        lines.append(f"| {name}{mark} | {seconds:g} |")
    lines += _sync_section(summary.synced)
    lines += _nodes_section(summary)
    lines += _fabric_section(summary.transport)
    lines += _group_section(summary)
    lines += _vllm_section(summary)
    lines += _probe_section(summary.probe)
    if summary.notes:
        lines += ["", "## Notes", "", *(f"- {_cell(note)}" for note in summary.notes)]
    return "\n".join(lines) + "\n"


def _sync_section(synced: Sequence[Copied]) -> list[str]:
    if not synced:
        return []
    lines = ["", "## Copied", "", "| node | what | copied | already there | seconds | rate | how |"]
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for c in synced:
        already = human_bytes(c.already) if c.what == "model" else ""
        lines.append(
            f"| {c.target} | {c.what} | {human_bytes(c.bytes)} | {already} | {c.seconds:.1f} "
            f"| {c.rate} | {_cell(c.route)} |"
        )
    return lines


def _nodes_section(summary: RunSummary) -> list[str]:
    stops = {s.node: s for s in summary.stopped}
    gpus = {g.node: g for g in summary.gpus}
    memory = {m.node: m for m in summary.memory}
    names = list(dict.fromkeys([*stops, *gpus]))
    if not names:
        return []
    lines = [
        "",
        "## Nodes",
        "",
        "| node | units stopped | containers removed | GPU | memory |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in names:
        stop, gpu = stops.get(name), gpus.get(name)
        mem = memory[name].summary().removeprefix(f"{name}: ") if name in memory else "-"
        units = removed = "-"
        if stop is not None:
            units = ", ".join(stop.units_stopped) or "none"
            if stop.units_disabled:
                units += f" (disabled: {', '.join(stop.units_disabled)})"
            removed = ", ".join(stop.removed) or "none"
            if stop.own_removed:
                removed += f"; ours from the last run: {', '.join(stop.own_removed)}"
        state = gpu_state(gpu) if gpu is not None else "-"
        lines.append(
            f"| {name} | {_cell(units)} | {_cell(removed)} | {_cell(state)} | {_cell(mem)} |"
        )
    return lines


def _fabric_section(verdict: TransportVerdict | None) -> list[str]:
    if verdict is None:
        return []
    lines = [
        "",
        "## Fabric",
        "",
        f"NCCL between the nodes: **{verdict.transport}**.",
        "",
        "| node | transport | HCAs used |",
        "| --- | --- | --- |",
    ]
    for node in verdict.nodes:
        hcas = ", ".join(node.hcas) or "-"
        lines.append(f"| {node.node} | {node.transport} | {_cell(hcas)} |")
    return lines


def gpu_state(report: GpuReport) -> str:
    """One phrase: clear (and how that was judged), or who holds the GPU."""
    if not report.clear:
        return "; ".join(report.problems)
    if report.unified_memory:
        free = (
            f", MemAvailable {report.mem_available_mib / 1024:.1f} GiB"
            if report.mem_available_mib is not None
            else ""
        )
        return f"clear (unified memory{free})"
    used = sum(g.memory_used_mib or 0 for g in report.gpus)
    return f"clear ({len(report.gpus)} GPU, {used} MiB used)"


def _group_section(summary: RunSummary) -> list[str]:
    """The group as its backend listed it when the launch settled (Ray's members by IP and
    GPUs); none for a backend that keeps no list (mp: its ranks are the containers)."""
    group = summary.group
    if group is None or not group.members:
        return []
    alive = [m for m in group.members if m.alive]
    gpus = sum(m.gpus for m in alive)
    lines = [
        "",
        "## Group",
        "",
        f"{group.backend}: {len(alive)} nodes alive, {gpus:g} GPUs.",
        "",
        "| node | IP | GPUs | alive |",
        "| --- | --- | --- | --- |",
    ]
    rank = {ip: i for i, ip in enumerate(summary.node_ips)}  # configured nodes first, in order
    for m in sorted(group.members, key=lambda m: (rank.get(m.ip, len(rank)), m.ip)):
        name = summary.node_ips.get(m.ip, "(not configured)")
        lines.append(f"| {name} | {m.ip} | {m.gpus:g} | {'yes' if m.alive else 'no'} |")
    return lines


def _vllm_section(summary: RunSummary) -> list[str]:
    items = []
    if summary.backend:
        items.append(f"backend {_literal(summary.backend)}")
    if summary.image:
        image_id = f" ({_short_id(summary.image_id)})" if summary.image_id else ""
        items.append(f"image `{summary.image}`{image_id}")
    if summary.vllm_version:
        items.append(f"vLLM {summary.vllm_version}")
    if summary.model and summary.endpoint and summary.load_s is not None:
        items.append(f"`{summary.model}` served at {summary.endpoint}")
    if summary.loader:
        items.append(f"loader {_literal(summary.loader)}")
    if summary.load_s is not None:
        items.append(f"loaded in {summary.load_s:.1f} s")
    if summary.weights_s is not None:
        took = f"{summary.weights_s:.{1 if summary.weights_s >= 10 else 2}f}"  # a tiny model's 0.01
        items.append(f"weights loaded in {took} s (vLLM's own time)")
    if summary.compile_cache:
        items.append(f"compile cache {summary.compile_cache}")
    if not items:
        return []
    return ["", "## vLLM", "", *(f"- {item}" for item in items)]


def _probe_section(verdict: ProbeVerdict | None) -> list[str]:
    if verdict is None:
        return []
    state = "healthy" if verdict.healthy else "unhealthy"
    lines = ["", "## Probe", "", f"- {state}: {_one_line(verdict.detail)}"]
    facts = []
    if verdict.finish_reason is not None:
        facts.append(f"finish_reason `{verdict.finish_reason}`")
    if verdict.elapsed_s is not None:
        facts.append(f"{verdict.elapsed_s:.2f} s")
    if facts:
        lines.append("- " + ", ".join(facts))
    if verdict.content:
        lines.append(f"- content: \u201c{_literal(first_words(verdict.content))}\u201d")
    if verdict.reasoning:
        lines.append(f"- reasoning: \u201c{_literal(first_words(verdict.reasoning))}\u201d")
    return lines


def first_words(text: str, count: int = PROBE_WORDS) -> str:
    """The first ``count`` words of ``text`` on one line, with an ellipsis when cut."""
    words = text.split()
    cut = " ".join(words[:count])
    return cut + " \u2026" if len(words) > count else cut


_MARKDOWN = re.compile(r"([\\`*_\[\]<>#|~])")


def _literal(text: str) -> str:
    """Foreign words (a model's answer, names) shown as written, on one line: Markdown
    characters in them are escaped, control characters written as escapes."""
    return _MARKDOWN.sub(r"\\\1", one_line(text))


def _short_id(image_id: str | None) -> str:
    return str(image_id).removeprefix("sha256:")[:12]


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """A table cell: one line, Markdown in it shown as written (``|`` cannot end the cell)."""
    return _literal(_one_line(text))


# --- live progress ---------------------------------------------------------------------------

StepState = Literal["named", "running", "done", "failed", "loading", "copying"]


@dataclass(frozen=True)
class StepEvent:
    """One change of a step: it started, ended, failed (``detail`` says why), loading moved, or
    a copy to a node moved (``detail``: "<node>: ..."); or, first, the run's name and link
    (``named``, in ``detail``)."""

    step: str
    state: StepState
    seconds: float | None = None
    detail: str = ""
    load: LoadProgress | None = None


Listener = Callable[[StepEvent], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


def report(event: StepEvent) -> None:
    """Tell every listener of this process; a failing listener is dropped from this call only."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(event)
        except Exception:  # noqa: S112 - a display must never fail the redeploy
            continue


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Receive the progress of flow runs in this process while the block runs."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
