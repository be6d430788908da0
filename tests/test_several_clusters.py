"""Several clusters from one controller: each cluster's settings and secrets from its own env file
beside its TOML, nothing shared that would bleed between them; `serve`, the webhook and `status`
take several configurations. The webhook and `serve` talk to the session's real Prefect server."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments.event_sender import EventSender
from deployments.webhook import running_webhook
from tests.test_deployments import deployments_by_name
from tests.test_webhook import notice, signed, wait_for_event
from tests.testbed.procs import free_port, spawn, stop, wait_until
from vllm_redeploy.config import ConfigError, load_clusters, load_config

BIN = Path(sys.executable).parent


def write_cluster(directory: Path, name: str, env: dict[str, str], port: int = 1) -> Path:
    """``NAME.toml`` (two nodes nobody listens for: 127.0.0.x port ``port``) and ``NAME.env``."""
    path = directory / f"{name}.toml"
    path.write_text(
        f'name = "{name}"\n'
        '[vllm]\nimage = "vrd-test/none:1"\nmodel = "/models/none"\n'
        "[ssh]\nconnect_timeout_s = 2\n"
        '[webhook]\nurl = "http://127.0.0.1:8787"\n'
        + "".join(
            f'[[nodes]]\nname = "{name}-{i}"\naddress = "127.0.0.{200 + i}"\nssh_port = {port}\n'
            for i in (1, 2)
        )
    )
    (directory / f"{name}.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    (directory / f"{name}.env").chmod(0o600)
    return path


@pytest.fixture
def two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, str, str]:
    monkeypatch.chdir(tmp_path)  # no .env of the checkout's working directory
    for key in list(os.environ):
        if key.upper().startswith("VLLM_REDEPLOY_"):
            monkeypatch.delenv(key)
    secret_a, secret_b = secrets.token_hex(32), secrets.token_hex(32)
    a = write_cluster(tmp_path, "pair-a", {"VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET": secret_a})
    b = write_cluster(
        tmp_path,
        "pair-b",
        {"VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET": secret_b, "VLLM_REDEPLOY_VLLM__PORT": "30001"},
    )
    return a, b, secret_a, secret_b


def test_each_cluster_reads_its_own_env_file_only(two: tuple[Path, Path, str, str]) -> None:
    a, b, secret_a, secret_b = two
    first, second = load_clusters([a, b])

    assert first.secrets.webhook_secret.get_secret_value() == secret_a  # type: ignore[union-attr]
    assert second.secrets.webhook_secret.get_secret_value() == secret_b  # type: ignore[union-attr]
    assert second.vllm.port == 30001 and first.vllm.port != 30001


def test_a_shared_value_that_would_bleed_refuses_to_start(
    two: tuple[Path, Path, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, _, _ = two
    leaked = "hf_" + secrets.token_hex(8)
    monkeypatch.setenv("VLLM_REDEPLOY_SECRETS__HF_TOKEN", leaked)
    monkeypatch.setenv("VLLM_REDEPLOY_CONFIG", "/etc/x.toml")  # prefect.yaml's, not a setting
    with pytest.raises(ConfigError) as raised:
        load_clusters([a, b])
    text = "; ".join(raised.value.problems)
    assert "VLLM_REDEPLOY_SECRETS__HF_TOKEN" in text and "pair-a.env" in text
    assert "VLLM_REDEPLOY_CONFIG" not in text
    assert leaked not in text
    # One cluster in the process: the environment is that cluster's, as before.
    (only,) = load_clusters([a])
    assert only.secrets.hf_token.get_secret_value() == leaked  # type: ignore[union-attr]


def test_a_dotenv_that_would_bleed_refuses_to_start(two: tuple[Path, Path, str, str]) -> None:
    a, b, _, _ = two
    Path(".env").write_text("# shared\nexport VLLM_REDEPLOY_VLLM__PORT=31000\nOTHER=1\n")

    with pytest.raises(ConfigError) as raised:
        load_clusters([a, b])
    assert "VLLM_REDEPLOY_VLLM__PORT" in raised.value.problems[0]
    assert "OTHER" not in raised.value.problems[0]
    # With one cluster .env is read, and the cluster's own file wins over it.
    assert load_config(a).vllm.port == 31000
    assert load_config(b).vllm.port == 30001


def test_two_files_naming_one_cluster_are_refused(two: tuple[Path, Path, str, str]) -> None:
    a, _, _, _ = two
    copy = a.with_name("copy.toml")
    copy.write_text(a.read_text())

    with pytest.raises(ConfigError, match="name the same cluster"):
        load_clusters([a, copy])


def test_the_cli_says_so_in_one_paragraph_and_exits_2(
    two: tuple[Path, Path, str, str], tmp_path: Path
) -> None:
    a, b, _, _ = two
    env = {"PATH": "/usr/bin:/bin", "VLLM_REDEPLOY_SECRETS__HF_TOKEN": "hf_x" * 8}
    done = subprocess.run(
        [str(BIN / "vllm-redeploy"), "webhook", "-c", str(a), "-c", str(b)],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert "VLLM_REDEPLOY_SECRETS__HF_TOKEN" in done.stderr and "hf_x" not in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.integration
def test_one_webhook_routes_each_cluster_with_its_own_secret(
    two: tuple[Path, Path, str, str], prefect_api: str
) -> None:
    a, b, secret_a, secret_b = two
    first, second = load_clusters([a, b])
    sender = EventSender(prefect_api)
    try:
        with running_webhook([first, second], sender) as url:

            def post(path: str, secret: str, node: str) -> httpx.Response:
                body, headers = signed(secret, notice(node))
                return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=10)

            to_b = post("/clusters/pair-b/reboot", secret_b, "pair-b-2")
            assert to_b.status_code == 202, to_b.text
            event = wait_for_event(prefect_api, "pair-b", to_b.json()["event_id"])
            assert event["resource"]["vllm-redeploy.cluster"] == "pair-b"
            # a's path takes only a's secret and a's nodes; no path without a cluster.
            assert post("/clusters/pair-a/reboot", secret_b, "pair-a-1").status_code == 401
            assert post("/clusters/pair-a/reboot", secret_a, "pair-b-1").status_code == 400
            assert post("/reboot", secret_a, "pair-a-1").status_code == 404
            assert post("/clusters/pair-a/reboot", secret_a, "pair-a-1").status_code == 202
    finally:
        assert sender.close(timeout=10)


def test_the_notifier_is_pointed_at_its_clusters_path(two: tuple[Path, Path, str, str]) -> None:
    from deployments.install_notifier import notifier_files

    a, _, _, _ = two
    env = next(f for f in notifier_files(load_config(a), "pair-a-1") if f.path.endswith(".env"))
    assert b"URL=http://127.0.0.1:8787/clusters/pair-a\n" in env.content


def test_status_shows_every_cluster_and_fails_if_any_is_down(
    two: tuple[Path, Path, str, str], tmp_path: Path
) -> None:
    a, b, _, _ = two
    port = free_port("127.0.0.201")  # nothing listens: both clusters are down
    for path in (a, b):
        path.write_text(path.read_text().replace("ssh_port = 1", f"ssh_port = {port}"))
    cmd = [str(BIN / "vllm-redeploy"), "status", "-c", str(a), "-c", str(b)]
    env = {"PATH": "/usr/bin:/bin"}

    shown = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=90, env=env)
    assert shown.returncode != 0
    reports = json.loads(shown.stdout)
    assert [r["cluster"] for r in reports] == ["pair-a", "pair-b"]
    assert not any(r["healthy"] for r in reports)

    screen = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    assert screen.stdout.index("cluster pair-a") < screen.stdout.index("cluster pair-b")


@pytest.fixture
def serving(two: tuple[Path, Path, str, str], prefect_api: str, tmp_path: Path) -> Iterator[None]:
    a, b, _, _ = two
    env = {"PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = spawn(
        [str(BIN / "vllm-redeploy"), "serve", "-c", str(a), "-c", str(b)],
        tmp_path / "serve.log",
        env,
    )
    try:
        yield
    finally:
        stop(proc)


@pytest.mark.integration
def test_one_serve_process_serves_every_clusters_deployments(
    serving: None, prefect_api: str, two: tuple[Path, Path, str, str], tmp_path: Path
) -> None:
    a, b, _, _ = two
    wanted = {f"pair-{c}-{kind}" for c in "ab" for kind in ("nightly", "recover", "manual")}

    wait_until(
        lambda: wanted <= set(deployments_by_name(prefect_api)),
        90,
        "both clusters' deployments",
        tmp_path / "serve.log",
    )
    found = deployments_by_name(prefect_api)
    # Each run loads its own cluster's file (and so its own env file beside it).
    assert found["pair-a-manual"]["parameters"]["config_path"] == str(a.resolve())
    assert found["pair-b-manual"]["parameters"]["config_path"] == str(b.resolve())
