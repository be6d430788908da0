"""Preflight's fabric checks across nodes and against the configuration (issue 33, items 3 and 4):
the RoCE MTU of every node, and configured ``fabric_interfaces``/``ib_hcas`` against what the
node has; on the probe outputs of tests/fixtures/fabric, parsed as preflight parses them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tests.test_parsers_fabric import (
    F0_IP,
    IB_IP,
    PLAIN_IP,
    SPARK_IP,
    edit_links,
    edit_section,
    fixture,
    link,
)
from vllm_redeploy.fabric_checks import (
    Port,
    configured_name_problems,
    mtu_mismatches,
    roce_ports,
)
from vllm_redeploy.parsers.fabric import FabricFacts, parse_fabric

B_IP = "192.168.200.13"
ROCE_HANG = (
    "RoCE does not negotiate the MTU, so NCCL between the nodes would hang (NVIDIA/nccl#2135); "
    "set the same MTU on every node's fabric interfaces"
)
SPARK_WHERE = f"the fabric IP {SPARK_IP} is on enp1s0f1np1 (twin enP2p1s0f1np1)"
USE_F1 = 'set fabric_interfaces = ["enp1s0f1np1"] or leave it out to use discovery'
SPARK_HCAS = (
    "the HCAs of enp1s0f1np1 (twin enP2p1s0f1np1) are rocep1s0f1 (ACTIVE), roceP2p1s0f1 (ACTIVE)"
)
USE_BOTH_HCAS = 'set ib_hcas = ["rocep1s0f1", "roceP2p1s0f1"] or leave it out to use discovery'


def spark(ip: str = SPARK_IP, **mtus: int) -> FabricFacts:
    """A Spark cabled on f1, both twins ACTIVE at MTU 9000, its fabric IP ``ip``; ``mtus``:
    interface name -> another MTU (what a reboot that lost the hand-set 9000 leaves)."""

    def change(links: list[dict]) -> None:
        for name, mtu in mtus.items():
            link(links, name)["mtu"] = mtu
        for address in link(links, "enp1s0f1np1")["addr_info"]:
            address["local"] = ip if address["local"] == SPARK_IP else address["local"]

    return parse_fabric(edit_links(fixture("spark-both-active.txt"), change), ip)


def ports(*nodes: tuple[str, FabricFacts]) -> list[Port]:
    return [port for name, facts in nodes for port in roce_ports(name, facts)]


# --- the MTU across the nodes ----------------------------------------------------------------


def test_the_same_mtu_everywhere_is_no_problem() -> None:
    both = ports(("spark-a", spark()), ("spark-b", spark(B_IP)))
    assert both == [
        Port("spark-a", "enp1s0f1np1", 9000),
        Port("spark-a", "enP2p1s0f1np1", 9000),
        Port("spark-b", "enp1s0f1np1", 9000),
        Port("spark-b", "enP2p1s0f1np1", 9000),
    ]
    assert mtu_mismatches(both) == []
    # Cabled on another port, the IP on the other twin: the same MTU is all that counts.
    f0 = parse_fabric(fixture("spark-f0.txt"), F0_IP)
    assert mtu_mismatches(ports(("spark-a", spark()), ("spark-c", f0))) == []


def test_a_node_that_lost_its_mtu_9000_is_named_with_both_values() -> None:
    lost = spark(B_IP, enp1s0f1np1=1500)
    assert mtu_mismatches(ports(("spark-a", spark()), ("spark-b", lost))) == [
        f"spark-b's enp1s0f1np1 has MTU 1500, spark-a's enp1s0f1np1 has 9000: {ROCE_HANG} (e.g. "
        "`sudo ip link set enp1s0f1np1 mtu 9000` on spark-b, and in netplan so it survives a "
        "reboot)"
    ]


def test_a_twin_whose_hca_nccl_uses_counts_too() -> None:
    lost = spark(B_IP, enP2p1s0f1np1=1500)
    problems = mtu_mismatches(ports(("spark-a", spark()), ("spark-b", lost)))
    assert [p.split(":")[0] for p in problems] == [
        "spark-b's enP2p1s0f1np1 has MTU 1500, spark-a's enp1s0f1np1 has 9000"
    ]
    # The same twin is not compared when ib_hcas leaves its HCA out: no RoCE goes through it.
    only_f1 = roce_ports("spark-b", lost, ib_hcas=["rocep1s0f1"])
    assert only_f1 == (Port("spark-b", "enp1s0f1np1", 9000),)
    assert mtu_mismatches([*roce_ports("spark-a", spark()), *only_f1]) == []


def test_on_a_tie_the_larger_mtu_is_the_clusters() -> None:
    lost = spark(B_IP, enp1s0f1np1=1500, enP2p1s0f1np1=1500)
    problems = mtu_mismatches(ports(("spark-a", spark()), ("spark-b", lost)))
    assert [p.split(":")[0] for p in problems] == [
        "spark-b's enp1s0f1np1 has MTU 1500, spark-a's enp1s0f1np1 has 9000",
        "spark-b's enP2p1s0f1np1 has MTU 1500, spark-a's enp1s0f1np1 has 9000",
    ]
    # The majority is the cluster's, whichever MTU it is: the odd node is the one named.
    three = ports(("spark-a", spark()), ("spark-b", lost), ("spark-c", lost))
    assert [p.split(":")[0] for p in mtu_mismatches(three)] == [
        "spark-a's enp1s0f1np1 has MTU 9000, spark-b's enp1s0f1np1 has 1500",
        "spark-a's enP2p1s0f1np1 has MTU 9000, spark-b's enp1s0f1np1 has 1500",
    ]


def test_configured_fabric_interfaces_are_compared() -> None:
    facts = spark()
    named = roce_ports("spark-a", facts, fabric_interfaces=["enP7s7"])  # a 1500 management port
    assert Port("spark-a", "enP7s7", 1500) in named
    problems = mtu_mismatches([*named, *roce_ports("spark-b", spark(B_IP))])
    assert [p.split(":")[0] for p in problems] == [
        "spark-a's enP7s7 has MTU 1500, spark-b's enp1s0f1np1 has 9000"
    ]


def test_nodes_without_roce_or_facts_are_skipped() -> None:
    a = roce_ports("spark-a", spark())
    # TCP adapts to the peer's MTU, InfiniBand's comes from the subnet manager, and a node whose
    # containers get no verbs device uses sockets: none of them is compared.
    plain = parse_fabric(fixture("plain-no-rdma.txt"), PLAIN_IP)
    infiniband = parse_fabric(fixture("infiniband.txt"), IB_IP)
    no_uverbs = replace(spark(B_IP, enp1s0f1np1=1500), rdma_devices=())
    local = parse_fabric(fixture("local-no-rdma.txt"), "192.0.2.2")  # rdma fails there
    for name, facts in [("p", plain), ("i", infiniband), ("u", no_uverbs), ("l", local)]:
        assert roce_ports(name, facts) == ()
    assert mtu_mismatches([*a, *roce_ports("b", parse_fabric("garbage", B_IP))]) == []
    # One node alone has no peer to disagree with (its twins' MTUs are FabricFacts' note).
    assert mtu_mismatches(roce_ports("spark-a", spark(enP2p1s0f1np1=1500))) == []


# --- configured interface names ---------------------------------------------------------------


def names(
    facts: FabricFacts, interfaces: Sequence[str] = (), hcas: Sequence[str] = ()
) -> list[str]:
    return configured_name_problems(facts, interfaces, hcas)


def test_names_that_fit_are_no_problem() -> None:
    facts = spark()
    assert names(facts, ["enp1s0f1np1"], ["rocep1s0f1", "roceP2p1s0f1"]) == []
    assert names(facts, ["enp1s0f1np1", "enP2p1s0f1np1"], ["rocep1s0f1:1"]) == []
    assert names(facts, ["enP2p1s0f1np1"], ["roceP2p1s0f1"]) == []  # the twin, its HCA
    f0 = parse_fabric(fixture("spark-f0.txt"), F0_IP)
    assert names(f0, ["enP2p1s0f0np0", "enp1s0f0np0"], ["rocep1s0f0", "roceP2p1s0f0"]) == []
    ib = parse_fabric(fixture("infiniband.txt"), IB_IP)
    assert names(ib, ["ib0"], ["mlx5_0"]) == []
    assert names(parse_fabric(fixture("local-no-rdma.txt"), "192.0.2.2"), ["eth0"]) == []


def test_an_interface_the_node_does_not_have() -> None:
    assert names(spark(), ["enp9s0f1np1"]) == [
        f"fabric_interfaces names enp9s0f1np1, which this node does not have; {SPARK_WHERE}: "
        f"{USE_F1}"
    ]
    plain = parse_fabric(fixture("plain-no-rdma.txt"), PLAIN_IP)
    assert names(plain, ["enp1s0f0np0"]) == [
        "fabric_interfaces names enp1s0f0np0, which this node does not have; the fabric IP "
        f'{PLAIN_IP} is on eth0: set fabric_interfaces = ["eth0"] or leave it out to use '
        "discovery"
    ]


def test_an_interface_that_is_down_or_elsewhere() -> None:
    facts = spark()
    assert names(facts, ["enp1s0f0np0", "enP7s7"]) == [
        f"fabric_interfaces names enp1s0f0np0, which is DOWN on this node; {SPARK_WHERE}: {USE_F1}",
        "fabric_interfaces names enP7s7, which neither carries the fabric IP nor is a twin of "
        f"the interface that does; {SPARK_WHERE}: {USE_F1}",
    ]


def test_the_right_interface_down_is_told_to_come_up() -> None:
    def down(links: list[dict]) -> None:
        link(links, "enp1s0f1np1")["operstate"] = "DOWN"

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), down), SPARK_IP)
    assert names(facts, ["enp1s0f1np1"]) == [
        "fabric_interfaces names enp1s0f1np1, which carries the fabric IP but is DOWN: bring it "
        "up (`sudo ip link set enp1s0f1np1 up`) and check its cable"
    ]


def test_no_interface_list_judges_nothing() -> None:
    assert names(parse_fabric("", SPARK_IP), ["enp1s0f1np1"], ["rocep1s0f1"]) == []


# --- configured HCA names ----------------------------------------------------------------------


def test_an_hca_the_node_does_not_have() -> None:
    assert names(spark(), hcas=["mlx5_0", "rocep1s0f1:2"]) == [
        f"ib_hcas names mlx5_0, which this node does not have; {SPARK_HCAS}: {USE_BOTH_HCAS}",
        f"ib_hcas names rocep1s0f1:2, which this node does not have; {SPARK_HCAS}: {USE_BOTH_HCAS}",
    ]
    plain = parse_fabric(fixture("plain-no-rdma.txt"), PLAIN_IP)
    assert names(plain, hcas=["rocep1s0f1"]) == [
        "ib_hcas names rocep1s0f1, which this node does not have; this node has no RDMA HCA "
        "(`rdma link` lists none): leave ib_hcas out"
    ]
    # `rdma` failed: the HCAs could not be listed, so none is judged (preflight says why).
    assert names(parse_fabric(fixture("local-no-rdma.txt"), "192.0.2.2"), hcas=["mlx5_0"]) == []


def test_an_hca_that_is_down() -> None:
    down = parse_fabric(fixture("spark-twin-down.txt"), SPARK_IP)
    assert names(down, hcas=["rocep1s0f1", "roceP2p1s0f1"]) == [
        "ib_hcas names roceP2p1s0f1, which is DOWN on this node; the HCAs of enp1s0f1np1 (twin "
        "enP2p1s0f1np1) are rocep1s0f1 (ACTIVE), roceP2p1s0f1 (DOWN): "
        'set ib_hcas = ["rocep1s0f1"] or leave it out to use discovery'
    ]
    assert names(spark(), hcas=["rocep1s0f0"]) == [  # the other port's, not cabled
        f"ib_hcas names rocep1s0f0, which is DOWN on this node; {SPARK_HCAS}: {USE_BOTH_HCAS}"
    ]


def test_an_active_hca_of_another_interface() -> None:
    def cabled(ports: list[dict]) -> None:
        link(ports, "rocep1s0f0")["state"] = "ACTIVE"

    both_ports = parse_fabric(
        edit_section(fixture("spark-both-active.txt"), "rdma-link", cabled), SPARK_IP
    )
    assert names(both_ports, hcas=["rocep1s0f0"]) == [
        "ib_hcas names rocep1s0f0, which serves enp1s0f0np0, none of the fabric's interfaces; "
        f"{SPARK_HCAS}: {USE_BOTH_HCAS}"
    ]
    # Named in fabric_interfaces too, it belongs (that name is then the problem).
    assert names(both_ports, ["enp1s0f0np0"], ["rocep1s0f0"]) == [
        f"fabric_interfaces names enp1s0f0np0, which is DOWN on this node; {SPARK_WHERE}: {USE_F1}"
    ]
    ib = parse_fabric(fixture("infiniband.txt"), IB_IP)
    assert names(ib, hcas=["mlx5_1"]) == [
        "ib_hcas names mlx5_1, which serves ib1, none of the fabric's interfaces; the HCAs of "
        'ib0 are mlx5_0 (ACTIVE): set ib_hcas = ["mlx5_0"] or leave it out to use discovery'
    ]
