"""The fabric reach check's own script, run as the nodes' containers run it (one process per
node, each on its own loopback address), and judged: all open, and a real stateful packet filter
that drops new connections to one node's ephemeral ports, as a host firewall that opens only the
named ports does. The flow's step is exercised on the bed in test_faults.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testbed.bed import bed_ip
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.fabric_reach import (
    REACH_SCRIPT,
    NodeReach,
    blocked_message,
    judge,
    reach_spec,
)
from vllm_redeploy.launch import container_argv

NODES = {"node-1": bed_ip(251), "node-2": bed_ip(252), "node-3": bed_ip(253)}
PORT = 45_871
WINDOW_S = 2.0


EXAMPLE = Path(__file__).resolve().parents[1] / "cluster.example.toml"


def config() -> ClusterConfig:
    """The example's settings on three loopback nodes (never its real private addresses)."""
    example = load_config(EXAMPLE, env_file=None)
    nodes = [
        example.nodes[0].model_copy(update={"name": name, "address": ip, "fabric_ip": ip})
        for name, ip in NODES.items()
    ]
    return example.model_copy(update={"nodes": nodes})


def check_all(port: int = PORT) -> list[NodeReach]:
    """Every node's check at once, as the step runs them; their reports."""
    procs = {}
    for name, ip in NODES.items():
        peers = json.dumps({n: a for n, a in NODES.items() if n != name})
        argv = [sys.executable, "-c", REACH_SCRIPT, name, ip, str(port), f"{WINDOW_S}", peers]
        procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    reports = []
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=WINDOW_S * 3 + 10)
        reports.append(NodeReach.parse(name, proc.returncode, out))
    return reports


@pytest.fixture
def firewall() -> Iterator[list[str]]:
    """Drop new TCP connections to node-2's fabric IP on the ephemeral range, statefully (the
    answers to node-2's own connections still come back), until the test ends."""
    rule = ["OUTPUT", "-p", "tcp", "-d", NODES["node-2"], "--dport", "32768:60999",
            "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"]  # fmt: skip
    subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    try:
        yield rule
    finally:
        subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)


def test_the_containers_run_the_script_with_each_node_s_own_view() -> None:
    spec = reach_spec(config(), "node-2", PORT)
    argv = container_argv(spec)
    assert argv[:3] == ["python3", "-c", REACH_SCRIPT]
    assert argv[3:7] == ["node-2", NODES["node-2"], str(PORT), "10"]
    assert json.loads(argv[7]) == {"node-1": NODES["node-1"], "node-3": NODES["node-3"]}
    assert spec.gpus is None and spec.shm_size is None  # a question, not a workload


def test_nodes_that_reach_each_other_pass() -> None:
    reports = check_all()
    assert [r.listen for r in reports] == ["ok"] * 3, reports
    assert all(set(r.reached.values()) == {"ok"} for r in reports), reports
    verdict = judge(config(), reports, PORT)
    assert verdict.blocked == [] and verdict.unchecked == []


def test_a_firewall_that_drops_new_connections_is_named_per_pair(firewall: list[str]) -> None:
    reports = check_all()
    verdict = judge(config(), reports, PORT)
    into = f"at {NODES['node-2']}:{PORT} (no answer within 10 s: a firewall drops the packets)"
    assert verdict.blocked == [
        f"node-1 cannot reach node-2 {into}",
        f"node-3 cannot reach node-2 {into}",
    ], reports
    # node-2's own connections go out and their answers come back: a stateful firewall.
    assert dict(next(r for r in reports if r.node == "node-2").reached) == {
        "node-1": "ok",
        "node-3": "ok",
    }
    message = blocked_message(config(), verdict, reports, "the API port 8000")
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    assert "Besides the named ports (the API port 8000), vLLM's ranks" in message
    assert f"ports the kernel picks (ZMQ queues, NCCL, Gloo, Ray's workers), here {low}-{high}" in (
        message
    )
    assert f"Allow all TCP between the nodes' fabric IPs ({', '.join(NODES.values())})" in message


def test_a_node_whose_listener_could_not_listen_is_unchecked_not_blocked() -> None:
    with socket.socket() as taken:
        taken.bind((NODES["node-3"], PORT + 1))
        taken.listen()  # node-3's port is in use: the others' connects reach this, not a check
        reports = check_all(PORT + 1)
    verdict = judge(config(), reports, PORT + 1)
    assert verdict.blocked == [], verdict
    assert verdict.unchecked == [
        f"node-3 could not listen on port {PORT + 1}: Address already in use "
        f"({NODES['node-3']}:{PORT + 1})"
    ]
