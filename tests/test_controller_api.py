"""Commands that read or write a cluster's standing find the controller's Prefect API, or refuse
(issue 34, "runs that bypass the controller"): never Prefect's quiet temporary API, unless
`run --temporary-api` asks for it, and then it says so first.

The commands run as a person runs them: their own process, with nothing of this machine's
Prefect set-up (no PREFECT_API_URL, HOME and PREFECT_HOME in tmp, no units: SYSTEMD_UNIT_PATH
names an empty directory), against the session's real Prefect server. The cluster's one node is
a listener that counts who connects: "nothing touched" means nobody did.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from deployments.install_controller import PREFECT_UNIT, SOURCE_DIR, cluster_units
from tests.test_cli_nodes import one_node_toml
from tests.testbed.bed import bed_ip
from tests.testbed.procs import free_port, spawn, stop, wait_until
from vllm_redeploy import controller_api
from vllm_redeploy.controller_api import (
    DEFAULT_URL,
    ControllerApi,
    auth_headers,
    services_api,
    with_services_auth,
)
from vllm_redeploy.names import variable_name

BIN = Path(sys.executable).parent
NOTICE = "warning: temporary Prefect API (--temporary-api): "


# --- where the controller's API is named: files only ------------------------------------------


def test_the_shipped_units_name_the_local_server(tmp_path: Path) -> None:
    """install-controller's units, as shipped: the serve template names the server on this
    machine; without it, the Prefect server's unit gives the same address."""
    assert controller_api.SERVE_UNIT.format("pair") in cluster_units("pair")
    assert controller_api.PREFECT_UNIT == PREFECT_UNIT
    found = services_api("pair", tmp_path / "pair.env", [SOURCE_DIR]).api
    assert found is not None and found.url == DEFAULT_URL
    assert (
        found.source
        == f"PREFECT_API_URL of the installed unit {SOURCE_DIR}/vllm-redeploy-serve@.service"
    )
    units = tmp_path / "units"
    units.mkdir()
    (units / PREFECT_UNIT).write_text((SOURCE_DIR / PREFECT_UNIT).read_text())
    server = services_api("pair", tmp_path / "pair.env", [units]).api
    assert server is not None and server.url == DEFAULT_URL
    assert server.source == f"the server the installed unit {units / PREFECT_UNIT} starts"


def test_the_env_file_beats_the_units_and_the_units_env_file_beats_their_environment(
    tmp_path: Path,
) -> None:
    units = tmp_path / "units"
    units.mkdir()
    (units / "vllm-redeploy-serve@.service").write_text(
        "[Service]\nEnvironment=PREFECT_API_URL=http://127.0.0.1:4200/api\n"
        f"EnvironmentFile=-{tmp_path}/etc/%i.env\n"
    )
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/pair.env").write_text(
        "PREFECT_API_URL=http://controller:4200/api\nPREFECT_API_AUTH_STRING=u:secret\n"
    )
    via_units = services_api("pair", tmp_path / "beside.env", [units]).api
    assert via_units == ControllerApi(
        "http://controller:4200/api", via_units.source, "u:secret", f"{tmp_path}/etc/pair.env"
    )
    assert f"in {tmp_path}/etc/pair.env, the installed unit " in via_units.source
    (tmp_path / "beside.env").write_text("PREFECT_API_URL=http://other:4200/api\n")
    beside = services_api("pair", tmp_path / "beside.env", [units]).api
    assert beside is not None and beside.url == "http://other:4200/api" and beside.auth is None
    # The server's unit binds the LAN address from its EnvironmentFile; its auth string goes along.
    (units / "vllm-redeploy-serve@.service").unlink()
    (tmp_path / "etc/prefect.env").write_text(
        "PREFECT_SERVER_API_HOST=192.168.200.10\nPREFECT_SERVER_API_AUTH_STRING=u:server\n"
    )
    (units / PREFECT_UNIT).write_text(
        "[Service]\nEnvironment=PREFECT_SERVER_API_HOST=127.0.0.1\n"
        f"EnvironmentFile={tmp_path}/etc/prefect.env\nExecStart=/x/prefect server start\n"
    )
    server = services_api("pair", tmp_path / "none.env", [units]).api
    assert server == ControllerApi(
        "http://192.168.200.10:4200/api", server.source, "u:server", f"{tmp_path}/etc/prefect.env"
    )


