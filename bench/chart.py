"""The charts: one redeploy's steps per node as a timeline, and the overhead per node count."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from bench.figures import SCALING_MAX, Bench
from bench.measure import FlowRun

CLUSTER = "cluster"
ENGINE = "vLLM stand-in"


def _lanes(run: FlowRun) -> list[str]:
    nodes = sorted({t.node for t in run.record.tasks if t.node}, key=_node_order)
    return [ENGINE, CLUSTER, *nodes]


def _node_order(name: str) -> tuple[int, str]:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (int(digits) if digits else 0, name)


def _bar(ax: Axes, lane: int, begin: float, end: float, label: str, color: str) -> None:
    ax.barh(lane, max(end - begin, 0.02), left=begin, height=0.6, color=color, edgecolor="black")
    span = ax.get_xlim()[1] - ax.get_xlim()[0]
    if end - begin > 0.06 * span:
        ax.text((begin + end) / 2, lane, label, ha="center", va="center", fontsize=7)


def timeline(ax: Axes, run: FlowRun, title: str) -> None:
    lanes = _lanes(run)
    zero, finish = run.started, run.wall_s
    ax.set_xlim(0, finish * 1.02)
    steps = list(dict.fromkeys(t.step for t in run.record.tasks))  # in order of start
    colors = {s: plt.get_cmap("tab20")(i % 20) for i, s in enumerate(steps)}
    for t in run.record.tasks:
        lane = lanes.index(t.node) if t.node else lanes.index(CLUSTER)
        _bar(ax, lane, t.start - zero, t.end - zero, t.step, colors[t.step])
    marks = run.engine
    served = run.events.get("listening")
    if "started" in marks and "loading" in marks:
        _bar(ax, 0, marks["started"] - zero, marks["loading"] - zero, "engine start", "lightgrey")
    if "loading" in marks and served:
        _bar(ax, 0, marks["loading"] - zero, served - zero, "loading weights", "whitesmoke")
    if served:
        ax.axvline(served - zero, color="green", linestyle="--", linewidth=1)
    for stamp in (run.record.start, run.record.end):
        if stamp is not None:
            ax.axvline(stamp - zero, color="grey", linestyle=":", linewidth=1)
    handles = [Patch(facecolor=colors[step], edgecolor="black", label=step) for step in steps]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the flow was called (dotted: flow run start/end; dashed: serving)")
    ax.set_title(title, fontsize=10)


def write_timeline(bench: Bench, path: Path) -> Path:
    typical = {n: p.typical() for n, p in sorted(bench.per_nodes.items())}
    shown = {n: r for n, r in typical.items() if r is not None}
    heights = [len(_lanes(r.run)) * 0.45 + 1.2 for r in shown.values()]
    fig, axes = plt.subplots(
        len(shown), 1, figsize=(13, sum(heights) + 0.5), height_ratios=heights, squeeze=False
    )
    for ax, (n, r) in zip(axes[:, 0], shown.items(), strict=True):
        title = f"N={n}: redeploy, wall {r.run.wall_s:.1f} s, stand-in load {r.load_s:g} s"
        timeline(ax, r.run, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_overhead(bench: Bench, path: Path) -> Path:
    ns = sorted(bench.per_nodes)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in ns:
        runs = [r.overhead_s for r in bench.per_nodes[n].redeploys]
        ax.scatter([n] * len(runs), runs, color="tab:blue", alpha=0.4, s=14)
    ax.plot(ns, [bench.per_nodes[n].overhead_s for n in ns], "o-", label="overhead (median)")
    ax.plot(ns, [bench.per_nodes[n].bookkeeping_s for n in ns], "s--", label="Prefect bookkeeping")
    small = bench.smallest.overhead_s
    if small is not None and len(ns) > 1:
        ax.axhline(
            small * SCALING_MAX, color="red", linestyle=":", label=f"{SCALING_MAX:g} × N={ns[0]}"
        )
    ax.plot(ns, [bench.per_nodes[n].ready_lag_s for n in ns], "^:", label="readiness lag")
    ax.set_xticks(ns)
    ax.set_xlabel("nodes")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Flow overhead (wall − stand-in load {bench.load_s:g} s) per node count")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
