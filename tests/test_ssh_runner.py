"""The SSH transport against a real OpenSSH server on loopback."""

from __future__ import annotations

import pickle
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import NODE_IP, keep_for_notes, make_bed
from tests.test_local_runner import BATCH, check_batch
from tests.testbed import users
from tests.testbed.bed import TestBed
from tests.testbed.dockerd import DockerEngine
from tests.testbed.procs import pids_with_arg, wait_until
from tests.testbed.sshd import SSHServer, keygen
from vllm_redeploy.nodes import (
    AuthenticationFailed,
    CommandFailed,
    CommandTimedOut,
    HostKeyRejected,
    NodeUnreachable,
    SSHRunner,
    SSHTarget,
)
from vllm_redeploy.nodes.docker import node_docker_for
from vllm_redeploy.nodes.privilege import SUDO
from vllm_redeploy.nodes.result import CommandResult

pytestmark = pytest.mark.integration


def test_success_returns_output_and_exit_code(ssh_runner: SSHRunner) -> None:
    result = ssh_runner.run(["sh", "-c", "echo out; echo err >&2"], timeout=10)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n")
    assert result.ok and result.node == "node-a" and not result.timed_out


def test_failure_raises_with_exit_code_and_stderr_tail(ssh_runner: SSHRunner) -> None:
    with pytest.raises(CommandFailed) as info:
        ssh_runner.run(["sh", "-c", "echo boom-detail >&2; exit 3"], timeout=10)
    assert info.value.result.exit_code == 3
    message = str(info.value)
    assert "exit code 3" in message and "node-a" in message and "boom-detail" in message


def test_run_all_over_ssh_answers_as_locally(ssh_runner: SSHRunner) -> None:
    check_batch(ssh_runner.run_all(BATCH, timeout=10))


def test_check_false_returns_the_failure(ssh_runner: SSHRunner) -> None:
    result = ssh_runner.run(["sh", "-c", "exit 7"], timeout=10, check=False)
    assert result.exit_code == 7 and not result.ok


def test_timeout_is_wall_clock_and_keeps_partial_output(ssh_runner: SSHRunner) -> None:
    started = time.monotonic()
    with pytest.raises(CommandTimedOut) as info:
        ssh_runner.run(["sh", "-c", "echo before; sleep 30"], timeout=1.0, check=False)
    assert time.monotonic() - started < 5
    assert info.value.result.exit_code is None and info.value.result.timed_out
    assert info.value.result.stdout == "before\n"
    # The connection is still usable afterwards.
    assert ssh_runner.run(["echo", "again"], timeout=10).stdout == "again\n"


def test_lines_stream_while_the_command_runs(ssh_runner: SSHRunner) -> None:
    seen: list[tuple[float, str, str]] = []
    ssh_runner.run(
        ["sh", "-c", "echo first; echo warn >&2; sleep 1.5; echo second"],
        timeout=10,
        on_line=lambda line, stream: seen.append((time.monotonic(), stream, line)),
    )
    assert [(s, line) for _, s, line in seen] in (
        [("stdout", "first"), ("stderr", "warn"), ("stdout", "second")],
        [("stderr", "warn"), ("stdout", "first"), ("stdout", "second")],
    )
    assert seen[-1][0] - seen[0][0] > 1.0  # the first line arrived before the command ended


