"""bench/results/latest.md: each figure's median, its target and whether it is met, the method."""

from __future__ import annotations

from collections.abc import Callable

from bench import figures as f
from bench.cost import Floors, Meter, StepCost
from bench.figures import Bench, Extras, PerNodes, median


def num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def verdict(ok: bool | None, detail: str = "") -> str:
    if ok is None:
        return "n/a"
    word = "**yes**" if ok else "**no**"
    return f"{word} ({detail})" if detail else word


def _all_below(
    bench: Bench, read: Callable[[PerNodes], float | None], limit: float, digits: int = 2
) -> str:
    values = {n: read(p) for n, p in bench.per_nodes.items()}
    known = {n: v for n, v in values.items() if v is not None}
    if not known:
        return verdict(None)
    worst = max(known, key=lambda n: known[n])
    return verdict(known[worst] < limit, f"worst N={worst}: {known[worst]:.{digits}f}")


def flow_table(bench: Bench) -> list[str]:
    ns = sorted(bench.per_nodes)
    small = bench.smallest
    rows: list[tuple[str, Callable[[PerNodes], str], str, str]] = [
        ("flow wall, s", lambda p: num(p.wall_s), "", ""),
        (
            "overhead = wall − stand-in load, s",
            lambda p: num(p.overhead_s),
            f"N={max(ns)} ≤ {f.SCALING_MAX:g} × N={min(ns)}",
            verdict(
                None if bench.scaling is None else bench.scaling <= f.SCALING_MAX,
                f"{bench.scaling:.2f}×" if bench.scaling is not None else "",
            ),
        ),
        ("Prefect bookkeeping (no-op mirror flow), s", lambda p: num(p.bookkeeping_s), "", ""),
        (
            "overhead beyond bookkeeping, s",
            lambda p: num(p.beyond_bookkeeping_s),
            f"N={min(ns)} < {f.BEYOND_BOOKKEEPING_MAX_S:g}",
            verdict(
                None
                if small.beyond_bookkeeping_s is None
                else small.beyond_bookkeeping_s < f.BEYOND_BOOKKEEPING_MAX_S
            ),
        ),
        ("flow run time outside any task run, s", lambda p: num(p.outside_tasks_s), "", ""),
        (
            "readiness lag (serving → wait-ready done), s",
            lambda p: num(p.ready_lag_s, 2),
            f"< {f.READY_LAG_MAX_S:g}",
            _all_below(bench, lambda p: p.ready_lag_s, f.READY_LAG_MAX_S),
        ),
        (
            "crash lag (engine killed → flow run Failed), s",
            lambda p: num(p.crash_lag_s, 2),
            f"< {f.CRASH_LAG_MAX_S:g}",
            _all_below(bench, lambda p: p.crash_lag_s, f.CRASH_LAG_MAX_S),
        ),
        (
            "crash noticed (engine killed → wait-ready failed), s",
            lambda p: num(p.crash_noticed_s, 2),
            "",
            "",
        ),
        (
            "`ensure` on a healthy cluster, s",
            lambda p: num(p.ensure_s),
            f"< {f.ENSURE_MAX_S:g}",
            _all_below(bench, lambda p: p.ensure_s, f.ENSURE_MAX_S, 1),
        ),
        (
            "`ensure`: containers restarted (max)",
            lambda p: "–" if p.ensure_restarts is None else str(p.ensure_restarts),
            "0",
            _all_below(bench, lambda p: p.ensure_restarts, 1, 0),
        ),
    ]
    head = "| figure | " + " | ".join(f"N={n}" for n in ns) + " | target | met |"
    lines = [head, "|" + " --- |" * (len(ns) + 3)]
    for label, cell, target, met in rows:
        cells = " | ".join(cell(bench.per_nodes[n]) for n in ns)
        lines.append(f"| {label} | {cells} | {target} | {met} |")
    return lines


