"""Docker on a node through the docker SDK: over the node's SSH connection, or a local socket.

For SSH nodes the SDK's paramiko adapter is reused, but fed the runner's own connection, so
Docker traffic obeys the same host-key rules and shares the node's one connection (each pooled
HTTP connection is a channel running ``docker system dial-stdio`` on the node, leased from the
runner so that the node's sshd never sees more channels than its MaxSessions).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import json
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, TypeVar

import docker
import docker.constants
import docker.errors
import paramiko
import requests
from docker.models.containers import Container
from docker.transport.sshconn import SSHConnection, SSHConnectionPool, SSHHTTPAdapter
from docker.types import DeviceRequest, Ulimit

from vllm_redeploy.nodes.containers import ContainerInfo, ContainerSpec
from vllm_redeploy.nodes.errors import RemoteError
from vllm_redeploy.nodes.result import CommandResult
from vllm_redeploy.nodes.runner import OutputCapture, Runner
from vllm_redeploy.nodes.ssh import ChannelLease, SSHRunner
from vllm_redeploy.safe_text import one_line

# The API spoken to a node's engine is negotiated at its first call: the engine's own version,
# capped at the newest this SDK is tested with. 1.41 = Docker 20.10, the oldest engine with
# everything used here (GPU device requests need 1.40); Docker 29 refuses below 1.44. Clients
# start at 1.41, so that creating one never contacts the node.
API_VERSION = "1.41"
NEWEST_API = docker.constants.DEFAULT_DOCKER_API_VERSION  # 1.45 for docker 7.2
API_TIMEOUT_S = 60
# A start's log (NCCL's INFO lines of every rank, the load, the compile) is well under this; what
# follows it is request lines, weeks of them on a long-running engine.
LOG_HEAD_BYTES = 4 * 1024 * 1024
DIAL_ARGV = ("docker", "system", "dial-stdio")  # what the SDK runs on a node to reach Docker
# Placeholder base URL: the real transport is mounted on http+docker://ssh below.
_SSH_BASE_URL = "http+docker://ssh"
_UNUSED_TCP_URL = "tcp://127.0.0.1:9"
# Idle HTTP connections kept per node: each holds one of the connection's channels.
POOLED_CHANNELS = 2

T = TypeVar("T")


class DockerError(RemoteError):
    """A Docker operation on a node failed; ``transient`` when the connection to it broke."""

    def __init__(self, node: str, message: str, transient: bool = False) -> None:
        super().__init__(node, one_line(message))
        self.transient = transient

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (DockerError, (self.node, self.message, self.transient))


class _LeasedConnection(SSHConnection):
    """docker's HTTP-over-SSH connection, on a channel leased from the runner."""

    def __init__(self, runner: SSHRunner, timeout: int) -> None:
        super().__init__(None, timeout)
        self._runner = runner
        self._lease: ChannelLease | None = None

    def connect(self) -> None:
        self._give_back()  # http.client connects again on the same object once the peer closed
        self._lease = self._runner.open_channel()
        channel = self._lease.channel
        channel.settimeout(self.timeout)
        channel.exec_command(" ".join(DIAL_ARGV))
        self.sock = channel

    def close(self) -> None:
        super().close()
        self._give_back()

    def _give_back(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()


class _LeasedPool(SSHConnectionPool):
    def __init__(self, runner: SSHRunner, timeout: int) -> None:
        super().__init__(None, timeout=timeout, maxsize=POOLED_CHANNELS)
        self._runner = runner

    def _new_conn(self) -> _LeasedConnection:
        return _LeasedConnection(self._runner, self.timeout)


class _RunnerSSHAdapter(SSHHTTPAdapter):
    """docker's paramiko adapter, fed the SSH runner's connection instead of its own."""

    def __init__(self, runner: SSHRunner, timeout: int) -> None:
        self._runner = runner
        super().__init__(f"ssh://{runner.target.host}", timeout=timeout)

    def _create_paramiko_client(self, base_url: str) -> None:
        self.ssh_client = None

    def _connect(self) -> None:
        self.ssh_client = self._runner.client()

    def get_connection(self, url: Any, proxies: Any = None) -> Any:
        client = self._runner.client()  # reconnects if the connection died
        if client is not self.ssh_client:
            self.ssh_client = client
            self.pools.clear()  # pools hold channels of the old connection
        # One pool for every URL (requests asks per request URL; docker's own adapter keeps a
        # pool, and its idle channel, per path until ten are kept).
        with self.pools.lock:
            pool = self.pools.get(_SSH_BASE_URL)
            if pool is None:
                pool = self.pools[_SSH_BASE_URL] = _LeasedPool(self._runner, self.timeout)
        return pool

    def close(self) -> None:
        # The connection belongs to the runner; only drop our pools (closing a channel of a
        # connection that died raises: nothing is left to close then).
        with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
            self.pools.clear()


def node_docker_for(runner: Runner, docker_host: str | None = None) -> NodeDocker:
    """Docker on the node behind ``runner``, sharing its SSH connection if it has one."""
    if isinstance(runner, SSHRunner):
        client = docker_client_for(runner, docker_host)
        return NodeDocker(runner.node, client, runner.close, lambda: _dial_problem(runner))
    return NodeDocker(runner.node, docker_client_for(runner, docker_host))


def _dial_problem(runner: SSHRunner) -> str | None:
    """Why ``docker system dial-stdio`` (how the SDK reaches Docker over SSH) fails on the
    node, in its own words and with the fix; None when it works. The SDK sees only a closed
    connection: the words are on the command's stderr."""
    try:
        done = runner.run(DIAL_ARGV, check=False, timeout=15, stdin=b"")
    except RemoteError:
        return None
    said = " ".join(done.stderr.split())
    if done.exit_code == 0 or not said:
        return None
    if "permission denied" in said.lower():
        login = runner.target.user or "the login"
        return (
            f"{said}. The login {login} may not use Docker's socket on {runner.node}: add it to "
            f"the docker group (`sudo usermod -aG docker {login}`; it takes effect at its next "
            "login, which the next run makes)"
        )
    return said


def docker_client_for(runner: Runner, docker_host: str | None = None) -> docker.DockerClient:
    """A docker SDK client for the node behind ``runner``. Nothing is contacted yet."""
    if isinstance(runner, SSHRunner):
        client = docker.DockerClient(
            base_url=_UNUSED_TCP_URL, version=API_VERSION, timeout=API_TIMEOUT_S
        )
        client.api.mount(_SSH_BASE_URL, _RunnerSSHAdapter(runner, API_TIMEOUT_S))
        client.api.base_url = _SSH_BASE_URL
        return client
    if docker_host:
        return docker.DockerClient(base_url=docker_host, version=API_VERSION, timeout=API_TIMEOUT_S)
    return docker.DockerClient.from_env(version=API_VERSION, timeout=API_TIMEOUT_S)


class NodeDocker:
    """The Docker operations the redeploy needs, on one node, with node-named errors."""

    def __init__(
        self,
        node: str,
        client: docker.DockerClient,
        reset: Callable[[], None] | None = None,
        explain: Callable[[], str | None] | None = None,
    ) -> None:
        self.node = node
        self._client = client
        # Called when the transport fails, before the one retry: drops a dead SSH connection
        # that paramiko has not noticed yet, so the retry dials a fresh one.
        self._reset = reset
        # Called when the retry failed too: why the node's end of the connection closed.
        self._explain = explain
        self._negotiated = False

    def __repr__(self) -> str:
        return f"<NodeDocker {self.node}>"

    def close(self) -> None:
        self._client.close()

    def _call(self, what: str, fn: Callable[[], T], retry: bool = True) -> T:
        """Run one SDK call; a dropped connection is retried once when ``retry`` is set."""
        for attempt in (1, 2):
            try:
                if not self._negotiated:
                    self._negotiate()
                return fn()
            except (requests.exceptions.ConnectionError, paramiko.SSHException, EOFError) as exc:
                if self._reset is not None:
                    self._reset()
                if not retry or attempt == 2:
                    why = self._explain() if self._explain is not None else None
                    raise DockerError(
                        self.node,
                        f"Docker on {self.node}: {what} failed: {why or exc}",
                        transient=why is None,  # a refusal in words stays a refusal
                    ) from None
            except requests.exceptions.Timeout:
                raise DockerError(
                    self.node,
                    f"Docker on {self.node}: {what} got no answer within "
                    f"{self._client.api.timeout:g} s: its "
                    f"engine is stuck or overloaded (on {self.node}: `systemctl status docker`, "
                    "`journalctl -u docker`)",
                ) from None
            except docker.errors.DockerException as exc:
                raise DockerError(
                    self.node, f"Docker on {self.node}: {what} failed: {_plain(exc)}"
                ) from None
            except RemoteError:
                raise
        raise AssertionError("unreachable")

    def _negotiate(self) -> None:
        """Speak the engine's API version, up to NEWEST_API: asked unversioned, as the docker
        CLI does, since an engine refuses versions outside its range (29: below 1.44)."""
        api = self._client.api
        answer = api.version(api_version=False)
        newest = str(answer.get("ApiVersion") or API_VERSION)
        oldest = str(answer.get("MinAPIVersion") or "1.12")
        if _api_tuple(newest) < _api_tuple(API_VERSION):
            raise DockerError(
                self.node,
                f"Docker on {self.node} is {answer.get('Version', '?')} (API {newest}); "
                f"vllm-redeploy needs API {API_VERSION} (Docker 20.10) or newer: upgrade Docker",
            )
        chosen = min(newest, NEWEST_API, key=_api_tuple)
        api._version = max(chosen, oldest, key=_api_tuple)
        self._negotiated = True

    @property
    def api_version(self) -> str:
        """The API version spoken to the engine (negotiated at the first call)."""
        return str(self._client.api._version)

    def version(self) -> str:
        return self._call("version", lambda: self._client.version()["Version"])

    def cgroup_driver(self) -> str:
        """The engine's cgroup driver: "systemd" or "cgroupfs" (`docker info`)."""
        return self._call("info", lambda: str(self._client.info().get("CgroupDriver", "")))

    def image_id(self, image: str) -> str | None:
        """What ``image`` is on this node, comparable across nodes (see ``content_id``), or
        None when the node does not have it."""

        def lookup() -> str | None:
            try:
                return content_id(self._client.api.inspect_image(image))
            except docker.errors.ImageNotFound:
                return None

        return self._call(f"inspect image {image}", lookup)

    def image_size(self, image: str) -> int:
        """The image's size unpacked, in bytes (about what `docker save` streams)."""
        return self._call(
            f"inspect image {image}",
            lambda: int(self._client.api.inspect_image(image).get("Size") or 0),
        )

    def root_dir(self) -> str:
        """Where the engine keeps images (`docker info`'s DockerRootDir)."""
        return self._call("info", lambda: str(self._client.info().get("DockerRootDir", "/")))

    def image_user(self, image: str) -> str:
        """The image's USER ("" when it runs as root, Docker's default)."""
        return self._call(
            f"inspect image {image}",
            lambda: str(
                (self._client.api.inspect_image(image).get("Config") or {}).get("User") or ""
            ),
        )

    def image_entrypoint(self, image: str) -> tuple[list[str] | None, str | None]:
        """The image's ENTRYPOINT, and when that is one file, its first 64 KiB (read from a
        container created for it, never started, and removed at once)."""

        def read() -> tuple[list[str] | None, str | None]:
            entrypoint = (self._client.api.inspect_image(image).get("Config") or {}).get(
                "Entrypoint"
            )
            if not entrypoint or len(entrypoint) != 1 or not entrypoint[0].startswith("/"):
                return entrypoint or None, None
            created = self._client.api.create_container(image, command=["true"])["Id"]
            try:
                stream, _ = self._client.api.get_archive(created, entrypoint[0])
                data = b"".join(stream)
            except docker.errors.NotFound:
                return entrypoint, None
            finally:
                self._client.api.remove_container(created, force=True)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                member = tar.next()
                file = tar.extractfile(member) if member is not None and member.isfile() else None
                return entrypoint, file.read(65536).decode("utf-8", "replace") if file else None

        return self._call(f"read the entrypoint of image {image}", read)

    def list_containers(
        self, name_patterns: Sequence[str] = (), labels: Mapping[str, str] | None = None
    ) -> list[ContainerInfo]:
        """Containers (running or not) whose name matches a glob pattern, or carrying all
        ``labels``. With neither, nothing is listed: we never act on containers not named."""
        if not name_patterns and not labels:
            return []
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]} if labels else None
        # The SDK lists IDs, then inspects each: one removed in between (a `docker run --rm`
        # on the same node, such as preflight's look at the image) is gone, not an error.
        found = self._call(
            "list containers",
            lambda: self._client.containers.list(all=True, filters=filters, ignore_removed=True),
        )
        if name_patterns:
            found = _named(found, name_patterns)
        return [_info(c) for c in found]

    def list_matching_and_labelled(
        self, name_patterns: Sequence[str], labels: Mapping[str, str]
    ) -> tuple[list[ContainerInfo], list[ContainerInfo]]:
        """(containers whose name matches a pattern, containers carrying all ``labels``), from
        one listing of the node's containers instead of two calls."""
        found = self._call(
            "list containers",
            lambda: self._client.containers.list(all=True, ignore_removed=True),
        )
        named = _named(found, name_patterns)
        wanted = set(labels.items())
        labelled = [c for c in found if wanted <= set((c.labels or {}).items())]
        return [_info(c) for c in named], [_info(c) for c in labelled]

    def publishing(self, port: int) -> list[str]:
        """The running containers that publish ``port`` on the host (`docker ps --filter
        publish=PORT`): whose is a port that docker-proxy holds."""
        found = self._call(
            f"list containers publishing {port}",
            lambda: self._client.containers.list(filters={"publish": str(port)}, sparse=True),
        )
        return [c.attrs.get("Names", [c.id])[0].lstrip("/") for c in found]

    def get(self, name: str) -> ContainerInfo | None:
        def lookup() -> ContainerInfo | None:
            try:
                return _info(self._client.containers.get(name))
            except docker.errors.NotFound:
                return None

        return self._call(f"inspect container {name}", lookup)

    def set_restart_policy(self, name: str, policy: str = "no") -> None:
        self._call(
            f"set restart policy of {name}",
            lambda: self._client.api.update_container(name, restart_policy={"Name": policy}),
        )

    def start(self, name: str) -> None:
        """Start an exited container again: its command, as it was created."""
        self._call(f"start {name}", lambda: self._client.api.start(name))

    def stop(self, name: str, timeout_s: int = 10) -> None:
        """Stop a container; one that is already gone counts as stopped."""
        self._call(
            f"stop {name}",
            lambda: _ignore_missing(lambda: self._client.api.stop(name, timeout=timeout_s)),
        )

    def remove(self, name: str) -> None:
        """Force-remove a container (volumes it named stay); one already gone counts as removed."""
        self._call(
            f"remove {name}",
            lambda: _ignore_missing(lambda: self._client.api.remove_container(name, force=True)),
        )

    def remove_all(self, names: Sequence[str]) -> None:
        """Force-remove several containers at once: each removal waits for its processes."""
        if len(names) <= 1:
            for name in names:
                self.remove(name)
            return
        with ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="remove") as pool:
            list(pool.map(self.remove, names))

    def run_detached(self, spec: ContainerSpec) -> str:
        """Create and start ``spec``; return the container ID. Not retried: it is not idempotent."""
        device_requests = (
            [DeviceRequest(count=spec.gpus, capabilities=[["gpu"]])]
            if spec.gpus is not None
            else None
        )

        def start() -> str:
            container = self._client.containers.run(
                spec.image,
                command=list(spec.command) or None,
                entrypoint=list(spec.entrypoint) if spec.entrypoint is not None else None,
                name=spec.name,
                detach=True,
                environment=dict(spec.env),
                volumes=list(spec.volumes),
                labels=dict(spec.labels),
                shm_size=spec.shm_size,
                network_mode="host",
                ipc_mode="host",
                pid_mode=spec.pid_mode,
                device_requests=device_requests,
                devices=list(spec.devices) or None,
                cap_add=list(spec.cap_add) or None,
                ulimits=[Ulimit(name=k, soft=v, hard=v) for k, v in spec.ulimits.items()] or None,
                privileged=spec.privileged,
                user=spec.user,
                restart_policy={"Name": "no"},
            )
            return container.id

        return self._call(f"start container {spec.name} from {spec.image}", start, retry=False)

    def run_to_completion(self, spec: ContainerSpec, timeout_s: float) -> tuple[int | None, str]:
        """Run ``spec`` once: (exit code, or None past the timeout; its log). Removed after."""
        self.remove(spec.name)
        try:
            self.run_detached(spec)  # a container created but not started is removed too
            code = self.wait(spec.name, timeout_s)
            return code, self.logs_tail(spec.name, lines=200)
        finally:
            self.remove(spec.name)

    def logs_tail(self, name: str, lines: int | str = 50) -> str:
        """The container's last ``lines`` log lines (``"all"``: from its start)."""
        return self._call(
            f"read logs of {name}",
            lambda: self._client.api.logs(name, stdout=True, stderr=True, tail=lines).decode(
                "utf-8", "replace"
            ),
        )

    def log_lines(
        self,
        name: str,
        *,
        follow: bool = False,
        since: float | None = None,
        tail: int | str = "all",
    ) -> Iterator[str]:
        """The container's log line by line (stdout and stderr as Docker interleaves them):
        its last ``tail`` lines, those after ``since`` (a Unix time); with ``follow``, then
        each new line until the container stops."""
        chunks = self._call(
            f"read logs of {name}",
            lambda: self._client.api.logs(name, stream=True, follow=follow, since=since, tail=tail),
        )
        pending = b""
        try:
            for chunk in chunks:
                *lines, pending = (pending + chunk).split(b"\n")
                yield from (line.decode("utf-8", "replace") for line in lines)
        except (requests.exceptions.RequestException, paramiko.SSHException, OSError) as exc:
            raise DockerError(
                self.node, f"Docker on {self.node}: the log of {name} broke off: {exc}"
            ) from None
        finally:  # a reader that stops early closes the stream, not the garbage collector
            with contextlib.suppress(Exception):
                chunks.close()
        if pending:
            yield pending.decode("utf-8", "replace")

    def log_head(self, name: str, max_bytes: int = LOG_HEAD_BYTES) -> str:
        """The container's log from its start, up to ``max_bytes``: what a start logs (NCCL's
        choice, the compile cache) without the weeks of request lines that may follow."""
        kept: list[str] = []
        size = 0
        lines = self.log_lines(name)
        try:
            for line in lines:
                size += len(line) + 1
                if size > max_bytes:
                    break
                kept.append(line)
        finally:
            lines.close()
        return "\n".join(kept)

    def wait(self, name: str, timeout_s: float) -> int | None:
        """Wait for the container to exit: its exit code, or None if running at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.get(name)
            if info is None or not info.running:
                return info.exit_code if info else None
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))

    def exec_runner(self, container: str) -> ContainerExecRunner:
        return ContainerExecRunner(self, container)

    def _exec(
        self,
        container: str,
        argv: tuple[str, ...],
        env: dict[str, str],
        timeout: float,
        capture: OutputCapture,
    ) -> tuple[int | None, bool]:
        deadline = time.monotonic() + timeout
        api = self._client.api

        def run() -> tuple[int | None, bool]:
            exec_id = api.exec_create(container, list(argv), environment=env or None)["Id"]
            stream = api.exec_start(exec_id, stream=True, demux=True)
            try:
                for out, err in stream:
                    if out:
                        capture.feed("stdout", out)
                    if err:
                        capture.feed("stderr", err)
                    if time.monotonic() > deadline:
                        return None, True
            finally:
                # The upgraded connection is never handed back to the pool, and the SDK's own
                # close() refuses SSH: close its response, which closes the connection and gives
                # its channel's place back (else each exec would keep one until exhausted).
                stream._response.close()
            return api.exec_inspect(exec_id)["ExitCode"], False

        return self._call(f"exec in {container}", run, retry=False)


class ContainerExecRunner(Runner):
    """Runs argv inside a running container (``docker exec``): argv goes as a list, no shell.

    The timeout is checked as output arrives; a command that prints nothing is bounded by the
    Docker client's read timeout.
    """

    def __init__(self, docker_node: NodeDocker, container: str) -> None:
        super().__init__(f"{docker_node.node}/{container}")
        self._docker = docker_node
        self.container = container

    def _execute(
        self,
        argv: tuple[str, ...],
        *,
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,
        capture: OutputCapture,
    ) -> tuple[int | None, bool]:
        if stdin is not None:
            raise ValueError("stdin is not supported by docker exec here")
        return self._docker._exec(self.container, argv, env, timeout, capture)


def _ignore_missing(fn: Callable[[], object]) -> None:
    with contextlib.suppress(docker.errors.NotFound):
        fn()


def _named(containers: list[Any], patterns: Sequence[str]) -> list[Any]:
    """The containers whose name matches one of the glob patterns."""
    return [c for c in containers if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def _info(container: Container) -> ContainerInfo:
    attrs = container.attrs
    state = attrs.get("State", {})
    return ContainerInfo(
        id=container.id,
        name=container.name,
        image=attrs.get("Config", {}).get("Image", ""),
        status=state.get("Status", "unknown"),
        restart_policy=attrs.get("HostConfig", {}).get("RestartPolicy", {}).get("Name") or "no",
        labels=attrs.get("Config", {}).get("Labels") or {},
        exit_code=state.get("ExitCode") if state.get("Status") in ("exited", "dead") else None,
        oom_killed=bool(state.get("OOMKilled")),
        started_at=_docker_time(state.get("StartedAt", "")) if state.get("Running") else None,
    )


_CONFIG_KEYS = ("Cmd", "Entrypoint", "Env", "Labels", "User", "WorkingDir")


def content_id(inspect: Mapping[str, Any]) -> str:
    """A digest of what an image is (its layers' content and its configuration), equal on every
    engine that holds the same image. Not the engine's ``Id``: the classic image store reports
    the config's digest there, the containerd store (the default on fresh Docker 29 installs)
    the manifest's (docker/cli#6670), so one image shows two IDs across a cluster mid-upgrade."""
    what = {
        "layers": (inspect.get("RootFS") or {}).get("Layers") or [],
        # What every API version reports alike (newer ones drop Hostname, Image and others).
        "config": {k: (inspect.get("Config") or {}).get(k) or None for k in _CONFIG_KEYS},
        "platform": [inspect.get("Os"), inspect.get("Architecture"), inspect.get("Variant")],
    }
    data = json.dumps(what, sort_keys=True, separators=(",", ":")).encode()
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _api_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def _docker_time(text: str) -> datetime | None:
    """Docker's RFC 3339 times carry nanoseconds: 2026-01-02T03:04:05.123456789Z."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    try:
        parsed = datetime.fromisoformat(whole).replace(tzinfo=UTC)
    except ValueError:
        return None
    return parsed.replace(microsecond=int(fraction[:6].ljust(6, "0"))) if fraction else parsed


def _plain(exc: docker.errors.DockerException) -> str:
    if isinstance(exc, docker.errors.APIError):
        return str(exc.explanation or exc)
    return str(exc)


__all__ = [
    "CommandResult",
    "ContainerExecRunner",
    "DockerError",
    "NodeDocker",
    "docker_client_for",
]