def test_the_services_auth_string_goes_only_to_the_services_api() -> None:
    services = ControllerApi("http://127.0.0.1:4200/api", "the unit", "u:secret")
    same = ControllerApi("http://127.0.0.1:4200/api/", "PREFECT_API_URL in the environment")
    assert with_services_auth(same, services).auth == "u:secret"
    other = ControllerApi("http://elsewhere:4200/api", "PREFECT_API_URL in the environment")
    assert with_services_auth(other, services).auth is None
    own = ControllerApi("http://127.0.0.1:4200/api", "a profile", "u:mine")
    assert with_services_auth(own, services).auth == "u:mine"


# --- the commands, in their own processes ------------------------------------------------------


@dataclass
class Node:
    """Where the cluster's node should be: a listener that answers like a web server (not
    SSH: a run fails at once) and counts the connections."""

    host: str
    port: int
    connections: int = 0
    stop: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def node() -> Iterator[Node]:
    host = bed_ip(255)
    server = socket.create_server((host, free_port(host)))
    server.settimeout(0.2)
    found = Node(host, server.getsockname()[1])

    def serve() -> None:
        while not found.stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            found.connections += 1
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield found
    found.stop.set()
    thread.join(5)
    server.close()


@dataclass
class Cluster:
    name: str
    path: Path
    env: dict[str, str]  # the process environment of a person with nothing set up
    node: Node

    @property
    def env_file(self) -> Path:
        return self.path.with_suffix(".env")

    def cli(self, *args: str, merged: bool = False, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "vllm-redeploy"), *args, "-c", str(self.path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merged else subprocess.PIPE,
            text=True,
            timeout=110,
            env={**self.env, **env},
            cwd=self.path.parent,  # no ./.env or ./prefect.toml of the checkout
        )


