"""The controller's services: unit files that systemd's own verifier accepts; install-controller
(run twice: the second run changes nothing; as another user it says to run it as root); the bed's
systemd stand-in, which loads unit files as systemd 252 does; the units started by a bed node's
systemd against a real `prefect server start` with an API auth string, which listens on loopback
only and refuses calls without the string while serve, the webhook and a flow run use it; and
compose.yaml, checked by docker-compose when it is installed."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from deployments.cli import app
from deployments.event_sender import EVENT_REBOOTED, node_resource_id, reboot_event_id
from deployments.install_controller import (
    AUTH_CLIENT,
    AUTH_SERVER,
    PREFECT_UNIT,
    SERVICE_USER,
    SOURCE_DIR,
    SPOOL_DIR,
    STATE_DIR,
    WEBHOOK_USER,
    InstallError,
    cluster_units,
    derived_env,
    install_controller,
    read_env,
    unit_files,
)
from deployments.webhook import SECRET_ENV
from tests.test_config import MINIMAL
from tests.test_webhook import notice, signed
from tests.testbed.bed import TestBed
from tests.testbed.node import EmulatedNode
from tests.testbed.procs import answers, descendants, free_port, wait_until
from tests.testbed.standins.units import parse_ini
from vllm_redeploy.config import ConfigError, load_config
from vllm_redeploy.config.loading import cluster_env_file
from vllm_redeploy.nodes import Runner, runner_for

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # this installation: what install-controller points units at
EXAMPLE = REPO / "cluster.example.toml"
UNITS = sorted(p.name for p in SOURCE_DIR.glob("*.service"))
NODE = "node-1"
SERVER_START_S = 120  # a cold `prefect server start` on two busy cores


def _need(program: str, package: str) -> None:
    if shutil.which(program) is None:
        pytest.fail(f"{program} is not installed: run .ci/run (apt-get install {package})", False)


def _verify(paths: list[Path]) -> None:
    _need("systemd-analyze", "systemd")
    done = subprocess.run(
        ["systemd-analyze", "verify", *map(str, paths)], capture_output=True, text=True
    )
    # verify exits 0 on settings it ignores; what it says about them is the failure.
    assert (done.returncode, done.stderr) == (0, ""), done.stderr


# --- the unit files -------------------------------------------------------------------------


def test_the_units_pass_systemd_analyze_and_keep_their_sandbox(tmp_path: Path) -> None:
    # What install-controller enables is what the package ships, and nothing shipped is left out.
    enabled = [PREFECT_UNIT, *(u.replace("@x.", "@.") for u in cluster_units("x"))]
    assert sorted(enabled) == UNITS
    rendered = []
    for name, text in unit_files(str(BIN)).items():
        (tmp_path / name).write_text(text)
        rendered.append(tmp_path / name)
        service = parse_ini(text)["Service"]
        # The webhook, which the network reaches, has a user of its own and nothing of
        # Prefect's: it writes the spool alone, which the watcher reads and posts.
        webhook = name.startswith("vllm-redeploy-webhook@")
        user = WEBHOOK_USER if webhook else SERVICE_USER
        assert service["User"] == [user] and service["Restart"] == ["on-failure"]
        assert service["ExecStart"][0].startswith(f"{BIN}/")
        assert any(f.startswith("/etc/vllm-redeploy/") for f in service["EnvironmentFile"])
        spool = [f"VLLM_REDEPLOY_WEBHOOK__SPOOL_DIR={SPOOL_DIR}"]
        if webhook:
            assert service["Environment"] == spool
            assert service["ReadWritePaths"] == [SPOOL_DIR] and "StateDirectory" not in service
        else:
            assert f"PREFECT_HOME=/var/lib/{user}/prefect" in service["Environment"]
            assert service["StateDirectory"] == [user]
            assert service["StateDirectoryMode"] == ["0700"]
        if name.startswith("vllm-redeploy-watch@"):
            assert set(spool) <= set(service["Environment"])
            assert service["ReadWritePaths"] == [SPOOL_DIR]
        for key, value in {
            "NoNewPrivileges": "yes",
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "PrivateTmp": "yes",
            "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
            "CapabilityBoundingSet": None,  # empty: no capabilities at all
        }.items():
            assert service.get(key, [None]) == ([value] if value else []), key
    _verify(rendered)
    for path in rendered:
        scored = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", "--threshold=20", str(path)],
            capture_output=True,
            text=True,
        )
        assert scored.returncode == 0, scored.stdout[-400:]  # exposure 2.0 of 10 at most
    # What the package ships differs from what is installed only in the bin directory.
    for path in rendered:
        shipped = (SOURCE_DIR / path.name).read_text()
        assert path.read_text() == shipped.replace("/opt/vllm-redeploy/.venv/bin/", f"{BIN}/")


# --- install-controller below a prefix (an image root) ---------------------------------------


def _cli(*args: str) -> list[str]:
    result = CliRunner().invoke(app, ["install-controller", *args])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_an_installation_the_units_cannot_see_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """`pipx install .` (~/.local) or a venv in a home directory: ProtectHome=yes hides it."""
    root = tmp_path / "root"
    root.mkdir()
    hidden = "/home/nvidia/.local/share/pipx/venvs/vllm-redeploy/bin"
    done = CliRunner().invoke(
        app, ["install-controller", "--prefix", str(root), "--bin-dir", hidden]
    )
    assert done.exit_code == 1, done.output
    message = " ".join(done.output.split())
    assert message.startswith(f"install-controller: the units' programs ({hidden}) are under")
    assert "(ProtectHome=yes)" in message and "nothing was installed" in message
    assert "sudo python3 -m venv /opt/vllm-redeploy/.venv" in message
    assert list(root.iterdir()) == []


@pytest.mark.parametrize(
    ("line", "key", "why"),
    [
        ('key_file = "/home/nvidia/.ssh/id_ed25519"', "ssh.key_file", "(ProtectHome=yes)"),
        ('known_hosts = "/root/.ssh/known_hosts"', "ssh.known_hosts", "(ProtectHome=yes)"),
        ('known_hosts = "/tmp/keys/known_hosts"', "ssh.known_hosts", "(PrivateTmp=yes)"),
        ('key_file = "keys/id_ed25519"', "ssh.key_file", "a directory the services do not run in"),
    ],
)
def test_ssh_files_the_units_cannot_read_are_refused_before_anything_is_written(
    tmp_path: Path, line: str, key: str, why: str
) -> None:
    """The flow the units run reads the key and known_hosts the file names: ProtectHome=yes and
    PrivateTmp=yes hide what a person's shell sees."""
    root = tmp_path / "root"
    root.mkdir()
    name = line.split(" ")[0]
    text = re.sub(rf"^#? ?{name} = .*$", line, EXAMPLE.read_text(), count=1, flags=re.M)
    assert line in text
    config = tmp_path / "cluster.toml"
    config.write_text(text)
    cluster = tomllib.loads(text)["name"]
    with pytest.raises(InstallError) as refused:
        install_controller(str(root), cluster=cluster, config_file=config, bin_dir=str(BIN))
    message = str(refused.value)
    assert message.startswith(f"install-controller: {key} (")
    assert why in message and "nothing was installed" in message
    fix = "sudo install -d -m 0700 -o vllm-redeploy -g vllm-redeploy /var/lib/vllm-redeploy/.ssh"
    assert fix in message
    assert list(root.iterdir()) == []


