"""The controller's commands: serve and watch (kept up between runs), pause and resume, the
reboot webhook, and installing the notifier and the controller's services.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from deployments.cli.common import (
    CONFIGS_DEFAULT,
    EVERYDAY,
    EXIT_CONFIG,
    EXIT_FAILED,
    SERVICES,
    SETUP,
    ConfigOption,
    ConfigsOption,
    JsonOption,
    app,
    duration_s,
    err,
    load_all_or_exit,
    load_or_exit,
    out,
)
from deployments.cli.prefect_api import controller_or_exit
from vllm_redeploy.nodes import RemoteError
from vllm_redeploy.safe_text import for_terminal, shown


@app.command(rich_help_panel=SERVICES)
def serve(config: ConfigsOption = CONFIGS_DEFAULT) -> None:
    """Serve the nightly, after-reboot, recover and manual deployments of each cluster (repeat
    --config for several) from this process (no work pool)."""
    clusters = load_all_or_exit(config)  # fail early, in plain words, on a bad configuration
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from deployments.definitions import serve_deployments

    # A service keeps going while Prefect restarts: no check that it answers now.
    with controller_or_exit(clusters, config, "serve", check=False):
        serve_deployments(list(zip(clusters, config, strict=True)))


@app.command(rich_help_panel=SERVICES)
def watch(
    config: ConfigsOption = CONFIGS_DEFAULT,
    metrics: Annotated[
        str,
        typer.Option(
            metavar="ADDRESS",
            help="Serve Prometheus metrics of what the watcher sees at http://ADDRESS/metrics "
            "(HOST:PORT, e.g. 127.0.0.1:9764; one port per watch process), or off.",
        ),
    ] = "off",
) -> None:
    """Watch clusters between runs; tell Prefect (vllm.cluster.unhealthy) when one goes down."""
    clusters = load_all_or_exit(config)
    where = _metrics_address(metrics)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per look is noise
    from deployments.metrics import WatchMetrics, serve_metrics
    from deployments.watcher import watch_clusters

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    seen = None
    if where is not None:
        seen = WatchMetrics()
        try:
            serve_metrics(seen, *where)
        except OSError as exc:
            err.print(
                f"watch: cannot serve metrics on {for_terminal(metrics)}: {for_terminal(exc)}. "
                "Choose another --metrics HOST:PORT, or --metrics off.",
                markup=False, highlight=False, soft_wrap=True,
            )  # fmt: skip
            raise typer.Exit(EXIT_CONFIG) from None
        logging.getLogger("vllm_redeploy.watch").info("metrics at http://%s/metrics", metrics)
    with controller_or_exit(clusters, config, "watch", check=False):
        try:
            watch_clusters(clusters, stop, seen)
        except KeyboardInterrupt:
            stop.set()


def _metrics_address(value: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (IPv6 in brackets) as (host, port); None for ``off``; else exit 2."""
    if value == "off":
        return None
    host, sep, port = value.rpartition(":")
    if sep and host and port.isdigit() and 0 < int(port) < 65536:
        return host.strip("[]"), int(port)
    err.print(
        f"watch: --metrics {for_terminal(value)} is not HOST:PORT (e.g. 127.0.0.1:9764, or "
        "0.0.0.0:9764 for a Prometheus on another machine) nor off.",
        markup=False, highlight=False, soft_wrap=True,
    )  # fmt: skip
    raise typer.Exit(EXIT_CONFIG)


@app.command(rich_help_panel=EVERYDAY)
def pause(
    reason: Annotated[
        str, typer.Option("--reason", metavar="TEXT", help="Why, for whoever looks (required).")
    ],
    for_: Annotated[
        str | None,
        typer.Option(
            "--for",
            metavar="DURATION",
            help="For how long, e.g. 2h, 30m, 90s (default: until resume).",
        ),
    ] = None,
    config: ConfigOption = Path("cluster.toml"),
    as_json: JsonOption = False,
) -> None:
    """Maintenance: nothing automatic touches the cluster (watcher, recover, reboot, nightly),
    and the runs under way change nothing more; says what each of them does."""
    cluster = load_or_exit(config)
    seconds = duration_s("--for", for_) if for_ else None
    from tasks.standing.marks import pause as pause_cluster
    from tasks.standing.runs import runs_at_hand

    with controller_or_exit([cluster], [config], "pause"):
        paused = pause_cluster(cluster.name, reason, seconds)
        runs = runs_at_hand(cluster)
    if as_json:
        runs_json = [{**asdict(run), "under_pause": run.under_pause()} for run in runs]
        out.print_json(
            json.dumps({"cluster": cluster.name, "paused": asdict(paused), "runs": runs_json})
        )
        return
    said = f"{cluster.name}: {for_terminal(paused.describe())}"
    out.print(said, markup=False, highlight=False, soft_wrap=True)
    for run in runs:
        out.print(f"  {for_terminal(run.line())}", markup=False, highlight=False, soft_wrap=True)
    if not runs:
        out.print("  no run of it is under way", markup=False, highlight=False)