def reboot_to_served_table(bench: Bench) -> list[str]:
    """Issue 25's figures in one table: each beside its target and the reference runbook."""
    small, large, extras = bench.smallest, bench.largest, bench.extras
    ref = extras.reference(f.REFERENCE_POLL_TO_BEAT_S) if extras else {}
    lines = [
        "| figure | measured | target | met | reference runbook |",
        "| --- | --- | --- | --- | --- |",
    ]
    for backend, words in (("mp", "vLLM's own launcher (mp)"), ("ray", "Ray")):
        limit = f.OVERHEAD_MAX_S[backend]
        mine = small.overhead_of(backend)
        theirs = num(ref.get("overhead_s")) if backend == "ray" and ref else "–"
        lines.append(
            f"| overhead beyond the model's load, {words}, N={small.nodes}, s | {num(mine)} | "
            f"≤ {limit:g} | {verdict(None if mine is None else mine <= limit)} | {theirs} |"
        )
    for backend, words in (("mp", "mp"), ("ray", "Ray")):
        ratio = bench.scaling_of(backend)
        big = large.overhead_of(backend)
        lines.append(
            f"| overhead N={large.nodes} over N={small.nodes}, {words} | "
            f"{'–' if ratio is None else f'{ratio:.2f}× ({num(big)} s)'} | ≤ {f.SCALING_MAX:g}× "
            f"| {verdict(None if ratio is None else ratio <= f.SCALING_MAX)} | – |"
        )
    asked, cached = f.preflight_split(bench)
    lines += [
        f"| preflight, an image seen first (its facts asked: {len(asked)} run(s)), s | "
        f"{num(median(asked), 2)} | – | – | – |",
        f"| preflight, an image known (its facts cached by image ID: {len(cached)} run(s)), s | "
        f"{num(median(cached), 2)} | below the first | "
        f"{verdict(_below(median(cached), median(asked)))} | – |",
    ]
    if extras is not None:
        fixed = median(extras.webhook_s)
        before = None if fixed is None else extras.reboot_delay_s + fixed
        after = median(extras.reboot_all_s)
        lines += [
            f"| every node rebooted → after-reboot run Running (last node's report, "
            f"reboot_delay_s {extras.reboot_delay_s:g}), s | {num(after)} | no fixed wait "
            f"(< {extras.reboot_delay_s:g}) | "
            f"{verdict(None if after is None else after < extras.reboot_delay_s)} | – |",
            f"| the same before this change: the fixed {extras.reboot_delay_s:g} s, plus the "
            f"trigger path (one node, delay 0: {num(fixed)} s), s | {num(before)} | – | – | – |",
        ]
        lines += _cache_rows(extras)
    return lines


def _below(value: float | None, limit: float | None) -> bool | None:
    return None if value is None or limit is None else value < limit


def _cache_rows(extras: Extras) -> list[str]:
    starts = extras.caches
    if starts is None or starts.skipped:
        why = starts.skipped if starts else "not measured (--no-real-engine)"
        return [f"| the real engine's starts with and without [cache] | {why} | – | – | – |"]
    rows = []
    for cache in (True, False):
        for nth in (1, 2):
            s = starts.get(cache, nth)
            if s is None:
                continue
            rows.append(
                f"| real vLLM (CPU build), [cache] {'on' if cache else 'off'}, start {nth}: "
                f"served / first answer, s | {num(s.ready_s)} / {num(s.first_answer_s)} "
                f"({s.state}) | – | – | – |"
            )
    warm, cold = starts.get(True, 2), starts.get(False, 2)
    if warm is not None and cold is not None:
        saved = (cold.ready_s + cold.first_answer_s) - (warm.ready_s + warm.first_answer_s)
        rows.append(
            "| the cache's saving at a second start (served + first answer, off − on), s | "
            f"{num(saved)} | > 0 | {verdict(saved > 0)} | – |"
        )
    return rows


def extras_table(bench: Bench, extras: Extras) -> list[str]:
    load = bench.load_s
    temporary, server = median(extras.run_temporary_s), median(extras.run_server_s)
    cost = temporary - server if temporary is not None and server is not None else None
    rows = [
        ("signed webhook call → flow run Running (delay 0), s", median(extras.webhook_s)),
        ("`vllm-redeploy probe`, fresh process, s", median(extras.probe_cold_s)),
        ("`vllm-redeploy run`, fresh process, temporary API: wall, s", temporary),
        ("… minus the stand-in load, s", None if temporary is None else temporary - load),
        ("`vllm-redeploy run`, fresh process, real server: wall, s", server),
        ("… minus the stand-in load, s", None if server is None else server - load),
        ("the temporary API's cost (difference), s", cost),
    ]
    lines = ["| figure | median | runs |", "| --- | --- | --- |"]
    counts = [
        len(extras.webhook_s),
        len(extras.probe_cold_s),
        len(extras.run_temporary_s),
        len(extras.run_temporary_s),
        len(extras.run_server_s),
        len(extras.run_server_s),
        min(len(extras.run_temporary_s), len(extras.run_server_s)),
    ]
    for (label, value), count in zip(rows, counts, strict=True):
        lines.append(f"| {label} | {num(value)} | {count} |")
    return lines