@pytest.fixture
def cluster(tmp_path: Path, node: Node) -> Cluster:
    name = f"ctl{uuid.uuid4().hex[:8]}"
    path = tmp_path / "conf" / f"{name}.toml"
    path.parent.mkdir()
    path.write_text(one_node_toml(name, node.host, node.port, tmp_path / "known_hosts"))
    for d in ("home", "prefect-home", "units"):
        (tmp_path / d).mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "SYSTEMD_UNIT_PATH": str(tmp_path / "units"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    return Cluster(name, path, env, node)


def variable(api: str, cluster: str, what: str) -> object:
    found = httpx.get(f"{api}/variables/name/{variable_name(cluster, what)}", timeout=10)
    return None if found.status_code == 404 else found.json()["value"]


def flow_runs_of(api: str, path: Path) -> list[dict]:
    runs = httpx.post(
        f"{api}/flow_runs/filter",
        json={"flows": {"name": {"any_": ["redeploy-vllm-cluster"]}}},
        timeout=10,
    ).json()
    return [r for r in runs if r["parameters"].get("config_path") == str(path)]


def no_temporary_server_ran(cluster: Cluster) -> bool:
    """Prefect's temporary server keeps its database in PREFECT_HOME."""
    return not list(Path(cluster.env["PREFECT_HOME"]).glob("*.db"))


@pytest.mark.integration
def test_run_without_any_api_is_refused_and_touches_nothing(cluster: Cluster) -> None:
    done = cluster.cli("run")
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    paragraph = " ".join(done.stderr.split())
    assert paragraph.startswith(f"cluster {cluster.name}: no Prefect API found."), paragraph
    assert "`export PREFECT_API_URL=http://CONTROLLER:4200/api`" in paragraph
    assert f"or put both in {cluster.env_file}" in paragraph
    assert "or, for this one run only, add --temporary-api" in paragraph
    assert "`vllm-redeploy pause` would not hold it back" in paragraph
    assert cluster.node.connections == 0 and no_temporary_server_ran(cluster)


@pytest.mark.integration
@pytest.mark.parametrize("command", [["pause", "--reason", "firmware"], ["resume"]])
def test_pause_and_resume_without_any_api_are_refused(cluster: Cluster, command: list[str]) -> None:
    done = cluster.cli(*command)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "paused" not in done.stdout and "cleared" not in done.stdout
    paragraph = " ".join(done.stderr.split())
    assert "no Prefect API found. PREFECT_API_URL is not set" in paragraph
    assert f"{command[0]} never uses one" in paragraph and "--temporary-api" not in paragraph
    assert no_temporary_server_ran(cluster)


@pytest.mark.integration
def test_status_without_any_api_says_the_standing_is_unknown(cluster: Cluster) -> None:
    done = cluster.cli("status")
    assert done.returncode == 1  # the node is not there
    second = done.stdout.splitlines()[1]
    assert second.startswith(f"standing unknown: cluster {cluster.name}: no Prefect API found")


@pytest.mark.integration
def test_the_env_file_names_the_controller_for_pause_status_and_run(
    cluster: Cluster, prefect_server: str
) -> None:
    """The cluster's env file (which the services read) names the session's server: the pause
    goes there, status reads it back, and a run there is held back by it."""
    cluster.env_file.write_text(f"PREFECT_API_URL={prefect_server}\n")
    source = f"PREFECT_API_URL in {cluster.env_file}"
    paused = cluster.cli("pause", "--reason", "changing the fabric cables")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.startswith(f"{cluster.name}: paused by ")
    assert f"Prefect API: {prefect_server} ({source})" in paused.stderr
    assert variable(prefect_server, cluster.name, "pause")["reason"] == "changing the fabric cables"

    status = cluster.cli("status").stdout.splitlines()
    assert status[1].startswith("paused by ") and status[1].endswith("changing the fabric cables")
    assert status[2] == f"standing read from the Prefect API at {prefect_server} ({source})"

    cluster.node.connections = 0
    run = cluster.cli("run")
    assert run.returncode == 1, run.stderr[-2000:]  # nothing was done: a script must know
    said = " ".join(run.stderr.split())
    assert f"{cluster.name}: nothing was done (skipped: paused by " in said, said
    assert "`vllm-redeploy run --override-pause` runs it anyway" in said
    (flow_run,) = flow_runs_of(prefect_server, cluster.path)
    assert flow_run["state_name"] == "Skipped", flow_run["state"]
    assert "changing the fabric cables" in flow_run["state"]["message"]
    assert cluster.node.connections == 0  # the pause held it back
    assert no_temporary_server_ran(cluster)

    resumed = cluster.cli("resume")
    assert resumed.stdout.strip() == f"{cluster.name}: cleared pause", resumed.stderr
    assert variable(prefect_server, cluster.name, "pause") is None


@pytest.mark.integration
def test_a_prefect_profile_names_the_controller(cluster: Cluster, prefect_server: str) -> None:
    """PREFECT_API_URL set with `prefect config set` (the active profile) is the person's
    explicit choice: pause writes there and status reads the pause back from there."""
    profiles = Path(cluster.env["PREFECT_HOME"]) / "profiles.toml"
    profiles.write_text(f'active = "ctl"\n[profiles.ctl]\nPREFECT_API_URL = "{prefect_server}"\n')
    paused = cluster.cli("pause", "--reason", "new firmware", "--for", "1h")
    assert paused.returncode == 0, paused.stderr
    assert variable(prefect_server, cluster.name, "pause")["reason"] == "new firmware"
    status = cluster.cli("status").stdout.splitlines()
    assert status[1].startswith("paused by ") and status[1].endswith(": new firmware")
    source = f"PREFECT_API_URL of the Prefect profile ctl in {profiles}"
    assert status[2] == f"standing read from the Prefect API at {prefect_server} ({source})"
    assert cluster.cli("resume").returncode == 0


@pytest.mark.integration
def test_the_installed_units_name_the_controller(cluster: Cluster, prefect_server: str) -> None:
    """No PREFECT_API_URL anywhere a person sets it, but the controller's units are installed:
    the serve unit's EnvironmentFile (as install-controller writes it, with the server moved)."""
    units = Path(cluster.env["SYSTEMD_UNIT_PATH"])
    etc = units.parent / "etc"
    etc.mkdir()
    (etc / f"{cluster.name}.env").write_text(f"PREFECT_API_URL={prefect_server}\n")
    template = (SOURCE_DIR / "vllm-redeploy-serve@.service").read_text()
    (units / "vllm-redeploy-serve@.service").write_text(
        template.replace("/etc/vllm-redeploy/", f"{etc}/")
    )
    paused = cluster.cli("pause", "--reason", "units")
    assert paused.returncode == 0, paused.stderr
    assert variable(prefect_server, cluster.name, "pause")["reason"] == "units"
    unit = units / "vllm-redeploy-serve@.service"
    source = (
        f"PREFECT_API_URL in {etc}/{cluster.name}.env, the installed unit {unit}'s EnvironmentFile"
    )
    assert f"Prefect API: {prefect_server} ({source})" in " ".join(paused.stderr.split())
    assert cluster.cli("resume").returncode == 0
    assert variable(prefect_server, cluster.name, "pause") is None


@pytest.mark.integration
def test_an_api_that_does_not_answer_is_named_and_nothing_is_touched(cluster: Cluster) -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}/api"
    for command in (["run"], ["pause", "--reason", "x"]):
        done = cluster.cli(*command, PREFECT_API_URL=url)
        assert done.returncode == 3, done.stdout + done.stderr
        said = " ".join(done.stderr.split())
        assert said.startswith(
            f"the Prefect API at {url} (PREFECT_API_URL in the environment) does not answer ("
        ), said
        assert "Traceback" not in said and done.stdout == ""
    assert cluster.node.connections == 0


