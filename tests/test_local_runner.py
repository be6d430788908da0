"""The local transport: subprocesses on this machine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from vllm_redeploy.nodes import CommandFailed, CommandTimedOut, LocalRunner


@pytest.fixture
def local() -> LocalRunner:
    return LocalRunner("controller")


def test_success_and_separate_streams(local: LocalRunner) -> None:
    result = local.run(["sh", "-c", "echo out; echo err >&2"], timeout=10)
    assert (result.exit_code, result.stdout, result.stderr, result.node) == (
        0,
        "out\n",
        "err\n",
        "controller",
    )


def test_failure_names_node_command_and_stderr(local: LocalRunner) -> None:
    with pytest.raises(CommandFailed) as info:
        local.run(["sh", "-c", "echo disk-full >&2; exit 2"], timeout=10)
    assert "exit code 2 on controller" in str(info.value) and "disk-full" in str(info.value)


def test_missing_program_is_exit_127_like_a_shell(local: LocalRunner) -> None:
    result = local.run(["no-such-program-xyz"], timeout=10, check=False)
    assert result.exit_code == 127 and "command not found" in result.stderr


def test_timeout_kills_the_process_group(local: LocalRunner, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(CommandTimedOut):
        local.run(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout=0.5)
    assert time.monotonic() - started < 5
    child = int(pidfile.read_text())
    time.sleep(0.2)
    assert (
        not Path(f"/proc/{child}").exists()
        or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    )


def test_lines_stream_in_order_as_they_come(local: LocalRunner) -> None:
    seen: list[tuple[float, str]] = []
    local.run(
        ["sh", "-c", "echo one; sleep 1; printf 'two\\nthree'"],
        timeout=10,
        on_line=lambda line, _stream: seen.append((time.monotonic(), line)),
    )
    assert [line for _, line in seen] == ["one", "two", "three"]
    assert seen[1][0] - seen[0][0] > 0.8


def test_env_is_added_and_stdin_is_fed(local: LocalRunner) -> None:
    result = local.run(
        ["sh", "-c", 'printf "$X-"; cat'], timeout=10, env={"X": "y"}, stdin=b"input"
    )
    assert result.stdout == "y-input"


def test_argv_is_never_given_to_a_shell(local: LocalRunner, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    result = local.run(["echo", f"$(touch {marker})", f"; touch {marker}"], timeout=10)
    assert result.stdout == f"$(touch {marker}) ; touch {marker}\n"
    assert not marker.exists()


def test_tail_gives_the_last_lines(local: LocalRunner) -> None:
    result = local.run(["sh", "-c", "for i in 1 2 3 4 5; do echo $i; done"], timeout=10)
    assert result.tail("stdout", 2) == "4\n5"


# Several commands in one round trip: what each printed and its exit code, each argv quoted.
BATCH = [
    ["echo", "a b; $HOME"],  # quoted, never read by a shell as code
    ["sh", "-c", "printf 'x\\ny'; echo oops >&2; exit 3"],
    ["test", "-d", "/no/such/dir"],
    ["printf", "%s\\n", "@@vrd-000000000000 rc 0 0"],  # output that looks like a marker
    ["no-such-program-vrd"],
]


def check_batch(results: list) -> None:  # type: ignore[type-arg]
    assert [(r.exit_code, r.stdout) for r in results] == [
        (0, "a b; $HOME\n"),
        (3, "x\ny"),  # stderr dropped on the way
        (1, ""),
        (0, "@@vrd-000000000000 rc 0 0\n"),
        (127, ""),
    ]
    assert [r.argv for r in results] == [tuple(argv) for argv in BATCH]


def test_run_all_answers_each_command_in_one_round_trip(local: LocalRunner) -> None:
    check_batch(local.run_all(BATCH, timeout=10))


def test_checked_runs_a_failed_command_again_for_its_words(local: LocalRunner) -> None:
    ok, failed = local.run_all([["true"], ["sh", "-c", "echo why-it-failed >&2; exit 4"]])
    assert local.checked(ok) is ok
    with pytest.raises(CommandFailed) as caught:
        local.checked(failed)
    assert caught.value.result.exit_code == 4 and "why-it-failed" in str(caught.value)


def test_a_started_command_streams_both_ways(local: LocalRunner) -> None:
    proc = local.start(["sh", "-c", "cat; echo done >&2"], stall_s=5)
    writer = threading.Thread(target=lambda: (proc.write(b"x" * 300_000), proc.close_stdin()))
    writer.start()  # more than a pipe holds: it flows while it is read
    received = bytearray()
    while chunk := proc.read(65536):
        received += chunk
    assert (len(received), proc.wait(5), proc.stderr_text()) == (300_000, 0, "done\n")


def test_a_started_command_that_stalls_raises(local: LocalRunner) -> None:
    proc = local.start(["sleep", "30"], stall_s=0.3)
    with pytest.raises(TimeoutError):
        proc.read(10)
    proc.kill()
    assert proc.wait(5) is not None


def test_two_started_commands_are_joined_inside_the_kernel(local: LocalRunner) -> None:
    sender = local.start(["head", "-c", "3000000", "/dev/zero"], stall_s=5)
    receiver = local.start(["wc", "-c"], stall_s=5)
    moved = 0
    while count := sender.move_into(receiver, 1 << 20):
        moved += count
    receiver.close_stdin()
    assert (moved, sender.wait(5), receiver.read(100).strip(), receiver.wait(5)) == (
        3_000_000,
        0,
        b"3000000",
        0,
    )