def reference_table(bench: Bench, extras: Extras) -> list[str]:
    flow = bench.per_nodes[extras.nodes]
    polls = sorted(extras.references)
    refs = {p: extras.reference(p) for p in polls}
    head = "| figure | flow | " + " | ".join(f"reference, poll {p:g} s" for p in polls) + " |"
    lines = [head, "|" + " --- |" * (len(polls) + 2)]
    for label, key, mine in (
        ("total wall (first step → probe answered), s", "wall_s", flow.wall_s),
        ("wall − stand-in load, s", "overhead_s", flow.overhead_s),
        ("readiness lag (serving → noticed), s", "ready_lag_s", flow.ready_lag_s),
    ):
        cells = " | ".join(num(refs[p][key], 2 if key == "ready_lag_s" else 1) for p in polls)
        lines.append(f"| {label} | {num(mine, 2 if key == 'ready_lag_s' else 1)} | {cells} |")
    beat = refs.get(f.REFERENCE_POLL_TO_BEAT_S, {}).get("wall_s")
    ok = None if beat is None or flow.wall_s is None else flow.wall_s < beat
    lines += [
        "",
        f"Target: the flow's total below the reference's with {f.REFERENCE_POLL_TO_BEAT_S:g} s "
        f"polling: {verdict(ok, '' if beat is None else f'{num(flow.wall_s)} vs {num(beat)} s')}.",
    ]
    return lines


def steps_table(bench: Bench) -> list[str]:
    ns = sorted(bench.per_nodes)
    per_n = {n: bench.per_nodes[n].step_s() for n in ns}
    extras = bench.extras
    polls = sorted(extras.references) if extras else []
    refs = {p: extras.reference_step_s(p) for p in polls} if extras else {}
    names: list[str] = []
    for table in [*per_n.values(), *refs.values()]:
        names += [name for name in table if name not in names]
    head = "| step | " + " | ".join(f"flow N={n}" for n in ns)
    head += "".join(f" | reference N={extras.nodes}, poll {p:g}" for p in polls) if extras else ""
    lines = [head + " |", "|" + " --- |" * (len(ns) + len(polls) + 1)]
    for name in names:
        found = [per_n[n].get(name) for n in ns] + [refs[p].get(name) for p in polls]
        cells = [num(value, 2) for value in found]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


# Steps that start containers: `docker run` by hand is their floor, whatever the round trips.
CONTAINER_STEPS = ("ray-head", "join-workers", "launch-vllm")


def floor_s(step: str, cost: StepCost, floors: Floors) -> float:
    """What the step cannot go below on this bed: its critical path's round trips at what one
    costs by hand (a command over SSH; a Docker request, an HTTP one counted as such), or one
    container's `docker run` by hand for a step that starts containers."""
    docker = cost.critical - cost.critical_ssh
    network = cost.critical_ssh * floors.round_trip_s + docker * floors.docker_call_s
    starts = step.split(": ")[-1] in CONTAINER_STEPS
    return max(network, floors.docker_run_s) if starts else network