@pytest.mark.integration
@pytest.mark.timeout(240)  # a temporary Prefect server starts
def test_a_run_on_a_temporary_api_says_so_on_its_first_line(
    cluster: Cluster, prefect_server: str
) -> None:
    """--temporary-api: the person asked for a throwaway API. The first line says that the
    controller does not see it, and names the controller's API it does not use."""
    cluster.env_file.write_text(f"PREFECT_API_URL={prefect_server}\n")
    done = cluster.cli("run", "--temporary-api", merged=True)
    first, *_ = done.stdout.splitlines()
    assert first.startswith(NOTICE) and "the controller's services do not see" in first, first
    assert first.endswith(
        f"Not used: the Prefect API at {prefect_server} (PREFECT_API_URL in {cluster.env_file})."
    )
    assert done.returncode == 1 and "failed at preflight" in done.stdout, done.stdout[-3000:]
    assert "Traceback" not in done.stdout
    assert cluster.node.connections > 0  # it did run
    assert flow_runs_of(prefect_server, cluster.path) == []  # not on the controller's API


@pytest.mark.integration
def test_a_temporary_api_that_does_not_come_up_is_one_paragraph_and_touches_nothing(
    cluster: Cluster,
) -> None:
    """Prefect's own startup wait, which the environment may set, is 0 s here: the temporary
    server is never waited for, as if it took longer than any wait. The run says so in words."""
    done = cluster.cli(
        "run", "--temporary-api", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="0"
    )
    assert done.returncode == 3 and done.stdout == "", done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert "The temporary Prefect API did not come up (Timed out" in said, said
    assert "nothing was run and no node was touched" in said
    assert "Traceback" not in said and "stdout:" not in said
    assert cluster.node.connections == 0