def test_argv_is_quoted_so_shell_syntax_stays_literal(
    ssh_runner: SSHRunner, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    hostile = [
        f"; touch {marker}",
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"a\ntouch {marker}",
        "it's",
    ]
    result = ssh_runner.run(["printf", "%s|", *hostile], timeout=10)
    assert result.stdout == "|".join(hostile) + "|"
    assert not marker.exists()


def test_env_and_stdin_reach_the_command(ssh_runner: SSHRunner) -> None:
    result = ssh_runner.run(
        ["sh", "-c", 'printf "%s:" "$GREETING"; cat'],
        timeout=10,
        env={"GREETING": "hi there"},
        stdin=b"from stdin",
    )
    assert result.stdout == "hi there:from stdin"


def test_connection_is_reused_and_recovers_after_a_drop(
    ssh_runner: SSHRunner, sshd: SSHServer
) -> None:
    ssh_runner.run(["true"], timeout=10)
    first = ssh_runner.client()
    ssh_runner.run(["true"], timeout=10)
    assert ssh_runner.client() is first  # one connection per node
    assert sshd.drop_connections() >= 1
    time.sleep(0.2)
    assert ssh_runner.run(["echo", "back"], timeout=10).stdout == "back\n"
    assert ssh_runner.client() is not first


def test_many_commands_at_once_stay_within_sshd_max_sessions(ssh_runner: SSHRunner) -> None:
    """OpenSSH's sshd refuses an 11th channel on one connection (MaxSessions 10): a fan-out of
    more commands than that waits for its turn, and none breaks the connection of the others."""
    outcomes = fan_out_threads(
        lambda i: ssh_runner.run(["sh", "-c", f"sleep 0.3; echo {i}"], timeout=30), 30
    )
    assert outcomes == [f"{i}\n" for i in range(30)]


def test_docker_calls_and_commands_at_once_share_the_connection(
    ssh_runner: SSHRunner, dockerd: DockerEngine
) -> None:
    """The Docker SDK's pooled HTTP connections are channels of the same connection."""
    docker = node_docker_for(ssh_runner)
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            if i % 2:
                docker.version()
                docker.list_containers()
            else:
                ssh_runner.run(["sh", "-c", "sleep 0.2"], timeout=30)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    docker.close()
    assert errors == [], errors[:3]


def test_a_node_that_refuses_channels_sooner_is_waited_for(
    tmp_path: Path, client_key: Path
) -> None:
    """A node whose sshd allows fewer sessions than we open (MaxSessions 2): the refused
    channel is asked for again as others close, never taken for a dead link."""
    server = SSHServer(tmp_path / "sshd", NODE_IP, [client_key], options=["MaxSessions 2"])
    server.start()
    try:
        known = tmp_path / "known_hosts"
        known.write_text(server.known_hosts_line())
        target = SSHTarget(
            host=server.host, port=server.port, user="root", key_file=client_key,
            known_hosts=known,
        )  # fmt: skip
        with SSHRunner("node-b", target) as runner:
            outcomes = fan_out_threads(
                lambda i: runner.run(["sh", "-c", f"sleep 0.2; echo {i}"], timeout=30), 8
            )
        assert outcomes == [f"{i}\n" for i in range(8)]
    finally:
        server.stop()


def fan_out_threads(fn: Callable[[int], CommandResult], count: int) -> list[str | BaseException]:
    found: list[str | BaseException] = [""] * count

    def one(i: int) -> None:
        try:
            found[i] = fn(i).stdout
        except BaseException as exc:
            found[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return found


def test_unknown_host_key_is_refused_with_how_to_trust(target: SSHTarget, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    runner = SSHRunner("node-a", SSHTarget(**{**target.__dict__, "known_hosts": empty}))
    with pytest.raises(HostKeyRejected) as info:
        runner.run(["true"], timeout=10)
    message = str(info.value)
    assert "not in" in message and "ssh-keyscan" in message and "SHA256:" in message
    assert "trust_on_first_use" in message


def test_trust_on_first_use_records_the_key(
    target: SSHTarget, tmp_path: Path, sshd: SSHServer
) -> None:
    path = tmp_path / "tofu" / "known_hosts"
    tofu = SSHTarget(**{**target.__dict__, "known_hosts": path, "trust_on_first_use": True})
    with SSHRunner("node-a", tofu) as runner:
        runner.run(["true"], timeout=10)
    assert path.read_text() == sshd.known_hosts_line()
    # Recorded now: a strict client with that file connects.
    strict = SSHTarget(**{**target.__dict__, "known_hosts": path})
    with SSHRunner("node-a", strict) as runner:
        assert runner.run(["true"], timeout=10).ok


def test_changed_host_key_is_refused_even_with_tofu(
    target: SSHTarget, tmp_path: Path, sshd: SSHServer
) -> None:
    other = keygen(tmp_path / "other_host_key")
    kind, key = Path(f"{other}.pub").read_text().split()[:2]
    wrong = tmp_path / "known_hosts_wrong"
    wrong.write_text(f"[{sshd.host}]:{sshd.port} {kind} {key}\n")
    for tofu in (False, True):
        runner = SSHRunner(
            "node-a",
            SSHTarget(**{**target.__dict__, "known_hosts": wrong, "trust_on_first_use": tofu}),
        )
        with pytest.raises(HostKeyRejected, match="CHANGED") as info:
            runner.run(["true"], timeout=10)
        assert "ssh-keygen -R" in str(info.value)
    assert wrong.read_text().count("\n") == 1  # nothing was recorded


def test_wrong_client_key_gives_an_authentication_message(
    target: SSHTarget, tmp_path: Path
) -> None:
    stranger = keygen(tmp_path / "id_stranger")
    runner = SSHRunner("node-a", SSHTarget(**{**target.__dict__, "key_file": stranger}))
    with pytest.raises(AuthenticationFailed) as info:
        runner.run(["true"], timeout=10)
    assert "authentication as root failed" in str(info.value)
    assert "authorized_keys" in str(info.value)


def test_nothing_listening_is_unreachable_in_plain_words(target: SSHTarget) -> None:
    runner = SSHRunner("node-z", SSHTarget(**{**target.__dict__, "host": "127.0.0.99"}))
    with pytest.raises(NodeUnreachable) as info:
        runner.run(["true"], timeout=10)
    assert "cannot reach node node-z" in str(info.value)
    assert "connection refused" in str(info.value)


def test_errors_survive_pickling(ssh_runner: SSHRunner, target: SSHTarget, tmp_path: Path) -> None:
    with pytest.raises(CommandFailed) as failed:
        ssh_runner.run(["sh", "-c", "exit 4"], timeout=10)
    empty = tmp_path / "kh"
    empty.write_text("")
    with pytest.raises(HostKeyRejected) as rejected:
        SSHRunner("node-a", SSHTarget(**{**target.__dict__, "known_hosts": empty})).run(["true"])
    for error in (failed.value, rejected.value):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)


def test_a_key_passphrase_never_shows_in_a_targets_repr() -> None:
    target = SSHTarget(host="10.0.0.1", port=22, user="root", key_passphrase="s3cret-passphrase")
    assert "s3cret-passphrase" not in repr(target)
    assert target.key_passphrase == "s3cret-passphrase"


@pytest.mark.parametrize("client", ["openssh", "paramiko"])
def test_a_started_command_streams_both_ways_over_ssh(
    target: SSHTarget, client: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bulk streams go through this machine's `ssh` when it logs in with no prompt, else over
    paramiko (here: no `ssh` on PATH)."""
    if client == "paramiko":
        monkeypatch.setenv("PATH", str(tmp_path))
    ssh_runner = SSHRunner("node-a", target)
    proc = ssh_runner.start(["sh", "-c", "cat; echo done >&2; exit 3"], stall_s=5)
    writer = threading.Thread(target=lambda: (proc.write(b"y" * 3_000_000), proc.close_stdin()))
    writer.start()  # beyond SSH's window: it flows while it is read
    received = bytearray()
    while chunk := proc.read(65536):
        received += chunk
    assert (len(received), proc.wait(5), proc.stderr_text()) == (3_000_000, 3, "done\n")
    assert (ssh_runner._openssh() is not None) == (client == "openssh")
    ssh_runner.close()


# --- a command that timed out or was abandoned stops on the node -----------------------------
# sshd signals no command that runs without a pty: closing its channel left `sleep 300` running.
# On the bed's node, as its login `nvidia`, straight and through `sudo -n` (as root).
LOOP = "while :; do sleep 0.2; done"
GONE_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def login_bed() -> Iterator[TestBed]:
    bed = make_bed(1, "h200", first_ip=247)
    try:
        yield bed
    finally:
        bed.down()


@pytest.fixture
def login_runner(login_bed: TestBed) -> Iterator[SSHRunner]:
    node = login_bed.node("node-1")
    target = SSHTarget(
        host=node.ip,
        port=node.spec.ssh_port,
        user=users.LOGIN,
        key_file=login_bed.client_key,
        known_hosts=login_bed.known_hosts,
    )
    with SSHRunner("node-1", target) as runner:
        yield runner


def looping(how: str) -> tuple[list[str], str]:
    """A command that never ends by itself, and the word that finds its processes."""
    mark = f"vrd-loop-{uuid.uuid4().hex[:12]}"
    argv = ["sh", "-c", LOOP, mark]
    return ([*SUDO, *argv] if how == "sudo" else argv), mark


def seconds_until_gone(mark: str, limit: float = 10.0) -> float:
    started = time.monotonic()
    while pids_with_arg(mark) and time.monotonic() - started < limit:
        time.sleep(0.02)
    assert not pids_with_arg(mark), f"{mark} still runs on the node after {limit:g} s"
    return time.monotonic() - started


def wait_running(mark: str) -> None:
    wait_until(lambda: bool(pids_with_arg(mark)), 10, f"{mark} on the node")


@pytest.mark.parametrize("how", ["login", "sudo"])
def test_a_command_that_times_out_is_stopped_on_the_node(login_runner: SSHRunner, how: str) -> None:
    argv, mark = looping(how)
    login_runner.run(["true"], timeout=10)  # connected: the timeout is the command's alone
    started = time.monotonic()
    with pytest.raises(CommandTimedOut):
        login_runner.run(argv, timeout=1.0)
    after_timeout = time.monotonic() - started - 1.0 + seconds_until_gone(mark)
    keep_for_notes(f"ssh-timeout-stop-{how}", f"gone {after_timeout:.2f} s after the timeout\n")
    assert after_timeout < GONE_WITHIN_S
    assert login_runner.run(["echo", "still usable"], timeout=10).stdout == "still usable\n"


@pytest.mark.parametrize("how", ["login", "sudo"])
def test_closing_the_runner_mid_command_stops_it_on_the_node(
    login_runner: SSHRunner, how: str
) -> None:
    argv, mark = looping(how)
    ended: list[BaseException] = []

    def run() -> None:
        try:
            login_runner.run(argv, timeout=120)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_running(mark)
    time.sleep(0.3)  # its group's line has come back
    owners = {Path(f"/proc/{pid}").stat().st_uid for pid in pids_with_arg(mark)}
    assert (0 in owners) == (how == "sudo")  # through sudo, the login stops root's command
    closed = time.monotonic()
    login_runner.close()
    gone = time.monotonic() - closed + seconds_until_gone(mark)
    thread.join(10)
    keep_for_notes(f"ssh-close-stop-{how}", f"gone {gone:.2f} s after close()\n")
    assert gone < GONE_WITHIN_S
    assert not thread.is_alive() and len(ended) == 1  # the caller was told, not left waiting


def test_a_killed_stream_is_stopped_on_the_node(
    login_runner: SSHRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `ssh` here: a channel of the connection
    argv, mark = looping("login")
    proc = login_runner.start(argv, stall_s=5)
    wait_running(mark)
    time.sleep(0.3)
    proc.kill()
    assert seconds_until_gone(mark) < GONE_WITHIN_S


def test_a_group_number_that_went_to_another_process_is_left_alone(
    login_runner: SSHRunner,
) -> None:
    """Process IDs wrap around (at 32768 by default): the number of a command's group that
    ended may be a stranger's group by the time it is stopped. Its leader's start time tells
    them apart, so only the group that was ours is signalled."""
    _, mark = looping("login")
    script = f"setsid sh -c {shlex.quote(LOOP)} {mark} >/dev/null 2>&1 & echo $!"
    pid = int(login_runner.run(["sh", "-c", script], timeout=10).stdout)
    wait_running(mark)
    start = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    login_runner._stop_groups([f"{pid}:{int(start) + 1}"])  # a group of that number, not it
    assert pids_with_arg(mark), "a group that was not ours was stopped"
    login_runner._stop_groups([f"{pid}:{start}"])
    assert seconds_until_gone(mark) < GONE_WITHIN_S