@app.command(rich_help_panel=SETUP)
def alerts(
    config: ConfigOption = Path("cluster.toml"),
    remove: Annotated[
        bool, typer.Option("--remove", help="Remove the cluster's alerts instead.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Set up the cluster's alerts as Prefect automations through the notification block that
    [alerts] block names: a run failed, crash-looping, unhealthy longer than [alerts]
    unhealthy_for_s, the nightly run late. Again: replaces them."""
    cluster = load_or_exit(config)
    from deployments.alerts import AlertsProblem, remove_alerts, set_up_alerts

    with controller_or_exit([cluster], [config], "alerts"):
        try:
            if remove:
                made, gone = [], remove_alerts(cluster)
            else:
                made, gone = set_up_alerts(cluster), 0
        except AlertsProblem as exc:
            err.print(for_terminal(exc), markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_CONFIG) from None
    if as_json:
        names = [a.name for a in made]
        out.print_json(json.dumps({"cluster": cluster.name, "alerts": names, "removed": gone}))
        return
    if remove:
        out.print(f"{cluster.name}: {gone} alert(s) removed", markup=False, highlight=False)
        return
    for automation in made:
        out.print(f"{automation.name}: {automation.description}", markup=False, highlight=False)
    out.print(
        f"{cluster.name}: {len(made)} alerts through {cluster.alerts.block}",
        markup=False,
        highlight=False,
    )


@app.command(rich_help_panel=EVERYDAY)
def resume(config: ConfigOption = Path("cluster.toml"), as_json: JsonOption = False) -> None:
    """End a pause and a crash-loop mark: automatic runs may touch the cluster again."""
    cluster = load_or_exit(config)
    from tasks.standing.marks import resume as resume_cluster

    with controller_or_exit([cluster], [config], "resume"):
        cleared = resume_cluster(cluster.name)
    if as_json:
        out.print_json(json.dumps({"cluster": cluster.name, "cleared": cleared}))
        return
    what = " and ".join(cleared) or "nothing (it was neither paused nor crash-looping)"
    out.print(f"{cluster.name}: cleared {what}", markup=False, highlight=False)


@app.command(rich_help_panel=SERVICES)
def webhook(
    config: ConfigsOption = CONFIGS_DEFAULT,
    host: Annotated[
        str | None, typer.Option(metavar="ADDRESS", help="Bind address (default webhook.host)")
    ] = None,
    port: Annotated[
        int | None, typer.Option(metavar="PORT", help="Port (default webhook.port)")
    ] = None,
) -> None:
    """Run the reboot webhook: signed calls from the nodes become reboots in its spool, which
    each cluster's watcher posts to Prefect (the webhook holds no Prefect credential). With
    several --config, one webhook serves each cluster at /clusters/NAME/reboot with its own
    secret."""
    clusters = load_all_or_exit(config)
    from deployments.webhook import serve_webhook

    try:
        serve_webhook(clusters, host, port)
    except ValueError as exc:
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG) from None


@app.command("install-notifier", rich_help_panel=SETUP)
def install_notifier_command(
    node: Annotated[str, typer.Argument(metavar="NODE", help="Node name from the configuration")],
    config: ConfigOption = Path("cluster.toml"),
    prefix: Annotated[
        str, typer.Option(metavar="DIR", help="Install below this root (test beds)")
    ] = "/",
) -> None:
    """Install the reboot notifier on NODE over SSH (idempotent); prints what changed."""
    cluster = load_or_exit(config)
    from deployments.install_notifier import install_notifier

    if why := cluster.webhook.unreachable():
        err.print(for_terminal(f"warning: {why}"), markup=False, highlight=False, soft_wrap=True)
    try:
        for line in install_notifier(cluster, node, prefix):
            out.print(for_terminal(line), markup=False, highlight=False)
    except ValueError as exc:
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG) from None
    except RemoteError as exc:
        # One line however wide the terminal: the sudoers line in it is copied as it is.
        err.print(for_terminal(exc), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED) from None


@app.command("install-controller", rich_help_panel=SETUP)
def install_controller_command(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", metavar="FILE", help="Install as /etc/vllm-redeploy/<cluster>.toml"
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="Cluster name (default: the configuration's name)"),
    ] = None,
    prefix: Annotated[
        str, typer.Option(metavar="DIR", help="Install below this root (images, chroots)")
    ] = "/",
    bin_dir: Annotated[
        str | None,
        typer.Option(metavar="DIR", help="Where the units find vllm-redeploy and prefect"),
    ] = None,
    enable: Annotated[bool, typer.Option("--enable", help="daemon-reload and enable")] = False,
) -> None:
    """Install the controller's systemd units (Prefect server; serve, webhook and watch of a
    cluster), their user and settings (idempotent); prints what changed."""
    if config is not None:
        loaded = load_or_exit(config)
        name = loaded.name
        if local := [n.name for n in loaded.nodes if n.transport == "local"]:
            err.print(
                f'{shown(config)}: node {shown(local[0])} has transport = "local", but the '
                "units run the flow in a sandbox (no devices, no netlink, /home hidden, a user "
                "outside the docker group), where a local node's nvidia-smi, ip and docker "
                "would fail for the wrong reason. Reach it over SSH like the others: "
                'transport = "ssh" with address = "127.0.0.1" and its login (ssh_user), whose '
                "host key goes into the service's known_hosts; nothing was installed",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_CONFIG)
        if cluster not in (None, name):
            err.print(f"--cluster {shown(cluster)} but {config} names {shown(name)}", markup=False)
            raise typer.Exit(EXIT_CONFIG)
        cluster = name
    from deployments.install_controller import InstallError, install_controller

    try:
        lines = install_controller(
            prefix, cluster=cluster, config_file=config, bin_dir=bin_dir, enable=enable
        )
    except (ValueError, InstallError) as exc:
        err.print(for_terminal(exc), markup=False, highlight=False)
        raise typer.Exit(EXIT_CONFIG if isinstance(exc, ValueError) else EXIT_FAILED) from None
    except OSError as exc:  # a file it writes: read-only, no space, ...
        where = f"{exc.filename}: " if exc.filename else ""
        err.print(f"install-controller: {where}{for_terminal(exc.strerror or exc)}", markup=False)
        raise typer.Exit(EXIT_FAILED) from None
    for line in lines:  # one line each, however wide: the commands in them are copied as they are
        out.print(for_terminal(line), markup=False, highlight=False, soft_wrap=True)
