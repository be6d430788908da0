"""The SSH transport against a real OpenSSH server on loopback."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import NODE_IP
from tests.test_local_runner import BATCH, check_batch
from tests.testbed.dockerd import DockerEngine
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
