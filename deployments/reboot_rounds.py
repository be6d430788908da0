"""When a cluster is back from a reboot: as soon as every node reported its new boot, or
``reboot_delay_s`` after the first report, whichever comes first (a node that never reports is
still waited for by the run's preflight). The webhook feeds it every accepted report; it hands one
``vllm.cluster.rebooted`` event per round to the sender, and the after-reboot deployment runs on
that event, with no fixed wait.

A round opens with the first report of a boot not counted yet; a notifier repeating a boot counts
once. With a state file (the webhook's, beside its spool) the round outlives a restart of the
webhook: the boots counted and the round's reports are written there at each report, and a
webhook started mid-round closes it when it would have. A cluster event the sender cannot take
(its spool's disk full) is offered again every RETRY_S until taken: it is what starts the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.events import cluster_rebooted_event

log = logging.getLogger("vllm_redeploy.webhook")
RETRY_S = 30.0


class RebootRounds:
    """One cluster's rounds of boot reports."""

    def __init__(
        self,
        config: ClusterConfig,
        submit: Callable[[dict[str, Any]], bool],
        state: Path | None = None,
    ) -> None:
        self.cluster = config.name
        self.nodes = [n.name for n in config.nodes]
        self.delay_s = config.webhook.reboot_delay_s
        self._submit = submit
        self._state = state
        self._lock = threading.Lock()
        self._counted: dict[str, str] = {}  # node -> the last boot id counted in any round
        self._round: dict[str, str] = {}  # node -> boot id, this round's reports
        self._opened = 0.0  # time.time() of the round's first report
        self._timer: threading.Timer | None = None  # the open round's deadline
        self._retries: list[threading.Timer] = []  # cluster events offered again
        self._closed = False
        self._load()

    def reported(self, node: str, boot_id: str) -> None:
        with self._lock:
            if self._counted.get(node) == boot_id:
                return  # a notifier retrying a boot already counted
            self._counted[node] = boot_id
            if not self._round:
                self._opened = time.time()
                self._timer = self._arm(self.delay_s, self._deadline)
            self._round[node] = boot_id
            if set(self._round) >= set(self.nodes):
                self._close()
            self._save()

    def close(self) -> None:
        """Stop waiting (the webhook stops): an open round emits nothing."""
        with self._lock:
            self._closed = True
            for timer in [self._timer, *self._retries]:
                if timer is not None:
                    timer.cancel()

    def _deadline(self) -> None:
        with self._lock:
            if self._round and not self._closed:
                self._close()
                self._save()

    def _arm(self, delay_s: float, then: Callable[[], None]) -> threading.Timer:
        timer = threading.Timer(max(delay_s, 0.0), then)
        timer.daemon = True
        timer.start()
        return timer

    def _load(self) -> None:
        """The counted boots and the open round a webhook before this one left."""
        if self._state is None or not self._state.exists():
            return
        try:
            saved = json.loads(self._state.read_text())
            counted, opened = dict(saved["counted"]), float(saved["opened"])
            round_ = {n: b for n, b in dict(saved["round"]).items() if n in self.nodes}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: the reboot round in %s is unreadable (%s): a new one opens with "
                        "the next report", self.cluster, self._state, exc)  # fmt: skip
            return
        self._counted = {str(n): str(b) for n, b in counted.items()}
        if round_:
            self._round, self._opened = round_, opened
            left = opened + self.delay_s - time.time()
            log.info("%s: a reboot round is open since %s (%s reported): it closes in %.0f s",
                     self.cluster, time.strftime("%H:%M:%S", time.localtime(opened)),
                     ", ".join(sorted(round_)), max(left, 0))  # fmt: skip
            self._timer = self._arm(left, self._deadline)

    def _save(self) -> None:
        if self._state is None:
            return
        data = {"counted": self._counted, "round": self._round, "opened": self._opened}
        tmp = self._state.with_name(f".{self._state.name}.tmp")
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self._state)
        except OSError as exc:  # the round goes on in memory
            log.warning("%s: cannot keep the reboot round in %s: %s", self.cluster,
                        self._state, exc.strerror)  # fmt: skip
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        boots, self._round = self._round, {}
        missing = [n for n in self.nodes if n not in boots]
        waited = time.time() - self._opened
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
        self._offer(event)

    def _offer(self, event: dict[str, Any]) -> None:
        if self._submit(event) or self._closed:
            return
        log.warning("%s: the cluster's reboot event could not be queued: offered again in %g s",
                    self.cluster, RETRY_S)  # fmt: skip
        self._retries = [t for t in self._retries if t.is_alive()]
        self._retries.append(self._arm(RETRY_S, lambda: self._offer(event)))
