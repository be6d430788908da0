"""Who holds a port (`ss -Hltnp` and /proc/PID/cgroup, both read for real on this machine) and
whether stop-autostart takes it away."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from vllm_redeploy.listeners import (
    Listener,
    Others,
    Owner,
    Stopping,
    cgroups_argv,
    collisions,
    kept_listeners,
    owners,
    parse_cgroups,
    parse_ss,
    ss_argv,
)

CONTAINER = "2ae5754c4b26f22074c198dd8806a9d37ebde2fd9932e80525da047139bb514c"
# /proc/PID/cgroup as cgroup(7) gives it: v1 has a line per hierarchy, v2 one `0::` line.
CGROUPFS_V1 = "".join(
    f"{n}:{c}:/docker/{CONTAINER}\n" for n, c in ((9, "name=systemd"), (4, "memory"), (1, "cpu"))
)
SYSTEMD_V2 = f"0::/system.slice/docker-{CONTAINER}.scope\n"
UNIT_V2 = "0::/system.slice/glm-server.service\n"
SESSION_V2 = "0::/user.slice/user-1000.slice/session-3.scope\n"


def test_this_process_listening_is_read_from_the_real_ss_and_its_cgroup() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        listed = subprocess.run(ss_argv([port]), capture_output=True, text=True, check=True)
        found = collisions(parse_ss(listed.stdout), {port: "0.0.0.0"})
    [listener] = found[port]
    assert (listener.address, listener.port) == ("127.0.0.1", port)
    assert (os.getpid()) in [pid for _, pid in listener.processes]
    read = subprocess.run(cgroups_argv([os.getpid()]), capture_output=True, text=True, check=True)
    paths = parse_cgroups(read.stdout)[os.getpid()]
    with open("/proc/self/cgroup") as own:
        assert paths == [line.split(":", 2)[2] for line in own.read().splitlines()]
    assert Owner.of(paths).container_id is None  # the test runs outside every container


@pytest.mark.parametrize(
    ("line", "address"),
    [
        ('LISTEN 0 4096 127.0.0.1:30000 0.0.0.0:* users:(("httpd",pid=7,fd=3))', "127.0.0.1"),
        ('LISTEN 0 4096 [::]:30000 [::]:* users:(("vllm",pid=7,fd=3))', "::"),
        ("LISTEN 0 4096 *:30000 *:*", "*"),
        ("LISTEN 0 4096 [fe80::1%eth0]:30000 [::]:*", "fe80::1"),
    ],
)
def test_a_bind_to_every_address_collides_with_any_listener_of_the_port(
    line: str, address: str
) -> None:
    [listener] = parse_ss(line)
    assert listener.address == address
    assert listener.collides("0.0.0.0")
    assert listener.collides("10.0.0.1") == (address in ("::", "*"))


def test_owner_from_either_cgroup_driver_and_from_a_unit() -> None:
    v1 = parse_cgroups(f"== 7\n{CGROUPFS_V1}== 8\n{SYSTEMD_V2}== 9\n{UNIT_V2}== 10\n")
    assert Owner.of(v1[7]) == Owner(container_id=CONTAINER)
    assert Owner.of(v1[8]) == Owner(container_id=CONTAINER)
    assert Owner.of(v1[9]) == Owner(unit="glm-server.service")
    assert 10 not in v1  # gone before its cgroup was read: no owner, so not in the way


def test_a_process_that_ended_or_is_ending_has_no_cgroup_to_read() -> None:
    """An engine exiting between ss and the cgroup read (a zombie shows cgroup v1's root paths,
    which read as neither a container nor a unit) or gone by then: no owner, no refusal."""
    zombie = subprocess.Popen(["true"])  # not waited for: a zombie once it exits
    gone = subprocess.Popen(["true"])
    gone.wait()
    deadline = time.monotonic() + 10
    while not _state(zombie.pid).startswith("Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        pids = [os.getpid(), zombie.pid, gone.pid]
        read = subprocess.run(cgroups_argv(pids), capture_output=True, text=True, check=True)
        assert set(parse_cgroups(read.stdout)) == {os.getpid()}
    finally:
        zombie.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/status") as status:
        return next(line for line in status if line.startswith("State:")).split()[1]


def _kept(owner: Owner, stopping: Stopping, process: str = "httpd") -> list[str]:
    listener = Listener("127.0.0.1", 30000, ((process, 7),))
    others = Others({CONTAINER: "stranger"}, {30000: ["stranger"]})
    kept = kept_listeners({30000: [listener]}, {7: owner}, stopping, others)
    return [k.words("API port") for k in kept]


def test_what_the_stop_takes_away_is_not_refused() -> None:
    none = Stopping({}, frozenset())
    unit = Stopping({}, frozenset({"glm-server.service"}))
    named = Stopping({CONTAINER: "glm-server"}, frozenset())
    assert _kept(Owner(unit="glm-server.service"), unit) == []
    assert _kept(Owner(container_id=CONTAINER), named) == []
    # A unit's `docker run` stops the container it started, whatever its name.
    assert _kept(Owner(container_id=CONTAINER), unit) == []
    assert _kept(Owner(), unit, process="docker-proxy") == []
    assert _kept(Owner(container_id=CONTAINER), none) == [
        "127.0.0.1:30000 (the API port) is held by httpd (PID 7) in container stranger, which "
        "[autostart] containers does not name"
    ]
    assert _kept(Owner(), none, process="docker-proxy") == [
        "127.0.0.1:30000 (the API port) is held by docker-proxy (PID 7), the published port of "
        "stranger, which [autostart] does not name"
    ]


def test_a_process_outside_the_stop_is_refused_naming_where_it_runs() -> None:
    unit = Stopping({}, frozenset({"glm-server.service"}))
    session = Owner.of(parse_cgroups(f"== 7\n{SESSION_V2}")[7])
    assert _kept(session, unit) == [
        "127.0.0.1:30000 (the API port) is held by httpd (PID 7) in session-3.scope, which is "
        "neither a container nor a unit that [autostart] names"
    ]
    assert _kept(Owner(unit="ollama.service"), unit)  # another unit: not stopped
    # Hidden by ss (another user's process, no sudo): judged by ports-free after the stop.
    hidden = Listener("127.0.0.1", 30000, ())
    assert kept_listeners({30000: [hidden]}, {}, unit, Others({}, {})) == []


def test_a_process_on_ipv4_and_ipv6_is_named_once() -> None:
    both = parse_ss(
        'LISTEN 0 4096 0.0.0.0:30000 0.0.0.0:* users:(("python3",pid=7,fd=3))\n'
        'LISTEN 0 4096 [::]:30000 [::]:* users:(("python3",pid=7,fd=4))\n'
    )
    assert owners(both) == ", python3 (PID 7)"
    assert owners(parse_ss("LISTEN 0 4096 *:30000 *:*")) == ""