# --- the controller as install-controller leaves it: API auth on --------------------------------

AUTH = "vllm-redeploy:" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prefect server that refuses calls without AUTH, as vllm-redeploy-prefect runs."""
    root = tmp_path_factory.mktemp("auth-server")
    port = free_port("127.0.0.1")
    env = {
        "PREFECT_HOME": str(root),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_SERVER_API_AUTH_STRING": AUTH,
        "PREFECT_API_URL": "",
    }
    argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    proc = spawn(argv, root / "server.log", env)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_until(lambda: answers(url), 90, "prefect server with auth", root / "server.log")
        yield url
    finally:
        stop(proc, grace=15)


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def authed_variable(api: str, cluster: str, what: str) -> object:
    found = httpx.get(
        f"{api}/variables/name/{variable_name(cluster, what)}",
        headers=auth_headers(AUTH),
        timeout=10,
    )
    return None if found.status_code == 404 else found.json()["value"]


def installed(cluster: Cluster, api: str, auth: str) -> None:
    """What install-controller writes, moved below tmp: the serve template naming the server,
    and the cluster's env file beside its TOML with the auth string only (its PREFECT_API_URL
    line commented out, as written)."""
    units = Path(cluster.env["SYSTEMD_UNIT_PATH"])
    template = (SOURCE_DIR / "vllm-redeploy-serve@.service").read_text()
    template = template.replace("http://127.0.0.1:4200/api", api)
    template = template.replace("/etc/vllm-redeploy/", f"{cluster.path.parent}/")
    (units / "vllm-redeploy-serve@.service").write_text(template)
    cluster.env_file.write_text(
        f"#PREFECT_API_URL=http://127.0.0.1:4200/api\nPREFECT_API_AUTH_STRING={auth}\n"
    )


@pytest.mark.integration
def test_the_installed_controller_with_its_auth_string(cluster: Cluster, auth_server: str) -> None:
    """The units name the API, the cluster's env file the auth string: pause sends it, status
    reads the pause back with it."""
    installed(cluster, auth_server, AUTH)
    paused = cluster.cli("pause", "--reason", "with auth")
    assert paused.returncode == 0, paused.stderr
    assert authed_variable(auth_server, cluster.name, "pause")["reason"] == "with auth"
    assert AUTH not in paused.stdout + paused.stderr
    status = cluster.cli("status")
    assert status.stdout.splitlines()[1].endswith(": with auth"), status.stdout[:500]
    # PREFECT_API_URL set by hand to the same API: the services' auth string goes with it.
    resumed = cluster.cli("resume", PREFECT_API_URL=auth_server)
    assert resumed.stdout.strip() == f"{cluster.name}: cleared pause", resumed.stderr
    assert authed_variable(auth_server, cluster.name, "pause") is None


@pytest.mark.integration
def test_a_wrong_auth_string_is_named_not_a_traceback(cluster: Cluster, auth_server: str) -> None:
    wrong = "vllm-redeploy:" + uuid.uuid4().hex
    installed(cluster, auth_server, wrong)
    done = cluster.cli("pause", "--reason", "x")
    assert done.returncode == 3, done.stdout + done.stderr
    said = " ".join(done.stderr.split())
    assert said.startswith(
        f"the Prefect API at {auth_server} (PREFECT_API_URL of the installed unit"
    )
    given = f"with the auth string from {cluster.env_file}"
    assert f"refuses the request (HTTP 401, {given}): set PREFECT_API_AUTH_STRING" in said
    assert "Traceback" not in said and wrong not in said
    # Another API than the services' (by its address): their auth string is not sent there.
    elsewhere = auth_server.replace("127.0.0.1", "localhost")
    other = cluster.cli("pause", "--reason", "x", PREFECT_API_URL=elsewhere)
    assert "HTTP 401, without an auth string" in " ".join(other.stderr.split()), other.stderr