def test_the_cli_refuses_a_known_hosts_in_tmp_in_one_paragraph(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    config = tmp_path / "cluster.toml"
    config.write_text(
        EXAMPLE.read_text().replace('"~/.ssh/known_hosts"', f'"{tmp_path}/known_hosts"', 1)
    )
    done = CliRunner().invoke(app, ["install-controller", "--prefix", str(root), "-c", str(config)])
    assert done.exit_code == 1, done.output
    assert done.output.startswith(f"install-controller: ssh.known_hosts ({tmp_path}/known_hosts)")
    assert "Traceback" not in done.output and list(root.iterdir()) == []


def test_a_local_node_is_refused_for_the_units_naming_the_ssh_way(tmp_path: Path) -> None:
    """A controller on one of the Sparks, that Spark as transport = "local": the units' sandbox
    would fail its commands for the wrong reason."""
    root = tmp_path / "root"
    root.mkdir()
    text = EXAMPLE.read_text().replace(
        'name = "spark-a"', 'name = "spark-a"\ntransport = "local"', 1
    )
    assert 'transport = "local"' in text
    config = tmp_path / "local.toml"
    config.write_text(text)
    done = CliRunner().invoke(app, ["install-controller", "--prefix", str(root), "-c", str(config)])
    assert done.exit_code == 2, done.output
    message = " ".join(done.output.split())
    assert (
        'node spark-a has transport = "local", but the units run the flow in a sandbox' in message
    )
    assert 'transport = "ssh" with address = "127.0.0.1"' in message
    assert list(root.iterdir()) == []


def test_install_controller_twice_changes_nothing(tmp_path: Path) -> None:
    _need("systemctl", "systemd")  # `systemctl --root` enables the units in the image root
    _need("useradd", "passwd")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group"):  # an image's, with the base system's users
        shutil.copy(f"/etc/{name}", root / "etc" / name)
    args = ["--prefix", str(root), "--config", str(EXAMPLE), "--bin-dir", str(BIN), "--enable"]
    cluster = load_config(EXAMPLE, env_file=None).name
    units = ["vllm-redeploy-prefect.service"] + [
        f"vllm-redeploy-{kind}@{cluster}.service" for kind in ("serve", "webhook", "watch")
    ]
    first = _cli(*args)
    absent = [
        f"warning: no {p} in {BIN} (the units' ExecStart=)" for p in ("vllm-redeploy", "prefect")
    ]
    derived = [
        f"{cluster}.{kind}" for kind in ("watch.toml", "webhook.toml", "watch.env", "webhook.env")
    ]
    no_secret = (
        f"note: {cluster}.env sets no VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET: the webhook refuses "
        "to start until it does (set it there, then run install-controller again)"
    )
    # The example's key and known_hosts are the services' own (~ is their home): not there yet.
    hosts = " ".join(n.address for n in load_config(EXAMPLE, env_file=None).nodes)
    ssh_notes = [
        "note: the services' SSH key /var/lib/vllm-redeploy/.ssh/id_ed25519 does not exist; make "
        "it with sudo -u vllm-redeploy ssh-keygen -t ed25519 -N '' -f "
        "/var/lib/vllm-redeploy/.ssh/id_ed25519 and add its .pub to ~/.ssh/authorized_keys of "
        "each node's login",
        "note: the services' known_hosts /var/lib/vllm-redeploy/.ssh/known_hosts does not exist, "
        "so every node would be refused; check each node's fingerprint on its console, then: "
        f"ssh-keyscan -t ed25519 {hosts} | sudo -u vllm-redeploy tee -a "
        "/var/lib/vllm-redeploy/.ssh/known_hosts",
    ]
    assert first == [
        *absent,  # in the image root: it has no venv
        f"user {SERVICE_USER}: created (system user, home /var/lib/vllm-redeploy)",
        f"user {WEBHOOK_USER}: created (system user, home /var/lib/vllm-redeploy-webhook)",
        "/var/lib/vllm-redeploy/.ssh: made (0700, vllm-redeploy's: the services' SSH key and "
        "known_hosts)",
        f"{SPOOL_DIR}: made (2770, {WEBHOOK_USER}:{SERVICE_USER}: the webhook keeps accepted "
        "notices there, the watcher posts them)",
        *(f"{unit}: written (new)" for unit in UNITS),
        "prefect.env: written (new)",
        f"{cluster}.env: written (new)",
        f"{cluster}.toml: written (new)",
        *(f"{name}: written (new)" for name in derived),
        no_secret,
        *ssh_notes,
        *(f"{unit}: enabled" for unit in units),
    ]
    second = _cli(*args)
    assert second == [
        *absent,
        f"user {SERVICE_USER}: unchanged",
        f"user {WEBHOOK_USER}: unchanged",
        "/var/lib/vllm-redeploy/.ssh: unchanged",
        f"{SPOOL_DIR}: unchanged",
        *(f"{unit}: unchanged" for unit in UNITS),
        "prefect.env: unchanged",
        f"{cluster}.env: unchanged",
        f"{cluster}.toml: unchanged",
        *(f"{name}: unchanged" for name in derived),
        no_secret,
        *ssh_notes,
        *(f"{unit}: already enabled" for unit in units),
    ]

    passwd = (root / "etc/passwd").read_text()
    ids = {}
    for user, home in ((SERVICE_USER, "vllm-redeploy"), (WEBHOOK_USER, "vllm-redeploy-webhook")):
        entry = next(line for line in passwd.splitlines() if line.startswith(f"{user}:"))
        uid, gid = map(int, entry.split(":")[2:4])
        assert entry.endswith(f":/var/lib/{home}:/usr/sbin/nologin") and uid < 1000
        ids[user] = (uid, gid)
    gid, webhook_gid = ids[SERVICE_USER][1], ids[WEBHOOK_USER][1]
    assert gid != webhook_gid
    conf = root / "etc/vllm-redeploy"
    owners = {
        p.name: (p.stat().st_mode & 0o777, p.stat().st_uid, p.stat().st_gid) for p in conf.iterdir()
    }
    # Every file root's, readable by its service's group only: no service rewrites its own.
    assert owners == {
        "prefect.env": (0o640, 0, gid),
        f"{cluster}.env": (0o640, 0, gid),
        f"{cluster}.toml": (0o640, 0, gid),
        f"{cluster}.watch.toml": (0o640, 0, gid),
        f"{cluster}.watch.env": (0o640, 0, gid),
        f"{cluster}.webhook.toml": (0o640, 0, webhook_gid),
        f"{cluster}.webhook.env": (0o640, 0, webhook_gid),
    }
    server_auth = read_env(conf / "prefect.env")[AUTH_SERVER]
    assert len(server_auth) > 40 and read_env(conf / f"{cluster}.env")[AUTH_CLIENT] == server_auth
    # The watcher talks to the API with the same string; the webhook never gets it.
    assert read_env(conf / f"{cluster}.watch.env")[AUTH_CLIENT] == server_auth
    assert AUTH_CLIENT not in read_env(conf / f"{cluster}.webhook.env")
    assert (conf / f"{cluster}.toml").read_bytes() == EXAMPLE.read_bytes()
    # The real systemctl (offline, --root) enabled them from their [Install] sections.
    wants = root / "etc/systemd/system/multi-user.target.wants"
    assert sorted(p.name for p in wants.iterdir()) == sorted(units)
    _verify([root / "etc/systemd/system" / unit for unit in UNITS])

    # The env files are the operator's once there: edits stay, only mode and owner are repaired;
    # what each narrower service gets of them follows: the webhook its secret, nobody the token.
    edited = conf / f"{cluster}.env"
    secret = "w" * 40
    added = f"VLLM_REDEPLOY_SECRETS__HF_TOKEN=hf_edit\n{SECRET_ENV}={secret}\n"
    edited.write_text(edited.read_text() + added)
    edited.chmod(0o644)
    os.chown(edited, ids[SERVICE_USER][0], gid)
    third = _cli(*args)
    assert edited.stat().st_mode & 0o777 == 0o640 and "hf_edit" in edited.read_text()
    assert (edited.stat().st_uid, edited.stat().st_gid) == (0, gid)
    assert [line for line in third[3:] if not line.endswith(("unchanged", "enabled"))] == [
        f"{cluster}.env: mode 644 -> 640",
        f"{cluster}.webhook.env: written (changed)",
        *ssh_notes,
    ]
    assert (
        read_env(conf / f"{cluster}.webhook.env")["VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET"] == secret
    )
    assert "hf_edit" not in (conf / f"{cluster}.watch.env").read_text()


def test_install_controller_refuses_a_cluster_the_configuration_does_not_name(
    tmp_path: Path,
) -> None:
    result = CliRunner().invoke(
        app, ["install-controller", "--prefix", str(tmp_path), "-c", str(EXAMPLE), "--cluster", "x"]
    )
    assert result.exit_code == 2 and "--cluster x but" in result.output
    assert not any(tmp_path.iterdir())


def test_install_controller_as_another_user_says_to_run_it_as_root(tmp_path: Path) -> None:
    done = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
         str(BIN / "vllm-redeploy"), "install-controller", "--prefix", str(tmp_path / "root")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert "run it as root (sudo)" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "root").exists()


