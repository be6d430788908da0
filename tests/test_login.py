"""A login that is not root, as on a DGX Spark (NVIDIA's playbook logs in as ``nvidia``): systemd
refuses it the old stack's units, and the run finds out before it stops anything.

The bed's node-1 lets its login do anything with `sudo -n`; node-2 here allows nothing (in the
sudo group, with no password to give), until the line the failure names is installed there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.redeploy import redeploy_vllm_cluster
from tasks.diagnostics import _kernel_oom
from tests.conftest import keep_for_notes, make_bed
from tests.testbed import image, users
from tests.testbed.bed import TestBed
from vllm_redeploy.config import load_config
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.nodes.privilege import RootAccess, sudoers_line

pytestmark = pytest.mark.integration
UNIT = image.OLD_STACK_UNIT


@pytest.fixture(scope="module")
def bed(prefect_api: None) -> Iterator[TestBed]:
    testbed = make_bed(2, "h200", first_ip=251, sudo={"node-2": "none"})
    yield testbed
    testbed.down()


def run_flow(bed: TestBed, **changes: Any) -> Any:
    path = bed.write_config(
        bed.root / "run.toml", vllm={"env": {"VRD_LOAD_SECONDS": "1"}}, **changes
    )
    return redeploy_vllm_cluster(str(path), "redeploy", return_state=True)


def test_systemd_refuses_the_login_the_old_stacks_unit(bed: TestBed) -> None:
    config = load_config(bed.config_path, env_file=None)
    with NodeAccess(config.nodes[1], config) as node:
        assert node.runner.run(["id", "-un"]).stdout == f"{users.LOGIN}\n"
        assert node.root() == RootAccess(
            users.LOGIN, False, {"systemctl": str(bed.nodes[1].bin_dir / "systemctl")}
        )
        stop = node.runner.run(["systemctl", "stop", UNIT], check=False)
        assert (stop.exit_code, stop.stderr.splitlines()[0]) == (
            1,
            f"Failed to stop {UNIT}: Interactive authentication required.",
        )
        assert node.runner.run(["systemctl", "is-active", UNIT], check=False).stdout == "active\n"
        refused = node.runner.run(["sudo", "-n", "true"], check=False)
        assert (refused.exit_code, refused.stderr) == (1, "sudo: a password is required\n")


def test_preflight_names_the_command_and_the_sudoers_line_before_anything_stops(
    bed: TestBed,
) -> None:
    before = bed.running()
    assert all("glm-server" in names for names in before.values())
    state = run_flow(bed, autostart={"disable_units": True})
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    keep_for_notes("login-refused", message)
    systemctl = bed.nodes[1].bin_dir / "systemctl"
    assert "preflight" in message and "node-1:" not in message
    assert (
        f"node-2: stopping the [autostart] units needs root, the login nvidia is not root, and "
        f"`sudo -n` refuses `{systemctl} stop {UNIT}`, `{systemctl} disable --no-reload {UNIT}` "
        "(sudo: a password is required)"
    ) in message
    assert bed.running() == before  # node-1 could have: nothing was stopped there either

    # The line it names, installed as the message says, is what the run then needs.
    line = re.search(r"with the line `([^`]+)`", message)
    assert line is not None
    assert line.group(1) == (
        f"nvidia ALL=(root) NOPASSWD: {systemctl} stop {UNIT}, "
        f"{systemctl} disable --no-reload {UNIT}"
    )
    node = bed.nodes[1]
    node.write_file("/etc/sudoers.d/vllm-redeploy", line.group(1) + "\n", mode=0o440)
    state = run_flow(bed, autostart={"disable_units": True})
    assert state.is_completed(), state.result(raise_on_failure=False)
    for emulated in bed.nodes:
        assert emulated.systemctl("is-active", UNIT).stdout == "inactive\n"
        assert emulated.systemctl("is-enabled", UNIT).stdout == "disabled\n"

    # A unit added to [autostart] later, outside the line: the sudo group's entry permits it
    # with a password, so `sudo -n -l` lists it (exit 0), while `sudo -n` would refuse it in
    # stop-autostart. Refused in preflight instead, nothing stopped.
    other = "other-stack.service"
    config = load_config(bed.config_path, env_file=None)
    with NodeAccess(config.nodes[1], config) as login:
        listed = login.runner.run(["sudo", "-n", "-l", str(systemctl), "stop", other], check=False)
    assert listed.exit_code == 0, listed
    before = bed.running()
    state = run_flow(bed, autostart={"units": [UNIT, other]})
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed() and "preflight" in message, message
    assert (
        f"`sudo -n` refuses `{systemctl} stop {other}` (sudoers allows it only with a password "
        "(no NOPASSWD))"
    ) in message
    assert bed.running() == before


@pytest.mark.parametrize(
    ("unit", "allowed"),
    [
        ("vllm.service", "/usr/bin/systemctl stop vllm.service"),
        (r"vllm\x2dold.service", r"/usr/bin/systemctl stop vllm\\x2dold.service"),
        ("a,b:c=d.service", r"/usr/bin/systemctl stop a\,b\:c\=d.service"),
    ],
)
def test_the_sudoers_line_allows_exactly_the_command(unit: str, allowed: str) -> None:
    root = RootAccess("nvidia", False, {"systemctl": "/usr/bin/systemctl"})
    assert root.argv(["systemctl", "stop", unit]) == [
        "sudo",
        "-n",
        "/usr/bin/systemctl",
        "stop",
        unit,
    ]
    assert RootAccess("root", True, {}).argv(["systemctl", "stop", unit]) == [
        "systemctl",
        "stop",
        unit,
    ]
    assert (
        sudoers_line(root, [["systemctl", "stop", unit]])
        == f"nvidia ALL=(root) NOPASSWD: {allowed}"
    )


def test_the_kernel_log_is_read_through_sudo_where_it_is_allowed(bed: TestBed) -> None:
    """dmesg is root's on Ubuntu (kernel.dmesg_restrict = 1, as here): the diagnostics read it
    with `sudo -n` where the login may, and say why not where it may not."""
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() != "1":
        pytest.skip("this machine's kernel log is open to every user (kernel.dmesg_restrict)")
    config = load_config(bed.config_path, env_file=None)
    with NodeAccess(config.nodes[0], config) as one, NodeAccess(config.nodes[1], config) as two:
        plain = one.runner.run(["dmesg"], check=False)
        assert (plain.exit_code, plain.stderr) == (
            1,
            "dmesg: read kernel buffer failed: Operation not permitted\n",
        )
        assert "could not be read" not in _kernel_oom(one)
        assert _kernel_oom(two) == (
            "### kernel OOM lines\n(the kernel log could not be read: sudo: a password is required)"
        )


def test_a_login_outside_the_docker_group_is_told_in_dockers_words_and_how_to_fix_it(
    bed: TestBed,
) -> None:
    """NVIDIA's playbooks add the login to `docker` as a step of their own: a node where that
    step was missed answers `docker system dial-stdio` with "permission denied", which the SDK
    only sees as a closed connection. Refused in preflight, in Docker's words, with the fix."""
    node = bed.nodes[1]
    group = node.run(["cat", "/etc/group"]).stdout
    without = re.sub(
        r"^(docker:[^:]*:[^:]*:)(.*)$",
        lambda m: m.group(1) + ",".join(u for u in m.group(2).split(",") if u != users.LOGIN),
        group,
        flags=re.MULTILINE,
    )
    assert without != group
    before = bed.running()
    node.write_file("/etc/group", without)
    try:
        state = run_flow(bed)
    finally:
        node.write_file("/etc/group", group)
    message = str(state.result(raise_on_failure=False))
    assert state.is_failed(), message
    docker_said = f"dial unix {node.engine.socket}: connect: permission denied"  # dial-stdio's
    assert message.startswith("Docker on node-2: version failed: ") and docker_said in message
    assert f"`sudo usermod -aG docker {users.LOGIN}`" in message
    assert bed.running() == before
