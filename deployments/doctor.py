"""`vllm-redeploy doctor`: the controller's side of a cluster in one look, each problem with
its fix. Nothing is changed: every check reads (the Prefect API, files here, each node over
SSH, the webhook's /healthz)."""

from __future__ import annotations

import hashlib
import stat
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from deployments.install_notifier import UNIT_NAME, file_states, notifier_files
from vllm_redeploy.config import ClusterConfig, NodeConfig
from vllm_redeploy.config.loading import cluster_env_file
from vllm_redeploy.names import deployment_name, lock_name
from vllm_redeploy.nodes import NodeAccess, RemoteError, fan_out
from vllm_redeploy.safe_text import one_line, shown

TRIGGERS = ("nightly", "after-reboot", "recover", "manual")
HTTP_TIMEOUT_S = 5.0
# Python's urllib on the node, as the notifier itself calls the webhook (no curl assumed).
REACH = (
    "import sys, urllib.request\n"
    "with urllib.request.urlopen(sys.argv[1], timeout=5) as answer: print(answer.status)"
)


@dataclass(frozen=True)
class Finding:
    """One thing looked at: fine, or a problem with its fix."""

    area: str  # "prefect api", "deployments", "ssh key", "node-1", ...
    ok: bool
    said: str
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def deployments(config: ClusterConfig) -> Finding:
    """The cluster's four deployments registered, and served (their serve process polls)."""
    from prefect import get_client
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.exceptions import ObjectNotFound

    missing, idle = [], []
    with get_client(sync_client=True) as client:
        for trigger in TRIGGERS:
            name = deployment_name(config.name, trigger)
            try:
                found = client.read_deployment_by_name(f"redeploy-vllm-cluster/{name}")
            except ObjectNotFound:
                missing.append(name)
                continue
            if found.status != DeploymentStatus.READY:
                idle.append(name)
    unit = f"vllm-redeploy-serve@{config.name}"
    if missing:
        return Finding(
            "deployments", False, f"not registered: {', '.join(missing)}",
            f"start the serve service (`sudo systemctl start {unit}`), or `vllm-redeploy serve "
            "-c FILE`",
        )  # fmt: skip
    if idle:
        return Finding(
            "deployments", False,
            f"registered but no serve process polls them (not ready): {', '.join(idle)}; "
            "their runs would wait, unstarted",
            f"`sudo systemctl status {unit}`; start it, or `vllm-redeploy serve -c FILE`",
        )  # fmt: skip
    return Finding("deployments", True, f"{', '.join(TRIGGERS)}: registered and served")


def watcher(config: ClusterConfig) -> Finding:
    """The watcher looks at the cluster: it said so in Prefect lately."""
    from tasks.standing.marks import watcher_beat

    beat = watcher_beat(config.name)
    fix = f"`sudo systemctl status vllm-redeploy-watch@{config.name}`, or `vllm-redeploy watch`"
    if beat is None:
        return Finding("watcher", False, "never seen: nothing notices the model going down", fix)
    if not beat.alive():
        return Finding("watcher", False, f"silent: it last {beat.describe()}", fix)
    return Finding("watcher", True, beat.describe())


def lock(config: ClusterConfig) -> Finding:
    """The cluster's lock on the Prefect server: one slot, enforced, and who holds it now."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from tasks.standing.lock import holder

    name = lock_name(config.name)
    with get_client(sync_client=True) as client:
        leases = _lease_storage(client)
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return Finding("lock", True, f"{name}: not made yet (the first run makes it){leases}")
    if limit.limit != 1 or not limit.active:
        allows = f"allows {limit.limit} runs at once" if limit.active else "is disabled"
        return Finding(
            "lock", False, f"{name} {allows}: two runs could change the nodes together",
            f"`prefect gcl update {name} --limit 1 --enable` (the next run also sets it right)",
        )  # fmt: skip
    now = holder(config)
    if now is not None:
        said = f"held{now.described()}, last beat {now.age_s():.0f} s ago"
    elif limit.active_slots:
        # Not a problem to fix: the next run frees a gone holder's slot itself.
        said = "free (a slot still counted for a gone holder: runs free it)"
    else:
        said = "free"
    return Finding("lock", True, said + leases)


def _lease_storage(client: Any) -> str:
    """Where the server keeps the lock's leases, in words ("" when it does not say)."""
    try:
        where = client.request("GET", "/admin/settings").json()["server"]["concurrency"]
        kind = str(where["lease_storage"]).rsplit(".", 1)[-1]
    except Exception:  # an older server, or one that hides its settings: nothing to add
        return ""
    if kind == "memory":
        return (
            "; leases in the server's memory (a restart forgets them; the holder takes its "
            "slot back)"
        )
    return f"; leases in {kind} storage (they outlive a restart of the server)"


def ssh_files(config: ClusterConfig) -> list[Finding]:
    """The key files (readable by this user only) and known_hosts (there)."""
    found = []
    keys = {n.ssh_key_file or config.ssh.key_file for n in config.nodes} - {None}
    for key in sorted(keys):  # type: ignore[type-var]
        path = key.expanduser()  # type: ignore[union-attr]
        if not path.is_file():
            found.append(Finding("ssh key", False, f"{path} does not exist", "fix ssh.key_file"))
        elif stat.S_IMODE(path.stat().st_mode) & 0o077:
            mode = f"{stat.S_IMODE(path.stat().st_mode):o}"
            said = f"{path} is readable by others (mode {mode}): ssh refuses such a key"
            found.append(Finding("ssh key", False, said, f"`chmod 600 {path}`"))
        else:
            found.append(Finding("ssh key", True, f"{path}, readable by its owner only"))
    known = config.ssh.known_hosts.expanduser()
    if not known.is_file():
        fix = "`ssh-keyscan -H NODE >> FILE` for each node, checked against the node's console"
        found.append(Finding("known_hosts", False, f"{known} does not exist", fix))
    else:
        found.append(Finding("known_hosts", True, f"{known}"))
    return found