# --- each secret only where it is used (issue 34) --------------------------------------------

HF_TOKEN = "hf_" + "t" * 34  # test values
PASSPHRASE = "key-passphrase-" + "p" * 20
WEBHOOK_SECRET = "w" * 48
API_KEY = "vllm-api-key-" + "k" * 24
SECRETS_ADDED = (
    f"VLLM_REDEPLOY_SECRETS__HF_TOKEN={HF_TOKEN}\n"
    f"VLLM_REDEPLOY_SSH__KEY_PASSPHRASE={PASSPHRASE}\n"
    f"{SECRET_ENV}={WEBHOOK_SECRET}\n"
    f"VLLM_REDEPLOY_SECRETS__VLLM_API_KEY={API_KEY}\n"
)
KEY_FILE = "/var/lib/vllm-redeploy/.ssh/id_ed25519"  # where docs/operations.md puts it
TOML_TOKEN = "hf_in_the_toml_" + "x" * 20  # put in the file after all


@dataclass
class Installed:
    root: Path
    cluster: str
    ids: dict[str, tuple[int, int]]

    @property
    def conf(self) -> Path:
        return self.root / "etc/vllm-redeploy"

    def service(self, kind: str) -> dict[str, list[str]]:
        """The [Service] section of the installed unit, %i resolved to the cluster."""
        text = (self.root / f"etc/systemd/system/vllm-redeploy-{kind}@.service").read_text()
        return parse_ini(text.replace("%i", self.cluster))["Service"]

    def host_path(self, path: str) -> Path:
        return self.root / path.lstrip("-/")

    def readable_by(self, user: str, path: Path) -> bool:
        """Whether ``user`` (its uid and group only) can read ``path``: a real open(2)."""
        uid, gid = self.ids[user]
        argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "cat", str(path)]
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0


