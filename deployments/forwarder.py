"""The reboot webhook's spool, forwarded to Prefect by a process that is not network-facing.

The webhook holds no Prefect credential: it only writes each accepted notice to its spool. The
watcher of the cluster (the services' user, which holds the credential) reads that spool and
posts what it finds, but never a file as it is: each event is built again here from the few
fields a reboot has (the cluster's own name, a node of it, a boot id, an uptime; or the boots of
a round), so whoever controls the webhook can at most ask for an after-reboot redeploy of this
cluster. Anything else is set aside as ``.bad``, with the reason in the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.events import (
    EVENT_CLUSTER_REBOOTED,
    EVENT_REBOOTED,
    LABEL_NODE,
    RESOURCE_LABEL_CLUSTER,
    cluster_rebooted_event,
    reboot_event,
)

log = logging.getLogger("vllm_redeploy.events")
SCAN_S = 1.0
MAX_FILE_BYTES = 16 * 1024  # a reboot event is a few hundred bytes
MAX_BOOT_ID = 64


class NotAReboot(ValueError):
    """A spooled file that is not a reboot of this cluster as the webhook writes it."""


def rebuilt(config: ClusterConfig, event: Any) -> dict[str, Any]:
    """The event to post for a spooled ``event``, built from its checked fields only."""
    if not isinstance(event, dict):
        raise NotAReboot("not a JSON object")
    name = event.get("event")
    resource = event.get("resource") if isinstance(event.get("resource"), dict) else {}
    payload = event.get("payload") if isinstance(event.get("payload"), dict) else {}
    if resource.get(RESOURCE_LABEL_CLUSTER) != config.name:
        raise NotAReboot(f"not an event of cluster {config.name}")
    nodes = {n.name for n in config.nodes}
    if name == EVENT_REBOOTED:
        node = resource.get(LABEL_NODE)
        if node not in nodes:
            raise NotAReboot(f"{str(node)[:64]!r} is not a node of {config.name}")
        uptime = payload.get("uptime_s")
        if not isinstance(uptime, int | float) or not math.isfinite(uptime) or uptime < 0:
            raise NotAReboot("its uptime_s is not a number of seconds")
        return reboot_event(config.name, node, _boot_id(payload.get("boot_id")), float(uptime))
    if name == EVENT_CLUSTER_REBOOTED:
        boots = payload.get("boots")
        if not isinstance(boots, dict) or not boots or not set(boots) <= nodes:
            raise NotAReboot(f"its boots name no node, or one not of {config.name}")
        checked = {node: _boot_id(boot) for node, boot in boots.items()}
        waited = payload.get("waited_s")
        if not isinstance(waited, int | float) or not math.isfinite(waited) or waited < 0:
            raise NotAReboot("its waited_s is not a number of seconds")
        missing = sorted(nodes - set(checked))
        return cluster_rebooted_event(config.name, checked, missing, float(waited))
    raise NotAReboot(f"{str(name)[:64]!r} is not a reboot event")


def _boot_id(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_BOOT_ID or not value.isprintable():
        raise NotAReboot("its boot id is not a short printable string")
    return value


def planted_by_others(spool: Path) -> str | None:
    """Why ``spool`` cannot be trusted: a user outside the webhook's user and group could write
    there. None when it is sound or not there (no webhook has run yet)."""
    try:
        mode = spool.stat().st_mode
    except OSError:
        return None
    if mode & 0o002:
        return (
            f"the webhook's spool {spool} has mode {mode & 0o7777:04o}: any user could plant a "
            f"reboot there, so nothing in it is posted. Run `chmod o-w {spool}`"
        )
    return None


class Forwarder:
    """Hands each new file of ``spool`` to ``adopt`` (``EventSender.adopt``: posted, then the
    file removed), once, after checking it; sets aside what is not a reboot of the cluster."""

    def __init__(
        self,
        config: ClusterConfig,
        spool: Path,
        adopt: Callable[[dict[str, Any], Path], bool],
    ) -> None:
        self.config, self.spool, self._adopt = config, spool, adopt
        self._handed: set[tuple[int, str]] = set()
        self._said: str | None = None

    def scan(self) -> int:
        """Hand over what is new in the spool (oldest first); how many were handed."""
        problem = planted_by_others(self.spool) or planted_by_others(self.spool.parent)
        if problem != self._said and problem is not None:
            log.error("%s: %s", self.config.name, problem)
        self._said = problem
        if problem is not None:
            return 0
        try:
            files = self._files()
        except OSError as exc:
            log.warning("cannot read the webhook's spool %s: %s", self.spool, exc)
            return 0
        handed = 0
        for key in files:
            _, name = key
            path = self.spool / name
            if key in self._handed:
                continue
            try:
                if path.stat().st_size > MAX_FILE_BYTES:
                    raise NotAReboot(f"larger than {MAX_FILE_BYTES} bytes")
                event = rebuilt(self.config, json.loads(path.read_bytes()))
            except FileNotFoundError:
                continue  # delivered and removed meanwhile
            except (OSError, ValueError) as exc:
                log.error("%s is not a reboot of %s (%s): set aside as .bad", path,
                          self.config.name, exc)  # fmt: skip
                path.replace(path.with_suffix(".bad"))
                continue
            if self._adopt(event, path):
                self._handed.add(key)
                handed += 1
        self._handed &= set(files)  # delivered ones are gone: forget them
        return handed

    def _files(self) -> list[tuple[int, str]]:
        """The spool's events, oldest first, each by its time and name: one written again
        under the same name (the same boot, accepted again after a restart) is new."""
        found = []
        for path in self.spool.glob("*.json"):
            with contextlib.suppress(FileNotFoundError):  # delivered and removed meanwhile
                found.append((path.stat().st_mtime_ns, path.name))
        return sorted(found)

    def run(self, stop: threading.Event) -> None:
        """Scan until ``stop``; a scan that fails is said and tried again."""
        while not stop.wait(SCAN_S):
            try:
                self.scan()
            except Exception as exc:  # the next scan tries again
                log.warning("%s: cannot forward the webhook's spool: %s", self.config.name, exc)
