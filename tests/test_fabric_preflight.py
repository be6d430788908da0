"""Preflight's fabric checks on the real test bed (issue 33, items 3 and 4): a node whose fabric
interface lost its MTU 9000, and configured interface and HCA names the node lacks, fail the flow
at preflight, naming what the nodes have, while the old stack still runs on every node.

One bed of two DGX-Spark-like nodes (tests/testbed/fabric.py: twins at MTU 9000, both HCAs
ACTIVE), real sshd and dockerd per node, the old autostart stack running.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes, make_bed
from tests.testbed.bed import TestBed
from tests.testbed.fabric import NodeFabric

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def bed(prefect_api: str) -> Iterator[TestBed]:
    testbed = make_bed(2, "gb10", first_ip=151, rdma={"node-1": "both", "node-2": "both"})
    yield testbed
    testbed.down()


def fabric_of(bed: TestBed, node: str) -> NodeFabric:
    found = bed.node(node).fabric
    assert found is not None
    return found


def failed_preflight(bed: TestBed, name: str, **changes: Any) -> str:
    """Run the flow; it must fail at preflight with every node's old stack still running."""
    before = bed.running()
    assert all({"glm-server", "glm-proxy"} <= names for names in before.values()), before
    path = bed.write_config(bed.root / f"{name}.toml", **changes)
    state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    keep_for_notes(name, message)
    assert message.startswith("preflight: "), message
    assert bed.running() == before  # nothing was stopped, on any node
    return message


def test_a_node_that_lost_its_mtu_9000_fails_preflight_naming_both_values(bed: TestBed) -> None:
    head, worker = fabric_of(bed, "node-1"), fabric_of(bed, "node-2")
    worker.set_mtu(1500)
    try:
        message = failed_preflight(bed, "preflight-mtu")
    finally:
        worker.set_mtu(9000)
    assert (
        f"node-2's {worker.interface} has MTU 1500, node-1's {head.interface} has 9000: RoCE "
        "does not negotiate the MTU, so NCCL between the nodes would hang (NVIDIA/nccl#2135); "
        "set the same MTU on every node's fabric interfaces (e.g. "
        f"`sudo ip link set {worker.interface} mtu 9000` on node-2, and in netplan so it "
        "survives a reboot)"
    ) in message
    assert message.count("has MTU") == 1  # only the worker's interface is named to fix


def test_configured_names_the_nodes_lack_fail_preflight_with_what_they_have(
    bed: TestBed,
) -> None:
    head, worker = fabric_of(bed, "node-1"), fabric_of(bed, "node-2")
    wrong_port = f"enp{head.bus}s0f0np0"  # the Spark's other port: the bed cabled f1 only
    wrong_hca = f"rocep{worker.bus}s0f0"
    message = failed_preflight(
        bed,
        "preflight-names",
        nodes={"node-1": {"fabric_interfaces": [wrong_port]}, "node-2": {"ib_hcas": [wrong_hca]}},
    )
    assert (
        f"node-1: fabric_interfaces names {wrong_port}, which this node does not have; the "
        f"fabric IP {head.ip} is on {head.interface} (twin {head.twin}): set "
        f'fabric_interfaces = ["{head.interface}"] or leave it out to use discovery'
    ) in message
    hcas = worker.hca_names
    assert (
        f"node-2: ib_hcas names {wrong_hca}, which this node does not have; the HCAs of "
        f"{worker.interface} (twin {worker.twin}) are {hcas[0]} (ACTIVE), {hcas[1]} (ACTIVE): "
        f'set ib_hcas = ["{hcas[0]}", "{hcas[1]}"] or leave it out to use discovery'
    ) in message
