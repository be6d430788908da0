"""The reboot webhook's spool: where each accepted notice waits, one file per event, until the
watcher of its cluster has posted it to Prefect (``deployments.forwarder``).

The webhook holds no Prefect credential, so this is all it does with an event. The spool is one
directory per cluster under a base both services name (``webhook.spool_dir``, else the user's
state directory). Under systemd the base belongs to the webhook's user and the watchers' group
(install-controller makes it, mode 2770): the webhook writes, the watcher reads and removes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pwd
import shlex
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deployments.event_sender import Refusal
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.events import RESOURCE_LABEL_CLUSTER

MAX_FILES = 1000  # per cluster: a forwarder that is this far behind is not running
FILE_MODE = 0o640  # the watchers' group reads it
DIR_MODE = 0o770  # and removes what it posted


def spool_base(configs: Sequence[ClusterConfig]) -> Path:
    """The base every cluster in ``configs`` names: webhook.spool_dir, else webhook-spool under
    $XDG_STATE_HOME/vllm-redeploy or ~/.local/state/vllm-redeploy (one user runs both services).
    ValueError where the clusters name different ones."""
    named = {c.webhook.spool_dir for c in configs}
    if len(named) > 1:
        listed = ", ".join(f"{c.name}: {c.webhook.spool_dir}" for c in configs)
        raise ValueError(
            f"the clusters name different webhook.spool_dir ({listed}); one webhook has one: "
            "set the same webhook.spool_dir in every cluster's configuration"
        )
    explicit = named.pop()
    if explicit is not None:
        return Path(explicit)
    xdg = os.environ.get("XDG_STATE_HOME")
    state = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return state / "vllm-redeploy" / "webhook-spool"


def spool_of(config: ClusterConfig) -> Path:
    """The directory the cluster's accepted notices wait in."""
    return spool_base([config]) / config.name


def spool_problem(base: Path) -> str | None:
    """Why the webhook must not use ``base``: a reboot found there becomes a redeploy, so only
    the webhook's user (the owner) and the watchers' group may write there, never others."""
    try:
        found = base.stat()
    except FileNotFoundError:
        return None  # made at the start
    except OSError as exc:
        return f"cannot read the spool directory {base}: {exc.strerror}"
    user = pwd.getpwuid(os.geteuid()).pw_name
    fix = f"chown {user} {shlex.quote(str(base))} && chmod o= {shlex.quote(str(base))}"
    if found.st_uid != os.geteuid():
        return (
            f"the spool directory {base} belongs to UID {found.st_uid}, not to this service's "
            f"user {user}: whoever owns it could plant reboots that a watcher turns into "
            f"redeploys. Run `{fix}`, or set webhook.spool_dir to a directory of {user}"
        )
    if found.st_mode & 0o007:
        return (
            f"the spool directory {base} has mode {found.st_mode & 0o7777:04o}: other users "
            f"could read or plant reboots that a watcher turns into redeploys. Run `{fix}`"
        )
    return None


class Spool:
    """The webhook's sender: ``offer`` keeps the event as a file in its cluster's directory,
    whole and on disk before it returns, or says why not."""

    def __init__(self, base: Path, clusters: Sequence[str]) -> None:
        self.base = base
        self._dirs = {name: base / name for name in clusters}
        base.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for directory in self._dirs.values():
            directory.mkdir(mode=DIR_MODE, exist_ok=True)
            for stale in directory.glob(".*.tmp"):  # a write cut short: never accepted
                stale.unlink(missing_ok=True)

    @property
    def pending(self) -> int:
        """Notices kept and not yet posted by a watcher."""
        return sum(_count(d) for d in self._dirs.values())

    def offer(self, event: dict[str, Any]) -> Refusal | None:
        """None once ``event`` is on disk, else why not."""
        cluster = event["resource"][RESOURCE_LABEL_CLUSTER]
        directory = self._dirs[cluster]
        if _count(directory) >= MAX_FILES:
            return Refusal(
                "full", f"{MAX_FILES} notices of {cluster} wait in {directory}: is its watcher "
                f"running? (`systemctl status vllm-redeploy-watch@{cluster}`)"
            )  # fmt: skip
        try:
            write_event(directory, event)
        except OSError as exc:
            disk = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            return Refusal("disk" if disk else "spool", f"{directory}: {exc.strerror}")
        return None

    def close(self, timeout: float = 0.0) -> bool:
        """Nothing is held in memory: what was accepted is on disk."""
        return True


def _count(directory: Path) -> int:
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        return sum(1 for e in entries if e.name.endswith(".json"))
    return 0


def write_event(directory: Path, event: dict[str, Any]) -> Path:
    """``event`` as ``directory/ID.json``, whole or not at all, and on disk before this
    returns; readable by the directory's group."""
    path = directory / f"{_file_name(event['id'])}.json"
    data = json.dumps(event).encode()
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)  # the rename itself survives a power cut
    finally:
        os.close(handle)
    return path


def _file_name(event_id: str) -> str:
    """A file name for an event id: the id when it is a UUID (all of ours), else its digest."""
    try:
        return str(uuid.UUID(event_id))
    except ValueError:
        return hashlib.sha256(event_id.encode()).hexdigest()
