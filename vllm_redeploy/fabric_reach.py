"""Whether every node reaches every other over the fabric, on a port the kernel would hand out.

vLLM's ranks meet on named ports (the mp master port, Ray's GCS port), then talk on ports the
kernel picks: the mp leader's ZMQ queues, each follower's, NCCL's and Gloo's sockets, Ray's
workers. A firewall that opens only the named ports lets the rendezvous through, and the start
then hangs with nothing in any log. So before anything starts, one short-lived check per node
listens on its node's fabric IP on one port of the ephemeral range, and connects from that IP to
the same port on every other node's fabric IP. It runs on the node itself when the node has a
``python3`` (one SSH round trip), else in a one-shot container of the configured image (a second
to start) on the host's network: the same network either way. Each says, as one JSON line,
whether it listened and, per peer, how its connect ended:

- ``ok``: the peer accepted;
- ``timeout``: no answer at all until the window closed: a firewall drops the packets;
- ``refused`` / ``unreachable``: rejected (a firewall's reject, or nothing listening);
- another OS error's words.

The checks leave as soon as they have reached every peer and heard from every peer. A peer
that cannot be reached is tried until the window closes (so a peer whose container starts up to
a window later is still reached); one that has not heard from every peer listens two seconds
longer. Listening any longer would not help: the late peer could not be reached either.
Standard library only: every vLLM image has a ``python3``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.names import container_name
from vllm_redeploy.nodes.containers import ContainerSpec, project_labels

ROLE = "fabric-reach"
WINDOW_S = 10.0  # the containers start within a second or two of each other on a healthy cluster
TIMEOUT_S = WINDOW_S + 30  # the container's own limit, with room for Docker
EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range

REACH_SCRIPT = r"""
import json, socket, sys, threading, time
me, ip, port, window = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
peers = json.loads(sys.argv[5])
deadline = time.monotonic() + window  # for reaching the peers
linger = deadline + 2  # for being reached: a peer that started later may still be trying
report = {"node": me, "listen": "ok", "reached": {}, "ephemeral": ""}
try:
    report["ephemeral"] = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
except OSError:
    pass
heard, lock = set(), threading.Lock()
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    server.bind((ip, port))
    server.listen(64)
    server.settimeout(0.2)
except OSError as error:
    report["listen"] = f"{error.strerror} ({ip}:{port})"
    server = None

def serve():
    while server is not None and time.monotonic() < linger:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        conn.settimeout(2)
        try:
            name = conn.makefile("r").readline().strip()
            conn.sendall(b"ok\n")
        except OSError:
            name = ""
        finally:
            conn.close()
        with lock:
            heard.add(name)

def reach(name, address):
    outcome = "timeout"
    while (left := deadline - time.monotonic()) > 0:
        sock = socket.socket()
        sock.settimeout(min(left, 2.0))
        try:
            sock.bind((ip, 0))
            sock.connect((address, port))
            sock.sendall(me.encode() + b"\n")
            if sock.makefile("r").readline().strip() == "ok":
                outcome = "ok"
                break
            outcome = "no answer from the listener"
        except socket.timeout:
            outcome = "timeout"
        except ConnectionRefusedError:
            outcome = "refused"
        except OSError as error:
            outcome = "unreachable" if error.errno in (101, 113) else str(error.strerror)
        finally:
            sock.close()
        time.sleep(0.2)
    with lock:
        report["reached"][name] = outcome

listener = threading.Thread(target=serve, daemon=True)
listener.start()
reachers = [threading.Thread(target=reach, args=item) for item in peers.items()]
for thread in reachers:
    thread.start()
for thread in reachers:
    thread.join()
while time.monotonic() < linger and server is not None:
    with lock:
        if heard >= set(peers):
            break
    time.sleep(0.1)
print(json.dumps(report), flush=True)
"""


def pick_port() -> int:
    """One port of the ephemeral range for every node: the kind of port vLLM's ranks use."""
    return random.randint(*EPHEMERAL)  # noqa: S311 - a port number, not a secret


def reach_argv(config: ClusterConfig, node: str, port: int, python: str = "python3") -> list[str]:
    """``node``'s check: listen on its fabric IP, reach every other node's."""
    ips = {n.name: n.ip for n in config.nodes}
    peers = json.dumps({name: ip for name, ip in ips.items() if name != node})
    return [python, "-c", REACH_SCRIPT, node, ips[node], str(port), f"{WINDOW_S:g}", peers]


