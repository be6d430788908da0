"""Whether an mp follower has joined the leader's rendezvous, seen from the follower's side.

A follower keeps its connection to the rendezvous store (the leader's master port) while it runs.
Which connection is the follower's cannot be told from the leader's side: the peer's address is
whatever source address the follower's kernel picked, the loopback's on one machine and any of a
host's addresses where several routes lead to the leader. So the question is asked inside the
follower's container: does a process of this container hold an established TCP connection to
the master port? The container shares the host's network (its /proc/net/tcp lists every socket
of the host) but has its own PIDs (its /proc lists only its own processes), so a socket counts
only when one of the container's processes holds it. The check is a few lines of Python's
standard library, which every vLLM image has, given the port as argv.
"""

from __future__ import annotations

from vllm_redeploy.nodes.errors import RemoteError
from vllm_redeploy.nodes.runner import Runner

# Exit 0: joined; 1: not (yet); anything else: could not tell.
JOINED_CHECK = """
import os, sys
port = int(sys.argv[1])
held = set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            held.add(target[8:-1])
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        rows = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for row in rows:
        f = row.split()
        if f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port and f[9] in held:
            sys.exit(0)
sys.exit(1)
"""


def follower_joined(follower: Runner, master_port: int) -> bool | None:
    """True when ``follower`` (a runner inside the follower's container) holds a connection to
    the master port; False when it does not; None when that could not be told."""
    try:
        result = follower.run(
            ["python3", "-c", JOINED_CHECK, str(master_port)], check=False, timeout=10
        )
    except RemoteError:  # the container went away: wait-ready's own watch names that
        return None
    if result.exit_code in (0, 1):
        return result.exit_code == 0
    return None