@pytest.fixture
def installed() -> Iterator[Installed]:
    """install-controller into an image root, a configuration whose key file is the service
    user's and that carries an HF token in [secrets]; then the operator puts every secret in the
    cluster's .env and runs it again, as docs/operations.md says."""
    _need("useradd", "passwd")
    root = Path(tempfile.mkdtemp(prefix="vrd-least-", dir="/tmp"))
    try:
        root.chmod(0o755)  # other users reach what the modes let them (setpriv below)
        (root / "etc").mkdir()
        for name in ("passwd", "group"):
            shutil.copy(f"/etc/{name}", root / "etc" / name)
        source = root / "source.toml"
        text = EXAMPLE.read_text().replace(
            '# key_file = "~/.ssh/id_ed25519"', f'key_file = "{KEY_FILE}"'
        )
        source.write_text(text + f'\n[secrets]\nhf_token = "{TOML_TOKEN}"\n')
        cluster = tomllib.loads(source.read_text())["name"]
        install = {"cluster": cluster, "config_file": source, "bin_dir": str(BIN)}
        install_controller(str(root), **install)  # type: ignore[arg-type]
        env = root / f"etc/vllm-redeploy/{cluster}.env"
        env.write_text(env.read_text() + SECRETS_ADDED)
        install_controller(str(root), **install)  # type: ignore[arg-type]
        passwd = (root / "etc/passwd").read_text().splitlines()
        ids = {
            f[0]: (int(f[2]), int(f[3]))
            for f in (line.split(":") for line in passwd)
            if f[0] in (SERVICE_USER, WEBHOOK_USER)
        }
        # install-controller made the state directory (0700, as StateDirectoryMode= keeps it);
        # the operator puts the key in it.
        state = root / "var/lib/vllm-redeploy/.ssh"
        (state / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
        for path in (state.parent, state, state / "id_ed25519"):
            os.chown(path, *ids[SERVICE_USER])
            path.chmod(0o700 if path.is_dir() else 0o600)
        yield Installed(root, cluster, ids)
    finally:
        shutil.rmtree(root)


def test_the_webhook_runs_as_its_own_user_with_only_its_secret_and_no_prefect_credential(
    installed: Installed,
) -> None:
    serve, webhook = installed.service("serve"), installed.service("webhook")
    assert webhook["User"] == [WEBHOOK_USER] != serve["User"] == [SERVICE_USER]
    assert webhook["Group"] == [WEBHOOK_USER] != serve["Group"]
    # What its process gets: the unit's Environment= and its own env file, nothing else.
    [env_file] = webhook["EnvironmentFile"]
    env = read_env(installed.host_path(env_file))
    given = {a.split("=", 1)[0] for a in webhook["Environment"]} | set(env)
    assert given == {"VLLM_REDEPLOY_WEBHOOK__SPOOL_DIR", SECRET_ENV}  # no PREFECT_API_*
    assert env[SECRET_ENV] == WEBHOOK_SECRET
    # Its configuration: the cluster's, without the SSH key, its passphrase or the HF token;
    # the env file beside it is its own, which the loader reads.
    argv = webhook["ExecStart"][0].split()
    config_file = argv[argv.index("--config") + 1]
    assert config_file == f"/etc/vllm-redeploy/{installed.cluster}.webhook.toml"
    assert cluster_env_file(Path(config_file)) == Path(env_file)
    mine = {installed.host_path(config_file), installed.host_path(env_file)}
    for path in mine:
        text = path.read_text()
        assert not any(s in text for s in (HF_TOKEN, PASSPHRASE, API_KEY, TOML_TOKEN, KEY_FILE)), (
            path
        )
    config = load_config(installed.host_path(config_file), env_file=None)  # no key file here
    assert config.secrets.webhook_secret is not None
    assert config.secrets.webhook_secret.get_secret_value() == WEBHOOK_SECRET
    assert config.secrets.hf_token is None and config.ssh.key_passphrase is None
    assert [n.name for n in config.nodes] == ["spark-a", "spark-b"]
    # What it cannot read. In its mount namespace /etc/vllm-redeploy holds its two files only,
    # and the services' state directory (SSH key, known_hosts, Prefect's database) is not there.
    assert webhook["TemporaryFileSystem"] == ["/etc/vllm-redeploy:ro"]
    assert webhook["BindReadOnlyPaths"] == [f"{config_file} {env_file}"]
    assert webhook["InaccessiblePaths"] == ["-/var/lib/vllm-redeploy"]
    # What it writes: the spool alone, its user's and the watchers' group's (setgid: its files
    # get that group), which the watcher reads and empties.
    assert webhook["ReadWritePaths"] == [SPOOL_DIR] and webhook["UMask"] == ["0007"]
    spool = installed.host_path(SPOOL_DIR).stat()
    assert (spool.st_uid, spool.st_gid) == (
        installed.ids[WEBHOOK_USER][0],
        installed.ids[SERVICE_USER][1],
    )
    assert spool.st_mode & 0o7777 == 0o2770
    # And without the namespace, the file modes: its user opens its two files, nothing else.
    conf = installed.conf
    readable = {p for p in conf.iterdir() if installed.readable_by(WEBHOOK_USER, p)}
    assert readable == mine
    key = installed.host_path(KEY_FILE)
    assert not installed.readable_by(WEBHOOK_USER, key)
    assert installed.readable_by(SERVICE_USER, key)  # the check can tell


def test_the_watcher_has_ssh_but_no_hf_token_and_serve_has_all(installed: Installed) -> None:
    serve, watch = installed.service("serve"), installed.service("watch")
    assert watch["User"] == serve["User"] == [SERVICE_USER]  # both log in to the nodes
    assert watch["StateDirectory"] == serve["StateDirectory"] == [SERVICE_USER]  # the key's home
    [env_file] = watch["EnvironmentFile"]
    argv = watch["ExecStart"][0].split()
    config_file = argv[argv.index("--config") + 1]
    assert cluster_env_file(Path(config_file)) == Path(env_file)
    env = read_env(installed.host_path(env_file))
    assert env["VLLM_REDEPLOY_SSH__KEY_PASSPHRASE"] == PASSPHRASE and AUTH_CLIENT in env
    assert env["VLLM_REDEPLOY_SECRETS__VLLM_API_KEY"] == API_KEY  # its looks ask vLLM with it
    for path in (env_file, config_file):
        text = installed.host_path(path).read_text()
        assert not any(s in text for s in (HF_TOKEN, TOML_TOKEN, WEBHOOK_SECRET)), path
    data = tomllib.loads(installed.host_path(config_file).read_text())
    assert data["ssh"]["key_file"] == KEY_FILE and "secrets" not in data
    # The cluster's .env (HF token) is not in its namespace, though its user could read it.
    assert watch["TemporaryFileSystem"] == ["/etc/vllm-redeploy:ro"]
    assert watch["BindReadOnlyPaths"] == [f"{config_file} {env_file}"]
    # serve runs the flow: it gets everything.
    assert serve["EnvironmentFile"] == [f"/etc/vllm-redeploy/{installed.cluster}.env"]
    everything = installed.host_path(serve["EnvironmentFile"][0]).read_text()
    assert all(s in everything for s in (HF_TOKEN, PASSPHRASE, WEBHOOK_SECRET, API_KEY))
    assert "TemporaryFileSystem" not in serve and "InaccessiblePaths" not in serve


# --- the bed's systemd: what is installed is what runs -----------------------------------------


@pytest.mark.integration
def test_the_bed_systemd_runs_unit_files_as_systemd_252_does(bed: TestBed, tmp_path: Path) -> None:
    node = bed.node(NODE)
    prefix = f"vrd-t{uuid.uuid4().hex[:6]}"
    template, unit = f"{prefix}@.service", f"{prefix}@one.service"
    flag = tmp_path / "failed-once"

    def unit_file(word: str) -> str:
        # Fails once, then runs: Restart=on-failure brings it back.
        script = f"test -e {flag} || {{ touch {flag}; exit 1; }}; echo {word} %i; exec sleep 600"
        return (
            f"[Unit]\nDescription=test %i\n[Service]\nExecStart=/bin/sh -c '{script}'\n"
            "Restart=on-failure\nRestartSec=0.1\n[Install]\nWantedBy=multi-user.target\n"
        )

    def said() -> list[str]:
        log = node.run(["journalctl", "-u", unit, "-o", "cat"]).stdout.splitlines()
        return [line for line in log if line.endswith(" one")]

    def active() -> bool:
        return node.systemctl("is-active", unit).stdout == "active\n"

    path = f"/etc/systemd/system/{template}"
    node.write_file(path, unit_file("first"))
    try:
        # A new file is loaded when first named; the instance's %i is its name.
        started = node.systemctl("start", unit)
        assert started.returncode == 0, started.stderr
        wait_until(lambda: said() == ["first one"], 30, "the restarted unit's output")
        assert active()
        log = node.run(["journalctl", "-u", unit]).stdout
        assert "Main process exited, code=exited, status=1/FAILURE" in log
        assert "Scheduled restart job, restart counter is at 1." in log
        # A changed file: the old definition runs, with systemd's warning, until daemon-reload.
        node.write_file(path, unit_file("second"))
        restarted = node.systemctl("restart", unit)
        assert restarted.returncode == 0 and "Run 'systemctl daemon-reload'" in restarted.stderr
        wait_until(lambda: said() == ["first one"] * 2, 30, "the old definition's output")
        assert node.systemctl("daemon-reload").returncode == 0
        assert node.systemctl("restart", unit).returncode == 0
        wait_until(lambda: said() == ["first one"] * 2 + ["second one"], 30, "the new one's")
        assert node.systemctl("stop", unit).returncode == 0 and not active()
        # A template is enabled by instance; without an instance it has nothing to enable.
        assert "no installation config" in node.systemctl("enable", template).stderr
        assert node.systemctl("enable", unit).returncode == 0
        assert node.systemctl("is-enabled", unit).stdout == "enabled\n"
    finally:
        node.systemctl("disable", "--now", unit)
        node.run(["rm", "-f", path])
        node.systemctl("daemon-reload")


# --- the units on a bed node, under its systemd ----------------------------------------------


@dataclass
class Controller:
    node: EmulatedNode
    runner: Runner
    cluster: str
    cluster_toml: Path
    api: str
    auth: str
    webhook: str
    secret: str
    install: list[str]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(self.auth.encode()).decode()}

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.node.systemctl(*args)

    def unit(self, kind: str) -> str:
        return f"vllm-redeploy-{kind}@{self.cluster}.service"

    @contextlib.contextmanager
    def running(self, kind: str) -> Iterator[str]:
        """The cluster's ``kind`` unit started for the block, then stopped (and proven so)."""
        unit = self.unit(kind)
        started = self.systemctl("start", unit)
        assert started.returncode == 0, started.stderr
        try:
            yield unit
        finally:
            self.systemctl("stop", unit)
        assert self.systemctl("is-active", unit).stdout == "inactive\n"

    def wait_for(self, unit: str, check: Callable[[], bool], timeout: float, what: str) -> None:
        """Until ``check`` holds; the unit's journal tells why when it never does."""
        try:
            wait_until(check, timeout, what)
        except TimeoutError as exc:
            journal = self.node.run(["journalctl", "-u", unit, "-n", "40"]).stdout
            raise AssertionError(f"{exc}; journal of {unit}:\n{journal}") from None

    def deployments(self) -> list[str]:
        found = httpx.post(f"{self.api}/deployments/filter", json={}, headers=self.headers)
        found.raise_for_status()
        return sorted(d["name"] for d in found.json())


