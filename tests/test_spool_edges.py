"""The spool's edges: a full disk is said as such (507, not "queue full"), and one event Prefect
refuses sets only itself aside, as ``.bad``, while the others of its batch are delivered."""

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
from deployments.webhook import running_webhook, serve_webhook, spool_problem
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
        spool = disk / "spool"
        sender = EventSender(UNREACHABLE, spool_dir=spool)
        with contextlib.suppress(OSError):  # fill it: what a runaway log does to a disk
            (disk / "filler").write_bytes(b"x" * 128 * 1024)
        try:
            body, headers = signed(secret, notice())
            with running_webhook(config, sender) as url:
                answer = httpx.post(f"{url}/reboot", content=body, headers=headers, timeout=10)
        finally:
            sender.close(timeout=0.5)
    assert answer.status_code == 507, answer.text
    detail = answer.json()["error"]
    assert "cannot keep the notice" in detail and "No space left on device" in detail
    assert "free space there" in detail and answer.headers["Retry-After"] == "30"
    assert sender.pending == 0  # nothing queued that is not kept


def test_one_event_prefect_refuses_is_set_aside_and_its_batch_delivered(prefect_api: str) -> None:
    cluster = f"sp{uuid.uuid4().hex[:6]}"
    spool = Path(tempfile.mkdtemp(prefix="vrd-spool-"))
    good = [reboot_event(cluster, f"node-{i}", str(uuid.uuid4()), 42.0) for i in (1, 2, 3)]
    bad = {"id": str(uuid.uuid4()), "event": "vllm.cluster.rebooted"}  # no resource: a 422
    offline = EventSender(UNREACHABLE, spool_dir=spool)  # Prefect away: kept in the spool
    for event in (good[0], bad, good[1], good[2]):
        assert offline.submit(event)
    offline.close(timeout=0.2)
    assert len(list(spool.glob("*.json"))) == 4
    sender = EventSender(prefect_api, spool_dir=spool)  # back: the four go as one batch
    assert sender.close(timeout=30)
    assert (sender.sent, sender.dropped) == (3, 1)
    assert [p.name for p in spool.iterdir()] == [f"{bad['id']}.bad"]
    deadline = time.monotonic() + 30
    while len(stored := prefect_events(prefect_api, cluster)) < 3 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert sorted(e["id"] for e in stored) == sorted(e["id"] for e in good)


def test_a_spool_others_could_write_is_refused_before_the_webhook_serves(tmp_path: Path) -> None:
    """Every file in the spool is posted to Prefect with the webhook's credential."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o700)
    spool.chmod(0o777)
    config = make_config(f"sp{uuid.uuid4().hex[:6]}", secrets.token_hex(32), spool_dir=str(spool))
    with pytest.raises(ValueError, match=r"has mode 0777: other users could read or plant") as bad:
        serve_webhook(config, "127.0.0.1", free_port("127.0.0.1"))
    assert f"chmod 700 {spool}" in str(bad.value)
    os.chown(spool, 65534, -1)  # nobody's
    with pytest.raises(ValueError, match=r"belongs to UID 65534, not to this service's user"):
        serve_webhook(config, "127.0.0.1", free_port("127.0.0.1"))
    os.chown(spool, os.geteuid(), -1)
    spool.chmod(0o700)
    assert spool_problem(spool) is None
