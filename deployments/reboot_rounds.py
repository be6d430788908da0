"""When a cluster is back from a reboot: as soon as every node reported its new boot, or
``reboot_delay_s`` after the first report, whichever comes first (a node that never reports is
still waited for by the run's preflight). The webhook feeds it every accepted report; it hands one
``vllm.cluster.rebooted`` event per round to the sender, and the after-reboot deployment runs on
that event, with no fixed wait.

A round opens with the first report of a boot not counted yet; a notifier repeating a boot counts
once. State lives in this process: a webhook restarted mid-round opens a new one with the next
report, and the run's preflight waits for the nodes either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.events import cluster_rebooted_event

log = logging.getLogger("vllm_redeploy.webhook")


class RebootRounds:
    """One cluster's rounds of boot reports."""

    def __init__(self, config: ClusterConfig, submit: Callable[[dict[str, Any]], bool]) -> None:
        self.cluster = config.name
        self.nodes = [n.name for n in config.nodes]
        self.delay_s = config.webhook.reboot_delay_s
        self._submit = submit
        self._lock = threading.Lock()
        self._counted: dict[str, str] = {}  # node -> the last boot id counted in any round
        self._round: dict[str, str] = {}  # node -> boot id, this round's reports
        self._opened = 0.0
        self._timer: threading.Timer | None = None

    def reported(self, node: str, boot_id: str) -> None:
        with self._lock:
            if self._counted.get(node) == boot_id:
                return  # a notifier retrying a boot already counted
            self._counted[node] = boot_id
            if not self._round:
                self._opened = time.monotonic()
                self._timer = threading.Timer(self.delay_s, self._deadline)
                self._timer.daemon = True
                self._timer.start()
            self._round[node] = boot_id
            if set(self._round) >= set(self.nodes):
                self._close()

    def close(self) -> None:
        """Stop waiting (the webhook stops): an open round emits nothing."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._round = {}

    def _deadline(self) -> None:
        with self._lock:
            if self._round:
                self._close()

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        boots, self._round = self._round, {}
        missing = [n for n in self.nodes if n not in boots]
        waited = time.monotonic() - self._opened
        event = cluster_rebooted_event(self.cluster, boots, missing, waited)
        if missing:
            log.warning(
                "%s: %s reported a new boot, %s not within %g s: the after-reboot run starts now "
                "and its preflight waits for them",
                self.cluster,
                ", ".join(sorted(boots)),
                ", ".join(missing),
                self.delay_s,
            )
        else:
            log.info("%s: every node reported its new boot within %.1f s", self.cluster, waited)
        if not self._submit(event):
            log.warning(
                "%s: the event queue is full: the cluster's reboot event is lost", self.cluster
            )
