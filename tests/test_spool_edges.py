"""The spool's edges: a full disk is said as such (507, not "queue full"); one event Prefect
refuses sets only itself aside, as ``.bad``, while the others of its batch are delivered; a
file planted in the spool is posted only as the reboot of the cluster it could be, or set
aside; a spool others could write is refused by the webhook and left alone by the watcher."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments.event_sender import EventSender
from deployments.forwarder import Forwarder
from deployments.spool import Spool, spool_problem, write_event
from deployments.webhook import running_webhook, serve_webhook
from tests.test_webhook import make_config, notice, prefect_events, signed
from tests.testbed.procs import free_port
from vllm_redeploy.events import reboot_event

pytestmark = pytest.mark.integration
UNREACHABLE = "http://127.0.0.1:9/api"


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on a fresh directory."""
    where = Path(tempfile.mkdtemp(prefix="vrd-spool-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], check=False)
        where.rmdir()


def test_a_notice_the_full_spool_cannot_keep_is_answered_507_saying_so() -> None:
    secret = secrets.token_hex(32)
    config = make_config(f"sp{uuid.uuid4().hex[:6]}", secret, reboot_delay_s=3600)
    with tmpfs("64k") as disk:
        spool = Spool(disk / "spool", [config.name])
        with contextlib.suppress(OSError):  # fill it: what a runaway log does to a disk
            (disk / "filler").write_bytes(b"x" * 128 * 1024)
        body, headers = signed(secret, notice())
        with running_webhook(config, spool) as url:
            answer = httpx.post(f"{url}/reboot", content=body, headers=headers, timeout=10)
        left = list((disk / "spool" / config.name).iterdir())
    assert answer.status_code == 507, answer.text
    detail = answer.json()["error"]
    assert "cannot keep the notice" in detail and "No space left on device" in detail
    assert "free space there" in detail and answer.headers["Retry-After"] == "30"
    assert left == []  # nothing half-written left to post


def test_one_event_prefect_refuses_is_set_aside_and_its_batch_delivered(prefect_api: str) -> None:
    cluster = f"sp{uuid.uuid4().hex[:6]}"
    spool = Path(tempfile.mkdtemp(prefix="vrd-spool-"))
    good = [reboot_event(cluster, f"node-{i}", str(uuid.uuid4()), 42.0) for i in (1, 2, 3)]
    bad = {"id": str(uuid.uuid4()), "event": "vllm.cluster.rebooted"}  # no resource: a 422
    files = [write_event(spool, event) for event in (good[0], bad, good[1], good[2])]
    sender = EventSender(prefect_api)  # adopted at once: in one batch, or a few
    for event, path in zip((good[0], bad, good[1], good[2]), files, strict=True):
        assert sender.adopt(event, path)
    assert sender.close(timeout=30)
    assert (sender.sent, sender.dropped) == (3, 1)
    assert [p.name for p in spool.iterdir()] == [f"{bad['id']}.bad"]
    deadline = time.monotonic() + 30
    while len(stored := prefect_events(prefect_api, cluster)) < 3 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert sorted(e["id"] for e in stored) == sorted(e["id"] for e in good)


def test_a_planted_file_is_posted_only_as_a_reboot_of_the_cluster_or_set_aside(
    prefect_api: str, tmp_path: Path
) -> None:
    """Whoever writes the spool (a flaw in the webhook) can at most report a reboot of this
    cluster: a forged flow-run event, another cluster's event, extra fields, are not posted."""
    config = make_config(f"sp{uuid.uuid4().hex[:6]}", secrets.token_hex(32))
    spool = tmp_path / config.name
    spool.mkdir()
    run = str(uuid.uuid4())
    flow_run = {"prefect.resource.id": f"prefect.flow-run.{run}"}
    forged = {"id": str(uuid.uuid4()), "event": "prefect.flow-run.heartbeat", "resource": flow_run}
    other = reboot_event("another", "node-1", str(uuid.uuid4()), 1.0)
    padded = reboot_event(config.name, "node-1", str(uuid.uuid4()), 5.0)
    padded["payload"]["command"] = "rm -rf /"  # fields it never writes: not carried over
    padded["related"] = [{**flow_run, "prefect.resource.role": "flow-run"}]
    paths = [write_event(spool, e) for e in (forged, other, padded)]
    sender = EventSender(prefect_api)
    try:
        assert Forwarder(config, spool, sender.adopt).scan() == 1
    finally:
        assert sender.close(timeout=30)
    assert sorted(p.name for p in spool.iterdir()) == sorted(
        p.with_suffix(".bad").name for p in paths[:2]
    )
    deadline = time.monotonic() + 30
    while not (stored := prefect_events(prefect_api, config.name)) and time.monotonic() < deadline:
        time.sleep(0.25)
    (posted,) = stored
    assert posted["id"] == padded["id"] and "command" not in posted["payload"]
    assert not posted.get("related")


def test_a_spool_others_could_write_is_refused_by_the_webhook_and_the_watcher(
    tmp_path: Path,
) -> None:
    """A reboot found in the spool becomes a redeploy: only the webhook's user and the
    watchers' group may write there."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    spool.chmod(0o777)
    config = make_config(f"sp{uuid.uuid4().hex[:6]}", secrets.token_hex(32), spool_dir=str(spool))
    with pytest.raises(ValueError, match=r"has mode 0777: other users could read or plant") as bad:
        serve_webhook(config, "127.0.0.1", free_port("127.0.0.1"))
    assert f"chmod o= {spool}" in str(bad.value)
    (spool / config.name).mkdir()
    planted = write_event(spool / config.name, reboot_event(config.name, "node-1", "b", 1.0))
    handed: list[Path] = []
    forwarder = Forwarder(config, spool / config.name, lambda _e, p: bool(handed.append(p)) or True)
    assert forwarder.scan() == 0 and handed == [] and planted.exists()
    spool.chmod(0o2770)  # the webhook's user and the watchers' group: sound
    assert spool_problem(spool) is None and forwarder.scan() == 1
    os.chown(spool, 65534, -1)  # nobody's
    with pytest.raises(ValueError, match=r"belongs to UID 65534, not to this service's user"):
        serve_webhook(config, "127.0.0.1", free_port("127.0.0.1"))