def _install_command(cluster_toml: Path) -> list[str]:
    # As the operator runs it on a node whose login is not root (README): through sudo.
    install = [str(BIN / "vllm-redeploy"), "install-controller", "-c", str(cluster_toml)]
    return ["sudo", "-n", *install, "--enable"]


def _append(runner: Runner, path: str, text: str) -> None:
    """Edit a file on the node as its operator would (sudo); the text travels on stdin."""
    script = ["sh", "-c", 'cat >> "$1"', "sh", path]
    runner.run(["sudo", "-n", *script], stdin=text.encode(), timeout=10)


def _remove_controller(node: EmulatedNode) -> None:
    units = " ".join(f"/etc/systemd/system/{u}" for u in UNITS)
    node.run(
        [
            "sh",
            "-c",
            "for u in $(ls /etc/systemd/system/multi-user.target.wants/ 2>/dev/null"
            " | grep ^vllm-redeploy-); do systemctl disable --now $u; done",
        ]
    )
    node.systemctl("stop", "vllm-redeploy-prefect.service")
    node.run(["sh", "-c", f"rm -rf /etc/vllm-redeploy {units} /etc/systemd/system/*.service.d"])
    for user in (SERVICE_USER, WEBHOOK_USER):
        node.run(["userdel", user])
    node.systemctl("daemon-reload")