def env_file(config_path: Path) -> Finding:
    """The cluster's env file (its secrets) readable by no one but its owner and group."""
    path = cluster_env_file(config_path)
    if not path.is_file():
        return Finding("env file", True, f"none ({path}): secrets come from the environment")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o007:
        return Finding(
            "env file", False, f"{path} is readable by every user (mode {mode:o}): secrets",
            f"`chmod 640 {path}`",
        )  # fmt: skip
    return Finding("env file", True, f"{path} (mode {mode:o})")


def webhook(config: ClusterConfig) -> Finding:
    """The webhook answers at the address the nodes are given."""
    url = config.webhook.url
    if url is None:
        return Finding(
            "webhook", False, "webhook.url is not set: no node can say it rebooted",
            "set [webhook] url to the address at which the nodes reach the controller",
        )  # fmt: skip
    try:
        answer = httpx.get(f"{url.rstrip('/')}/healthz", timeout=HTTP_TIMEOUT_S)
        answer.raise_for_status()
    except httpx.HTTPError as exc:
        return Finding(
            "webhook", False, f"{url}/healthz: {one_line(exc)}",
            f"`sudo systemctl status vllm-redeploy-webhook@{config.name}`",
        )  # fmt: skip
    pending = answer.json().get("pending_events", 0)
    return Finding(
        "webhook", True, f"{url} answers ({pending} notices its watcher has not posted to Prefect "
        "yet: `vllm-redeploy watch` posts them)",
    )  # fmt: skip


def node(config: ClusterConfig, member: NodeConfig) -> list[Finding]:
    """Reachable; its notifier installed, current and enabled; the webhook reached from it;
    its clock close enough to ours for the webhook's replay window."""
    area = member.name
    with NodeAccess(member, config) as access:
        runner = access.runner
        try:
            sent = time.time()
            remote = float(runner.run(["date", "+%s.%N"], timeout=10).stdout)
            offset = remote - (sent + time.time()) / 2
        except (RemoteError, ValueError) as exc:
            return [Finding(area, False, f"not reached: {one_line(exc)}", "`vllm-redeploy nodes`")]
        found = [_clock(config, area, offset)]
        found.append(_notifier(config, area, runner))
        if config.webhook.url is not None:
            found.append(_reach(config, area, runner))
    return found


def _clock(config: ClusterConfig, area: str, offset: float) -> Finding:
    window = config.webhook.replay_window_s
    if abs(offset) > window / 2:
        return Finding(
            area, False,
            f"its clock is {offset:+.0f} s off this one's: the webhook refuses a signed call "
            f"outside ±{window:g} s",
            "turn on time sync there (`sudo timedatectl set-ntp true`)",
        )  # fmt: skip
    return Finding(area, True, f"clock {offset:+.1f} s from this one's")


def _notifier(config: ClusterConfig, area: str, runner: Any) -> Finding:
    fix = f"`vllm-redeploy install-notifier {shown(area)} -c FILE`"
    try:
        files = notifier_files(config, area)
        states = file_states(runner, files)
        enabled = runner.run(["systemctl", "is-enabled", UNIT_NAME], check=False, timeout=10)
    except (ValueError, RemoteError) as exc:
        return Finding(area, False, f"notifier not checked: {one_line(exc)}", fix)
    missing = [f.label for f, s in zip(files, states, strict=True) if s == "missing"]
    changed = [
        f.label
        for f, s in zip(files, states, strict=True)
        if s != "missing"
        and s.partition(" ")[2] not in ("-", hashlib.sha256(f.content).hexdigest())
    ]
    if missing:
        return Finding(area, False, f"notifier not installed ({', '.join(missing)} missing)", fix)
    if changed:
        return Finding(area, False, f"notifier out of date ({', '.join(changed)} differ)", fix)
    if enabled.stdout.strip() != "enabled":
        return Finding(area, False, "notifier installed but its unit is not enabled", fix)
    return Finding(area, True, "notifier installed, current and enabled")


def _digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _reach(config: ClusterConfig, area: str, runner: Any) -> Finding:
    url = f"{(config.webhook.url or '').rstrip('/')}/healthz"
    done = runner.run(["python3", "-c", REACH, url], check=False, timeout=15)
    if done.exit_code != 0:
        said = one_line(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
        return Finding(
            area, False, f"does not reach the webhook at {url}: {said or 'no answer'}",
            "open the webhook's port to the nodes, or set [webhook] url to an address they reach",
        )  # fmt: skip
    return Finding(area, True, f"reaches the webhook ({url})")


def nodes(config: ClusterConfig) -> list[Finding]:
    """Every node, in parallel."""
    outcomes = fan_out(config.nodes, lambda member: node(config, member))
    found: list[Finding] = []
    for outcome in outcomes:
        if outcome.value is not None:
            found += outcome.value
        else:
            found.append(Finding(outcome.node, False, f"not reached: {one_line(outcome.error)}"))
    return found


def problems(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if not f.ok]