def cost_table(bench: Bench, meter: Meter, floors: Floors | None) -> list[str]:
    ns = sorted(bench.per_nodes)
    per_n = {n: bench.per_nodes[n].step_costs(meter) for n in ns}
    names: list[str] = []
    for table in per_n.values():
        names += [name for name in table if name not in names]
    columns = (
        "s",
        "round trips on the critical path (ssh + requests)",
        "calls (most on one node)",
        "controller CPU s (per node, ms)",
        "machine busy",
    )
    head = "| step | " + " | ".join(f"{c}, N={n}" for c in columns for n in ns)
    smallest = min(ns)
    head += f" | floor N={smallest}, s |" if floors else " |"
    lines = [head, "|" + " --- |" * (1 + len(columns) * len(ns) + (1 if floors else 0))]
    for name in names:
        found = [per_n[n].get(name) for n in ns]
        cells = [num(c.seconds, 2) if c else "–" for c in found]
        cells += [
            f"{c.critical} ({c.critical_ssh} + {c.critical - c.critical_ssh})" if c else "–"
            for c in found
        ]
        cells += [f"{c.calls} ({c.per_node_max})" if c else "–" for c in found]
        cells += [
            f"{c.cpu_s:.2f} ({1000 * c.cpu_s / n:.0f})" if c else "–"
            for c, n in zip(found, ns, strict=True)
        ]
        cells += [f"{100 * c.busy:.0f} %" if c and c.busy is not None else "–" for c in found]
        small = per_n[smallest].get(name)
        if floors:
            cells.append(num(floor_s(name, small, floors), 2) if small else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def floors_lines(floors: Floors) -> list[str]:
    return [
        f"- one SSH round trip (`true` over the open connection): {floors.round_trip_s:.3f} s",
        f"- one Docker API request over it (`GET /_ping`): {floors.docker_call_s:.3f} s",
        "- `docker run --rm --entrypoint /bin/sh IMAGE -c :` of the vLLM image on the node's "
        "engine, by hand: "
        f"{floors.docker_run_s:.3f} s",
    ]


def method(bench: Bench) -> list[str]:
    return [
        "## How each figure is measured",
        "",
        "- One real `prefect server start` (SQLite) serves every run; its start is not counted. "
        "Flows run in the benchmark's process against it. Each node count gets its own test bed "
        "(sshd, Docker engine, real Ray per node; vLLM and nvidia-smi stand-ins).",
        f"- **overhead**: wall time of the flow call (redeploy, from the old autostart stack or "
        f"the previous run's containers) minus the stand-in's configured load time "
        f"(`VRD_LOAD_SECONDS={bench.load_s:g}`: from the engine process's start to serving, "
        "as an operator times `vllm serve`).",
        "- **Prefect bookkeeping**: a no-op flow mirroring the measured redeploy's task runs "
        "(same names, same order, each group of same-step runs submitted together and waited "
        "for, then one markdown artifact and one event, as the flow's ending does), timed the same "
        "way against the same server. It is what Prefect costs for this shape of flow with nothing "
        "inside the tasks; **overhead beyond bookkeeping** is the overhead minus it.",
        "- **time outside any task run**: the flow run's server-side duration minus the union of "
        "its task runs' intervals (flow body plus Prefect's bookkeeping between tasks).",
        "- **readiness lag**: the stand-in's own clock mark when its API starts listening "
        "(`VRD_EVENT_LOG` event `listening`) to the end time of the `wait-ready` task run as "
        "recorded by the server.",
        f"- **crash lag**: `VRD_FAULT=crash_during_load` with a {bench.crash_load_s:g} s load "
        "(the engine kills itself at half the shards and logs `crashed`) to the timestamp of the "
        "flow run's Failed state read from the API; it includes diagnostics and tearing the "
        "group down. *Noticed* is the same start to the `wait-ready` task run's end.",
        "- **ensure**: right after each successful redeploy, `ensure` with the same "
        "configuration; wall time, and every container on every node compared before and after "
        "(ID and StartedAt): created, removed or restarted ones count.",
        "- **webhook → Running**: `vllm-redeploy serve` with `reboot_delay_s = 0` and a 1 s "
        "debounce window (waited out between calls), the webhook in-process posting to the same "
        "server; a signed `POST /reboot` with a new boot id, to the after-reboot flow run's "
        "`start_time`. It includes the trigger's evaluation and the runner's polling for "
        "scheduled runs.",
        "- **cold starts**: `vllm-redeploy probe` as a fresh process against the served bed; "
        "`vllm-redeploy run` as a fresh process with no `PREFECT_API_URL` (Prefect's temporary "
        "API; its database exists already, as on a controller that ran Prefect before) and with "
        "the real server; their difference is the temporary API's cost.",
        "- **reference**: `bench/reference_runbook.sh` (ssh and the docker CLI; the flow's own "
        "container specs from `vllm_redeploy/launch/ray.py`) on the same bed with the same "
        "stand-in settings: stop units and force-remove the old containers, GPUs clear, Ray head, "
        "workers, `ray status` shows every GPU, `vllm serve`, poll `/v1/models` every POLL_S s, "
        "one curl chat request. Its wall runs from its first step to the answer (the helper that "
        "reads the configuration is not counted).",
        "- **From reboot to served**: *overhead* as below, for each backend (the mp runs are "
        'redeploys with `[vllm] backend = "mp"` on the same bed, after the Ray ones); the '
        "reference runbook drives Ray. *preflight*: the step's time in the runs whose "
        "`image-facts` task ran (the image's ID not seen by this Prefect server before) and in "
        "those that found it cached. *every node rebooted*: each node of the bed reports a new "
        "boot to the webhook, one after the other, with the default `reboot_delay_s`; from the "
        "last call to the after-reboot run's `start_time` (before this change the run started "
        "`reboot_delay_s` after the first report: that row adds the delay to the one-node, "
        "delay-0 figure). *real vLLM*: `bench/caches.py` (two nodes, mp, torch.compile on): "
        "two redeploys with `[cache]` off, then two with it on, from an empty cache directory; "
        "served is the `wait-ready` step, first answer the `probe` step (the CPU build compiles "
        "kernels at the first request), the state is what the run's summary said.",
        "- **steps**: per step, median over runs of first start to last end of its task runs; "
        "`(flow)` rows are the gaps before the first and after the last task run; "
        "`(stand-in)` is the engine container's start to its first weight-loading log line "
        "(part of the configured load); `(Ray)` rows are Ray's own start, read from the flow's "
        "Ray containers (their start to Ray's \"Ray runtime started.\" line, by Docker's log "
        "timestamps): the slowest node's, and the head container's start to the last node "
        "registered, which ray-head, join-workers and cluster-check together cannot go below. "
        "The reference's steps run from one mark to the next.",
        "- **the product's own cost** (`bench/cost.py`): every call the controller makes to a "
        "node is recorded: a command over SSH (a `run_all` batch is one), a Docker API request "
        "over the node's connection, the channel a pooled Docker connection opens, an HTTP "
        "request to the engine's API (a command inside a container counts as its Docker "
        "requests). Per step (its task runs' span), *round trips on the critical path* is the "
        "longest chain of those calls each starting after the previous one ended (over SSH + "
        "requests): calls fanned out to the nodes at once count once, so the figure should not "
        "grow with N; a step that polls (cluster-check, wait-ready) counts each poll. "
        "*Controller CPU* is this process's CPU time (every thread: the flow and Prefect's "
        "client) sampled every 0.1 s; *machine busy* the share of every core busy meanwhile "
        "(`/proc/stat`), which says how much of a step's seconds the bed's own processes took on "
        "this 2-core machine. *floor*: the critical path's round trips at what one costs by hand "
        "(below; an HTTP request as a Docker one), or one `docker run` by hand for a step that "
        "starts containers.",
    ]


def render(bench: Bench) -> list[str]:
    ns = ", ".join(str(n) for n in sorted(bench.per_nodes))
    lines = [
        "# vllm-redeploy on the test bed: overhead, lags, triggers",
        "",
        f"Median of {bench.runs} run(s) per figure; nodes {ns}; stand-in load "
        f"{bench.load_s:g} s. Charts: `latest-timeline.png` (one run's steps per node), "
        "`latest-overhead.png` (overhead per node count).",
        "",
        "## From reboot to served",
        "",
        *reboot_to_served_table(bench),
        "",
        "## The flow (Ray backend)",
        "",
        *flow_table(bench),
    ]
    if bench.extras is not None:
        lines += [
            "",
            f"## Triggers and cold starts (N={bench.extras.nodes})",
            "",
            *extras_table(bench, bench.extras),
            "",
            f"## The flow and the reference runbook side by side (N={bench.extras.nodes}, same "
            "bed, same benchmark run)",
            "",
            *reference_table(bench, bench.extras),
        ]
    lines += ["", "## Steps (median seconds)", "", *steps_table(bench)]
    if bench.meter is not None:
        lines += [
            "",
            "## The product's own cost per step (median over runs)",
            "",
            *cost_table(bench, bench.meter, bench.floors),
        ]
        if bench.floors is not None:
            lines += ["", f"Floors, measured by hand on the N={min(bench.per_nodes)} bed:", ""]
            lines += floors_lines(bench.floors)
    lines += ["", *method(bench)]
    return lines