@pytest.fixture(scope="module")
def controller(bed: TestBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    work = tmp_path_factory.mktemp("controller")
    cluster = f"svc{uuid.uuid4().hex[:6]}"
    hook_port, api_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    # The services' key and known_hosts: the defaults, in their home (~ is theirs).
    cluster_toml = bed.write_config(
        work / f"{cluster}.toml",
        name=cluster,  # type: ignore[arg-type]
        webhook={"host": "127.0.0.1", "port": hook_port, "url": f"http://127.0.0.1:{hook_port}"},
        ssh={"key_file": None, "known_hosts": "~/.ssh/known_hosts"},
    )
    node = bed.node(NODE)
    _remove_controller(node)
    for own in (STATE_DIR, SPOOL_DIR):  # the bed's /var is the host's
        node.own_dir(Path(own))
        node.run(["chown", "root:root", own])
    # The operator's own way in: the bed's key, for the first run of the install only.
    config = load_config(bed.write_config(work / "operator.toml"), env_file=None)
    runner = runner_for(config.nodes[0], config)
    try:
        with runner:
            install = runner.run(_install_command(cluster_toml), timeout=120).stdout.splitlines()
            # What its notes ask for: the services' key (the bed's) and the nodes' host keys.
            give_services_ssh(bed, node)
            # The operator's edits: the server's port (others share this machine's 4200), the
            # clusters' API address and the webhook's secret.
            _append(
                runner, "/etc/vllm-redeploy/prefect.env", f"PREFECT_SERVER_API_PORT={api_port}\n"
            )
            secret = uuid.uuid4().hex + uuid.uuid4().hex
            api = f"http://127.0.0.1:{api_port}/api"
            _append(
                runner,
                f"/etc/vllm-redeploy/{cluster}.env",
                f"PREFECT_API_URL={api}\n{SECRET_ENV}={secret}\n",
            )
            # As docs/operations.md says after an edit: again, so the watcher and the webhook get
            # their part of it.
            runner.run(_install_command(cluster_toml), timeout=120)
            # The bed's /var is the host's: the services keep their state in the test's directory.
            # Its processes run as root (the stand-in's), so the webhook and the watcher share
            # a spool of root's: the installed one is the webhook user's, which root's refuses.
            state = f"[Service]\nEnvironment=PREFECT_HOME={work}/prefect\n"
            state += f"Environment=PREFECT_UI_STATIC_DIRECTORY={work}/ui\n"
            state += f"Environment=VLLM_REDEPLOY_WEBHOOK__SPOOL_DIR={work}/spool\n"
            for unit in UNITS:
                node.write_file(f"/etc/systemd/system/{unit}.d/bed.conf", state)
            auth = read_env_on(node, "/etc/vllm-redeploy/prefect.env")[AUTH_SERVER]
            assert node.systemctl("daemon-reload").returncode == 0
            started = node.systemctl("start", "vllm-redeploy-prefect.service")
            assert started.returncode == 0, started.stderr
            wait_until(
                lambda: answers(f"{api}/health"),
                SERVER_START_S,
                "the Prefect server's unit",
            )
            hook = f"http://127.0.0.1:{hook_port}"
            yield Controller(node, runner, cluster, cluster_toml, api, auth, hook, secret, install)
    finally:
        _remove_controller(node)
        for own in (STATE_DIR, SPOOL_DIR):  # the node's own, mounted
            node.run(["find", own, "-mindepth", "1", "-delete"])


def give_services_ssh(bed: TestBed, node: EmulatedNode) -> None:
    """The key the nodes authorize and their host keys, where install-controller's notes say:
    the services' ~/.ssh (made by it), theirs and 0600."""
    ssh = f"{STATE_DIR}/.ssh"
    for name, source in (("id_ed25519", bed.client_key), ("known_hosts", bed.known_hosts)):
        owner = ["-o", SERVICE_USER, "-g", SERVICE_USER]
        done = node.run(["install", "-m", "0600", *owner, str(source), f"{ssh}/{name}"])
        assert done.returncode == 0, done.stderr


def read_env_on(node: EmulatedNode, path: str) -> dict[str, str]:
    text = node.run(["cat", path]).stdout
    return dict(line.split("=", 1) for line in text.splitlines() if line and line[0] != "#")


@pytest.mark.integration
def test_install_controller_on_a_node_installs_there_only_and_a_rerun_changes_nothing(
    controller: Controller,
) -> None:
    cluster = controller.cluster
    assert (
        controller.install[0] == f"user {SERVICE_USER}: created (system user, home "
        "/var/lib/vllm-redeploy)"
    )
    assert "systemd reloaded" in controller.install
    assert controller.install[-3:] == [
        f"{controller.unit(k)}: enabled" for k in ("serve", "webhook", "watch")
    ]
    node = controller.node
    # The node's own /etc: the user and the units are there, not on the host.
    assert node.run(["id", "-u", SERVICE_USER]).returncode == 0
    assert SERVICE_USER not in Path("/etc/passwd").read_text()
    assert not Path("/etc/systemd/system/vllm-redeploy-prefect.service").exists()
    env_files = ["prefect.env", f"{cluster}.env", f"{cluster}.watch.env", f"{cluster}.webhook.env"]
    stats = node.run(
        ["stat", "-c", "%n %a %U %G", *(f"/etc/vllm-redeploy/{f}" for f in env_files)]
    ).stdout.split("\n")
    assert stats[:4] == [
        f"/etc/vllm-redeploy/prefect.env 640 root {SERVICE_USER}",
        f"/etc/vllm-redeploy/{cluster}.env 640 root {SERVICE_USER}",
        f"/etc/vllm-redeploy/{cluster}.watch.env 640 root {SERVICE_USER}",
        f"/etc/vllm-redeploy/{cluster}.webhook.env 640 root {WEBHOOK_USER}",
    ]
    assert node.run(["id", "-u", WEBHOOK_USER]).returncode == 0
    assert node.systemctl("is-enabled", controller.unit("serve")).stdout == "enabled\n"

    rerun = controller.runner.run(_install_command(controller.cluster_toml), timeout=120)
    lines = rerun.stdout.splitlines()
    assert [line for line in lines if not line.endswith(("unchanged", "already enabled"))] == []


@pytest.mark.integration
def test_the_prefect_unit_refuses_calls_without_its_auth_string(controller: Controller) -> None:
    api = controller.api
    assert controller.systemctl("is-active", "vllm-redeploy-prefect.service").stdout == "active\n"
    assert httpx.post(f"{api}/deployments/filter", json={}).status_code == 401
    wrong = {"Authorization": "Basic " + base64.b64encode(b"vllm-redeploy:guess").decode()}
    assert httpx.post(f"{api}/deployments/filter", json={}, headers=wrong).status_code == 401
    answer = httpx.post(f"{api}/deployments/filter", json={}, headers=controller.headers)
    assert answer.status_code == 200
    assert httpx.get(f"{api}/health").status_code == 200  # probes need no auth
    settings = httpx.get(f"{api.removesuffix('/api')}/ui-settings").json()
    assert settings["auth"] == "BASIC"  # the UI asks for it


@pytest.mark.integration
def test_the_prefect_unit_listens_on_loopback_only_and_keeps_its_auth_string_off_argv(
    controller: Controller,
) -> None:
    port = httpx.URL(controller.api).port
    # The node's own address is this machine's too (a loopback one): the server is not there.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{controller.node.ip}:{port}/api/health", timeout=5)
    assert answers(f"{controller.api}/health")
    shown = controller.systemctl("show", "-p", "MainPID", "--value", "vllm-redeploy-prefect")
    main = int(shown.stdout)
    assert main > 0
    for pid in [main, *descendants(main)]:
        with contextlib.suppress(FileNotFoundError):
            assert controller.auth.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.integration
def test_the_serve_unit_registers_the_deployments_with_the_auth_string(
    controller: Controller,
) -> None:
    want = [
        f"{controller.cluster}-{kind}" for kind in ("after-reboot", "manual", "nightly", "recover")
    ]
    with controller.running("serve") as serve:
        controller.wait_for(
            serve, lambda: set(want) <= set(controller.deployments()), 120, "serve's deployments"
        )
        assert controller.systemctl("is-active", serve).stdout == "active\n"
    log = controller.node.run(["journalctl", "-u", serve, "-b"]).stdout
    assert f"Started {serve}" in log and controller.auth not in log


@pytest.mark.integration
def test_the_webhook_unit_answers_and_the_watcher_posts_its_events_with_the_auth_string(
    controller: Controller,
) -> None:
    """The webhook has no Prefect credential: what it accepts reaches Prefect through the
    cluster's watcher, which has."""
    with controller.running("watch"), controller.running("webhook") as webhook:
        controller.wait_for(
            webhook, lambda: answers(f"{controller.webhook}/healthz"), 60, "the webhook's unit"
        )
        boot_id = str(uuid.uuid4())
        body, headers = signed(controller.secret, notice(NODE, boot_id))
        answer = httpx.post(f"{controller.webhook}/reboot", content=body, headers=headers)
        assert answer.status_code == 202, answer.text
        event_id = reboot_event_id(controller.cluster, NODE, boot_id)
        wait_until(lambda: event_id in _event_ids(controller), 30, "the reboot event in Prefect")


@pytest.mark.integration
def test_the_webhooks_env_file_alone_gets_nothing_from_prefect(controller: Controller) -> None:
    """What the webhook's process is given cannot start a run nor read the lock's record."""
    env = read_env_on(controller.node, f"/etc/vllm-redeploy/{controller.cluster}.webhook.env")
    assert set(env) == {SECRET_ENV}  # no PREFECT_API_AUTH_STRING, no PREFECT_API_URL
    # All a client with it could send: no Authorization header (Prefect's client adds one only
    # from the auth string). The server the watcher and serve use refuses it.
    lock = f"/variables/name/vllm_redeploy__{controller.cluster}__lock_holder"
    for method, path, body in (
        ("POST", "/flow_runs/", {"flow_id": str(uuid.uuid4())}),
        ("GET", lock, None),
        ("POST", "/events", []),
    ):
        answer = httpx.request(method, f"{controller.api}{path}", json=body, timeout=10)
        assert answer.status_code == 401, (path, answer.status_code, answer.text[:200])
    assert httpx.get(f"{controller.api}{lock}", headers=controller.headers).status_code in (
        200,
        404,
    )  # the check can tell: with the auth string the same call is answered


def _event_ids(controller: Controller) -> list[str]:
    query = {
        "event": {"name": [EVENT_REBOOTED]},
        "resource": {"id_prefix": [node_resource_id(controller.cluster, "")]},
    }
    found = httpx.post(
        f"{controller.api}/events/filter",
        json={"filter": query, "limit": 50},
        headers=controller.headers,
    )
    found.raise_for_status()
    return [e["id"] for e in found.json()["events"]]


FLOW = """
from prefect import flow

@flow(name="vrd-auth-check")
def check() -> int:
    return 42

state = check(return_state=True)
print(state.type.value, state.result())
"""


@pytest.mark.integration
def test_a_flow_run_reports_to_the_server_with_the_auth_string(
    controller: Controller, tmp_path: Path
) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PREFECT_HOME": str(tmp_path),
        "PREFECT_API_URL": controller.api,
        AUTH_CLIENT: controller.auth,
    }
    done = subprocess.run(
        [sys.executable, "-c", FLOW], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.split() == ["COMPLETED", "42"], done.stderr[-2000:]
    runs = httpx.post(
        f"{controller.api}/flow_runs/filter",
        headers=controller.headers,
        json={"flows": {"name": {"any_": ["vrd-auth-check"]}}},
    )
    assert [r["state_type"] for r in runs.json()] == ["COMPLETED"]


# --- compose.yaml -----------------------------------------------------------------------------

COMPOSE = REPO / "compose.yaml"


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _required() -> list[str]:
    """The variables compose.yaml refuses to start without (``${NAME:?why}``)."""
    return sorted(set(re.findall(r"\$\{([A-Z_]+):\?", COMPOSE.read_text())))


def test_compose_runs_the_controller_with_secrets_from_an_uncommitted_env_file() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"postgres", "prefect-server", "worker", "webhook"} <= set(services)
    # PostgreSQL keeps its data in a volume, on a network that only the server shares.
    db = services["postgres"]
    assert all(v.split(":")[0] in compose["volumes"] for v in db["volumes"])
    [database] = db["networks"]
    assert compose["networks"][database]["internal"]
    assert [n for n, s in services.items() if database in s.get("networks", [])] == [
        "postgres",
        "prefect-server",
    ]
    server = services["prefect-server"]
    assert server["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"].startswith(
        "postgresql+asyncpg://"
    )
    assert server["environment"]["PREFECT_SERVER_API_AUTH_STRING"].startswith("${")
    for name, service in services.items():
        command = service.get("command", [])
        if "start" in command or "webhook" in command:  # a server: Docker watches its health
            assert "healthcheck" in service, name
        # Ours: each talks to the API with its auth string, but the one that derives a file
        # and the webhook, which the network reaches (the watcher posts what it keeps).
        if "build" in service and name not in ("webhook-config", "webhook"):
            assert service["environment"]["PREFECT_API_AUTH_STRING"].startswith("${"), name
        for port in service.get("ports", []):
            assert port.split(":")[0] in ("127.0.0.1", "${WEBHOOK_ADDRESS"), port
        for value in service.get("environment", {}).values():  # no secret value in the file
            assert not any(s in str(value) for s in ("password", "hf_")) or "${" in str(value)
    assert services["worker"]["depends_on"]["deploy"]["condition"] == (
        "service_completed_successfully"
    )
    # The env file named in the instructions is never committed; its template names every secret.
    assert "compose.env" in (REPO / ".gitignore").read_text().split()
    example = (REPO / "deployments/compose/compose.env.example").read_text()
    assert _required() and all(f"{name}=\n" in example for name in _required())
    dockerfile = (REPO / "deployments/compose/Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            assert all((REPO / src).exists() for src in line.split()[1:-1]), line
    assert "USER vllm-redeploy" in dockerfile and "pip install --no-cache-dir ." in dockerfile


SSH_DIR = "/home/vllm-redeploy/.ssh"  # where compose.yaml mounts the keys


def _secrets_of(service: dict[str, Any]) -> set[str]:
    """The compose.env variables a service's environment takes (``${NAME...}``)."""
    values = " ".join(str(v) for v in service.get("environment", {}).values())
    return set(re.findall(r"\$\{([A-Z_]+)", values))


def _mounts(service: dict[str, Any]) -> set[str]:
    """Where a service's volumes go inside (``${VAR:-default}:/inside:ro``)."""
    sources = (re.sub(r"\$\{[^}]*\}", "SOURCE", v) for v in service.get("volumes", []))
    return {volume.split(":")[1] for volume in sources}


def test_compose_gives_each_service_only_its_secrets_and_mounts(tmp_path: Path) -> None:
    services = _compose()["services"]
    ours = {name: s for name, s in services.items() if "build" in s}
    assert set(ours) == {"deploy", "worker", "webhook-config", "webhook", "watcher"}
    assert {name: _secrets_of(s) for name, s in ours.items()} == {
        "deploy": {"PREFECT_AUTH_STRING", "VRD_CLUSTER"},
        "worker": {"PREFECT_AUTH_STRING", "HF_TOKEN", "SSH_KEY_PASSPHRASE", "VLLM_API_KEY"},
        "webhook-config": set(),
        "webhook": {"WEBHOOK_SECRET"},
        "watcher": {"PREFECT_AUTH_STRING", "SSH_KEY_PASSPHRASE", "VLLM_API_KEY"},
    }
    config, derived_dir = "/etc/vllm-redeploy/cluster.toml", "/etc/vllm-redeploy-webhook"
    assert {name: _mounts(s) for name, s in ours.items()} == {
        "deploy": set(),
        "worker": {config, SSH_DIR},
        "webhook-config": {config, derived_dir},
        # The network reaches it: no SSH key in its container, not even the whole configuration
        # (its derived view only); its spool in a named volume, which the watcher posts from.
        "webhook": {derived_dir, SPOOL_DIR},
        "watcher": {config, SSH_DIR, SPOOL_DIR},
    }
    webhook = ours["webhook"]
    assert set(webhook["environment"]) == {"VLLM_REDEPLOY_WEBHOOK__SPOOL_DIR", SECRET_ENV}
    for name in ("webhook", "watcher"):  # the same spool, in a volume that outlives `up -d`
        assert ours[name]["environment"]["VLLM_REDEPLOY_WEBHOOK__SPOOL_DIR"] == SPOOL_DIR
        assert f"webhook-state:{SPOOL_DIR}" in ours[name]["volumes"]
    assert f"webhook-config:{derived_dir}:ro" in webhook["volumes"]
    assert {"webhook-state", "webhook-config"} <= set(_compose()["volumes"])
    dockerfile = (REPO / "deployments/compose/Dockerfile").read_text()
    assert f"-m 0700 {SPOOL_DIR}" in dockerfile and derived_dir in dockerfile
    assert webhook["depends_on"]["webhook-config"]["condition"] == "service_completed_successfully"
    # The worker's runs use the mounted configuration only (a run naming another is refused).
    assert ours["worker"]["environment"]["VLLM_REDEPLOY_CONFIG"] == config
    # webhook-config derives the view without the SSH keys, which the webhook's container lacks:
    # the loader would refuse a key file that is not there. Its command, run here.
    derive = ours["webhook-config"]["command"]
    source = tmp_path / "cluster.toml"
    key = tmp_path / "no-such-key"  # as in the webhook's container: named, not there
    text = EXAMPLE.read_text().replace('# key_file = "~/.ssh/id_ed25519"', f'key_file = "{key}"')
    source.write_text(text)
    with pytest.raises(ConfigError, match="key file"):
        load_config(source, env_file=None)
    assert derive[:4] == ["python", "-m", "deployments.install_controller", "--webhook-config"]
    assert derive[4] == config and derive[5].startswith(f"{derived_dir}/")
    target = tmp_path / "webhook.toml"
    done = subprocess.run(
        [sys.executable, *derive[1:4], str(source), str(target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert webhook["command"][:4] == ["vllm-redeploy", "webhook", "--config", derive[5]]
    derived = load_config(target, env_file=None)
    assert derived.name == load_config(EXAMPLE, env_file=None).name
    assert derived.ssh.key_file is None


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    env = tmp_path / "compose.env"
    values = {name: f"x{i}" for i, name in enumerate(_required())}
    env.write_text("".join(f"{name}={value}\n" for name, value in values.items()))
    base = ["docker-compose", "--project-directory", str(REPO), "-f", str(COMPOSE)]
    resolved = subprocess.run(
        [*base, "--env-file", str(env), "config"], capture_output=True, text=True, timeout=60
    )
    assert resolved.returncode == 0, resolved.stderr
    server = yaml.safe_load(resolved.stdout)["services"]["prefect-server"]
    auth = server["environment"]["PREFECT_SERVER_API_AUTH_STRING"]
    assert auth == values["PREFECT_AUTH_STRING"]
    assert [port.split(":")[0] for port in server["ports"]] == ["127.0.0.1"]
    missing = subprocess.run(
        [*base, "config"], capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}
    )
    assert missing.returncode != 0 and "in compose.env" in missing.stderr


@pytest.mark.parametrize("quote", ["'", ""])
def test_the_secrets_as_one_json_variable_give_each_service_its_own(
    tmp_path: Path, quote: str
) -> None:
    """`VLLM_REDEPLOY_SECRETS=<JSON>` in the cluster's env file (the whole [secrets] table in one
    variable, as the loader accepts it): install-controller dropped it from both services' env
    files, so the watcher lacked vLLM's key. Each now gets its own secrets, and no other."""
    table = {"vllm_api_key": "sk-json-key", "hf_token": "hf_json", "webhook_secret": "w" * 40}
    text = f"PREFECT_API_URL=http://127.0.0.1:4200/api\nVLLM_REDEPLOY_SECRETS={quote}"
    text += json.dumps(table) + f"{quote}\n"
    watch, webhook = derived_env(text, "watch"), derived_env(text, "webhook")
    assert "hf_json" not in watch + webhook and "w" * 40 not in watch
    assert "sk-json-key" not in webhook
    path = tmp_path / "cluster.toml"
    path.write_text(MINIMAL)
    env = tmp_path / "cluster.watch.env"
    env.write_text(watch)
    secrets = load_config(path, env_file=env).secrets
    assert secrets.vllm_api_key is not None
    assert secrets.vllm_api_key.get_secret_value() == "sk-json-key"
    (tmp_path / "webhook.env").write_text(webhook)
    assert read_env(tmp_path / "webhook.env")["VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET"] == "w" * 40