def reach_spec(config: ClusterConfig, node: str, port: int) -> ContainerSpec:
    """The same check in a one-shot container of the image, for a node without ``python3``."""
    program, *args = reach_argv(config, node, port)
    return ContainerSpec(
        name=container_name(config.name, ROLE),
        image=config.vllm.image,
        entrypoint=[program],  # whatever the image's ENTRYPOINT: our program, not vLLM
        command=args,
        # The configured mounts, as every container of the image gets them: the runtime of an
        # image may come from one (the test bed's images take Python from the host's /usr).
        volumes=list(config.vllm.volumes),
        labels=project_labels(config.name, ROLE),
    )


@dataclass(frozen=True)
class NodeReach:
    """What one node's container said (``error`` when it said nothing we could read)."""

    node: str
    listen: str = ""  # "ok", or why it could not listen
    reached: Mapping[str, str] = field(default_factory=dict)
    ephemeral: tuple[int, int] = EPHEMERAL
    error: str = ""

    @classmethod
    def parse(cls, node: str, code: int | None, output: str) -> NodeReach:
        for line in reversed(output.strip().splitlines()):
            try:
                found = json.loads(line)
                low, high = (int(p) for p in found.get("ephemeral") or EPHEMERAL)
                return cls(node, str(found["listen"]), dict(found["reached"]), (low, high))
            except (ValueError, KeyError, TypeError):
                continue
        if code is None:
            return cls(node, error=f"the check did not end within {TIMEOUT_S:g} s")
        last = output.strip().splitlines()[-1:] or ["no output"]
        return cls(node, error=f"the check exited with code {code}: {last[0][:200]}")


@dataclass(frozen=True)
class Verdict:
    blocked: list[str]  # "node-1 cannot reach node-2 at IP: why": the run must stop
    unchecked: list[str]  # pairs the check could not judge: said, not fatal


WHY = {
    "timeout": "no answer within {window:g} s: a firewall drops the packets",
    "refused": "the connection was refused although the peer listened: a firewall rejects it",
    "unreachable": "no route to host: a firewall rejects it (firewalld's default), or no route",
}


def judge(config: ClusterConfig, reports: list[NodeReach], port: int) -> Verdict:
    """Every pair that failed, with why; pairs whose listener never listened are unchecked."""
    ips = {n.name: n.ip for n in config.nodes}
    by_node = {r.node: r for r in reports}
    blocked, unchecked = [], []
    for r in reports:
        if r.error:
            unchecked.append(f"{r.node}: {r.error}")
            continue
        if r.listen != "ok":
            unchecked.append(f"{r.node} could not listen on port {port}: {r.listen}")
        for peer, outcome in sorted(r.reached.items()):
            if outcome == "ok":
                continue
            other = by_node.get(peer)
            if other is None or other.error or other.listen != "ok":
                continue  # nothing listened there: the pair is not judged
            why = WHY.get(outcome, outcome).format(window=WINDOW_S)
            blocked.append(f"{r.node} cannot reach {peer} at {ips[peer]}:{port} ({why})")
    return Verdict(blocked, unchecked)


def blocked_message(
    config: ClusterConfig, verdict: Verdict, reports: list[NodeReach], named: str
) -> str:
    """One paragraph: the pairs, the ports vLLM needs (``named``: the launch's own, in words),
    what to do."""
    low = min(r.ephemeral[0] for r in reports)
    high = max(r.ephemeral[1] for r in reports)
    ips = ", ".join(n.ip for n in config.nodes)
    return (
        "; ".join(verdict.blocked)
        + f". Besides the named ports ({named}), vLLM's ranks connect to each other on ports the "
        f"kernel picks (ZMQ queues, NCCL, Gloo, Ray's workers), here {low}-{high}: a firewall "
        "that opens only the named ports lets the rendezvous through, then the start hangs. "
        f"Allow all TCP between the nodes' fabric IPs ({ips}), e.g. `sudo ufw allow from "
        "<peer fabric IP>` or `sudo firewall-cmd --zone=trusted --add-source=<peer fabric IP>` "
        "on each node, then run again"
    )
