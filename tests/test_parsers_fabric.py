"""Fabric discovery: the probe script (run for real, on this machine and on a fake sysfs), the
fixtures of tests/fixtures/fabric (see its README), the twin rules, NCCL's values, garbage."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_redeploy.parsers.fabric import (
    FABRIC_ARGV,
    FABRIC_SCRIPT,
    FabricFacts,
    Hca,
    parse_fabric,
)

FIXTURES = Path(__file__).parent / "fixtures" / "fabric"
SPARK_IP, F0_IP, PLAIN_IP, IB_IP = "192.168.200.12", "192.168.200.13", "192.168.200.21", "10.10.0.5"
GUID = "3c6d:6603:00a1:b230"  # the Spark fixtures' sys_image_guid (one adapter, four HCAs)
OTHER_GUID = "0c42:a103:0099:0001"
HALF = "NCCL will use half the bandwidth"
UVERBS = tuple(f"/dev/infiniband/uverbs{i}" for i in range(4))


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def edit_links(text: str, change: Callable[[list[dict]], None]) -> str:
    """The probe output with its ``ip -j`` array passed through ``change(list) -> None``."""
    lines = text.splitlines(keepends=True)
    at = lines.index("@@ ip-addr\n") + 1
    links = json.loads(lines[at])
    change(links)
    lines[at] = json.dumps(links, separators=(",", ":")) + "\n"
    return "".join(lines)


def edit_section(text: str, section: str, change: Callable[[list[dict]], None]) -> str:
    """The probe output with a section's JSON array passed through ``change(list) -> None``."""
    lines = text.splitlines(keepends=True)
    at = lines.index(f"@@ {section}\n") + 1
    data = json.loads(lines[at])
    change(data)
    lines[at] = json.dumps(data, separators=(",", ":")) + "\n"
    return "".join(lines)


def probe(links: object, devices: object, ports: object, rows: list[str]) -> str:
    """A probe output from parts, every command exiting 0."""
    parts = [("ip-addr", links), ("rdma-dev", devices), ("rdma-link", ports)]
    text = "".join(f"@@ {name}\n{json.dumps(data)}\n@@ rc 0\n" for name, data in parts)
    return text + "@@ sysfs\n" + "".join(f"{row}\n" for row in rows) + "@@ end\n"


def link(links: list[dict], name: str) -> dict:
    return next(item for item in links if item["ifname"] == name)


def inet(ip: str, prefixlen: int = 24) -> dict:
    return {"family": "inet", "local": ip, "prefixlen": prefixlen, "scope": "global"}


# --- the command ----------------------------------------------------------------------------


def test_argv_is_one_constant_posix_sh_script() -> None:
    assert FABRIC_ARGV == ("sh", "-c", FABRIC_SCRIPT)
    # No single quote: shlex.join (what SSHRunner sends) keeps the script one quoted word.
    assert "'" not in FABRIC_SCRIPT
    assert shlex.split(shlex.join(FABRIC_ARGV)) == list(FABRIC_ARGV)
    # No root, no extra tools, no bashisms, nothing the test bed cannot show.
    for absent in ("sudo", "ibdev2netdev", "GID", "bash", "[[", "/sys/class/infiniband"):
        assert absent not in FABRIC_SCRIPT
    assert subprocess.run(["sh", "-n", "-c", FABRIC_SCRIPT], check=False).returncode == 0
    assert FABRIC_SCRIPT.rstrip().endswith("exit 0")


def test_the_real_script_runs_here_and_parses() -> None:
    run = subprocess.run(FABRIC_ARGV, capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 0, run.stderr
    found = parse_fabric(run.stdout, "192.0.2.1")
    assert found.complete and found.interfaces
    # Pick an address this machine really has, and find it again.
    owner, ip = next(
        (i.name, a.local)
        for i in found.interfaces
        for a in i.addresses
        if a.family == "inet" and i.name != "lo"
    )
    facts = parse_fabric(run.stdout, ip)
    assert facts.interface == owner
    assert facts.mtu == next(i.mtu for i in facts.interfaces if i.name == owner)
    assert facts.socket_ifnames[0] == owner
    if not facts.hcas:  # this machine has no RDMA (see local-no-rdma.txt)
        assert facts.nccl_ib_hca is None
        # None, but the verbs device nodes the bed makes here while an RDMA bed is up
        # (tests/testbed/fabric.py), perhaps on the other worker right now.
        assert all(re.fullmatch(r"/dev/infiniband/uverbs\d", d) for d in facts.rdma_devices)


def test_the_saved_local_capture() -> None:
    facts = parse_fabric(fixture("local-no-rdma.txt"), "192.0.2.2")
    assert (facts.interface, facts.mtu, facts.operstate) == ("eth0", 1400, "UP")
    assert facts.complete and facts.hcas == () and facts.rdma_devices == ()
    assert [i.name for i in facts.interfaces] == ["lo", "ifb0", "ifb1", "eth0"]
    assert facts.nccl_ib_hca is None
    # This kernel has no RDMA at all: `rdma` fails, no verbs device. No RDMA here, no problem.
    assert [r.rc for r in facts.runs] == [0, 1, 1]
    assert facts.runs[2].message == "Failed to open NETLINK_RDMA socket"
    assert (facts.rdma, facts.rdma_checked) == ("none", False)
    assert facts.problems() == ()
    eth0 = facts.interfaces[-1]
    assert (eth0.pci, eth0.kind, eth0.link_type) == (None, None, "ether")  # virtio, not PCI


def fake_tools(root: Path, rdma: str | None, ip: str = "") -> dict[str, str]:
    """A PATH whose ``rdma`` (and ``ip``) are shell scripts: ``rdma`` None means not installed."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("rdma", rdma), ("ip", ip or None)):
        if body is not None:
            (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
            (bin_dir / name).chmod(0o755)
    system = "/usr/sbin:/usr/bin:/sbin:/bin"
    if rdma is None:  # keep the real ip, hide the real rdma
        (bin_dir / "ip").unlink(missing_ok=True)
        (bin_dir / "ip").symlink_to(shutil.which("ip") or "/usr/sbin/ip")
        system = ""
    return {"PATH": f"{bin_dir}:{system}".rstrip(":")}


def run_rooted(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """FABRIC_SCRIPT itself, its globs moved under ``root``, the tools from ``env``'s PATH."""
    script = FABRIC_SCRIPT.replace("/sys/class/net/", f"{root}/sys/class/net/")
    script = script.replace("/dev/infiniband/", f"{root}/dev/infiniband/")
    sh = shutil.which("sh") or "/bin/sh"
    return subprocess.run([sh, "-c", script], capture_output=True, text=True, env=env, check=False)


def fake_sysfs(root: Path, uverbs: int = 2) -> None:
    """An IPoIB netdev whose PCI function hosts mlx5_0, and ``uverbs`` verbs device nodes."""
    device = root / "sys/devices/pci0000:00/0000:17:00.0"
    (device / "infiniband/mlx5_0").mkdir(parents=True)
    (root / "sys/class/net/ib0").mkdir(parents=True)
    (root / "sys/class/net/ib0/device").symlink_to(device)
    (root / "sys/class/net/ib0/dev_port").write_text("0\n")
    (root / "sys/class/net/lo").mkdir()  # virtual: no device link
    (root / "dev/infiniband").mkdir(parents=True)
    (root / "dev/infiniband/rdma_cm").write_text("")
    for i in range(uverbs):
        (root / f"dev/infiniband/uverbs{i}").write_text("")


SPARK_DEV = json.dumps([{"ifindex": 0, "ifname": "rocep1s0f1", "sys_image_guid": GUID}])
SPARK_LINK = json.dumps(
    [{"ifindex": 0, "ifname": "rocep1s0f1", "port": 1, "state": "ACTIVE",
      "physical_state": "LINK_UP", "netdev": "enp1s0f1np1", "netdev_index": 4}]
)  # fmt: skip
FAKE_RDMA = f"""case "$*" in
  "-j dev show") echo '{SPARK_DEV}' ;;
  "-j link show") echo '{SPARK_LINK}' ;;
  *) exit 2 ;;
esac"""


def test_the_script_runs_the_tools_and_globs(tmp_path: Path) -> None:
    fake_sysfs(tmp_path)
    links = fixture("spark-both-active.txt").splitlines()[1]
    run = run_rooted(tmp_path, fake_tools(tmp_path, FAKE_RDMA, ip=f"echo '{links}'"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[2:] == [
        "@@ rc 0",
        "@@ rdma-dev", SPARK_DEV, "@@ rc 0",
        "@@ rdma-link", SPARK_LINK, "@@ rc 0",
        "@@ sysfs",
        "ibdev\tib0\tmlx5_0\t0",
        f"uverbs\t{tmp_path}/dev/infiniband/uverbs0",
        f"uverbs\t{tmp_path}/dev/infiniband/uverbs1",
        "@@ end",
    ]  # fmt: skip
    facts = parse_fabric(run.stdout, SPARK_IP)
    assert facts.interface == "enp1s0f1np1" and facts.twins == ("enP2p1s0f1np1",)
    assert facts.nccl_ib_hca == "=rocep1s0f1:1"
    assert facts.rdma_devices == ()  # the moved paths are not /dev/infiniband/uverbs*
    assert facts.hcas[0].pci == "0000:01:00.1"  # its netdev's parentdev


def test_rdma_missing_but_verbs_devices_could_not_be_checked(tmp_path: Path) -> None:
    fake_sysfs(tmp_path)
    run = run_rooted(tmp_path, fake_tools(tmp_path, rdma=None))
    assert run.returncode == 0, run.stderr
    assert "@@ rdma-link\n" in run.stdout and "@@ rc 127\n" in run.stdout
    # The verbs devices found under tmp_path, as if they were the real ones.
    text = run.stdout.replace(f"{tmp_path}/dev/", "/dev/")
    facts = parse_fabric(text, "127.0.0.1")
    assert facts.interface == "lo" and facts.hcas == ()
    assert facts.rdma_devices == ("/dev/infiniband/uverbs0", "/dev/infiniband/uverbs1")
    assert facts.rdma == "unknown"
    (problem,) = facts.problems()
    assert problem.startswith("could not check the HCAs: `rdma -j dev show` is not installed")
    assert problem.endswith("yet /dev/infiniband holds uverbs0, uverbs1")


def test_rdma_failing_without_verbs_devices_is_no_rdma(tmp_path: Path) -> None:
    failing = "echo Failed to open NETLINK_RDMA socket >&2; exit 1"
    run = run_rooted(tmp_path, fake_tools(tmp_path, failing, ip="exit 1"))
    assert run.returncode == 0, run.stderr
    assert run.stdout == (
        "@@ ip-addr\n@@ rc 1\n"
        "@@ rdma-dev\nFailed to open NETLINK_RDMA socket\n@@ rc 1\n"
        "@@ rdma-link\nFailed to open NETLINK_RDMA socket\n@@ rc 1\n"
        "@@ sysfs\n@@ end\n"
    )
    facts = parse_fabric(run.stdout, SPARK_IP)
    assert facts.interfaces == () and facts.hcas == () and facts.rdma == "none"
    assert facts.problems() == (
        "the probe printed no interface list (`ip -d -j addr show` exited 1)",
        f"the fabric IP {SPARK_IP} is on no interface",
    )


def test_rdma_answering_nothing_while_verbs_devices_exist() -> None:
    """The kernel is authoritative: no HCA in this namespace (the test bed's nodes without
    RDMA see the host's shared /dev/infiniband)."""
    text = fixture("plain-no-rdma.txt").replace(
        "@@ sysfs\n", "@@ sysfs\nuverbs\t/dev/infiniband/uverbs0\n"
    )
    facts = parse_fabric(text, PLAIN_IP)
    assert facts.rdma_checked and facts.rdma == "none" and facts.problems() == ()


def test_iproute2_6_7_prints_one_object_per_line() -> None:
    def split(text: str, section: str) -> str:
        lines = text.splitlines(keepends=True)
        at = lines.index(f"@@ {section}\n") + 1
        lines[at] = lines[at].replace("},{", "}\n,{").replace("}]", "}\n]")
        return "".join(lines)

    text = split(split(fixture("spark-both-active.txt"), "rdma-dev"), "rdma-link")
    assert text.count("\n,{") == 6
    assert parse_fabric(text, SPARK_IP) == parse_fabric(fixture("spark-both-active.txt"), SPARK_IP)


# --- the fixtures ---------------------------------------------------------------------------

CASES = {
    "spark-both-active.txt": dict(
        ip=SPARK_IP,
        interface="enp1s0f1np1",
        mtu=9000,
        twins=("enP2p1s0f1np1",),
        nccl="=rocep1s0f1:1,roceP2p1s0f1:1",
        sockets=("enp1s0f1np1",),  # the twin is up but has no IPv4 address: Gloo would fail
        problems=(),
    ),
    "spark-twin-down.txt": dict(
        ip=SPARK_IP,
        interface="enp1s0f1np1",
        mtu=9000,
        twins=("enP2p1s0f1np1",),
        nccl="=rocep1s0f1:1",
        sockets=("enp1s0f1np1",),
        problems=(
            "HCA roceP2p1s0f1 is DOWN",
            f"only one of the twins (rocep1s0f1) is ACTIVE: {HALF}",
        ),
    ),
    "spark-f0.txt": dict(  # the IP on the P2 twin: the NCCL order stays domain 0 first
        ip=F0_IP,
        interface="enP2p1s0f0np0",
        mtu=9000,
        twins=("enp1s0f0np0",),
        nccl="=rocep1s0f0:1,roceP2p1s0f0:1",
        sockets=("enP2p1s0f0np0",),
        problems=(),
    ),
    "plain-no-rdma.txt": dict(
        ip=PLAIN_IP,
        interface="eth0",
        mtu=1500,
        twins=(),
        nccl=None,
        sockets=("eth0",),
        problems=(),  # no RDMA here: NCCL uses sockets, as it must
    ),
    "infiniband.txt": dict(
        ip=IB_IP,
        interface="ib0",
        mtu=2044,
        twins=(),
        nccl="=mlx5_0:1",  # mlx5_1 serves ib1, another subnet: not the fabric's
        sockets=("ib0",),
        problems=(),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_fixture(name: str) -> None:
    want = CASES[name]
    facts = parse_fabric(fixture(name), want["ip"])
    assert facts.complete
    assert (facts.interface, facts.mtu, facts.operstate) == (want["interface"], want["mtu"], "UP")
    assert facts.twins == want["twins"]
    assert facts.members == () and facts.also_on == ()
    assert facts.nccl_ib_hca == want["nccl"]
    assert facts.socket_ifnames == want["sockets"]
    assert facts.problems() == want["problems"]
    everything = repr(facts) + repr(facts.problems()) + repr(facts.nccl_ib_hca)
    assert "GID" not in everything.upper()


def test_spark_hcas_in_full() -> None:
    facts = parse_fabric(fixture("spark-both-active.txt"), SPARK_IP)
    assert facts.hcas == (
        Hca("rocep1s0f0", 1, "DOWN", "Ethernet", "enp1s0f0np0", ("enp1s0f0np0",),
            "0000:01:00.0", GUID, "DISABLED"),
        Hca("rocep1s0f1", 1, "ACTIVE", "Ethernet", "enp1s0f1np1", ("enp1s0f1np1",),
            "0000:01:00.1", GUID, "LINK_UP"),
        Hca("roceP2p1s0f0", 1, "DOWN", "Ethernet", "enP2p1s0f0np0", ("enP2p1s0f0np0",),
            "0002:01:00.0", GUID, "DISABLED"),
        Hca("roceP2p1s0f1", 1, "ACTIVE", "Ethernet", "enP2p1s0f1np1", ("enP2p1s0f1np1",),
            "0002:01:00.1", GUID, "LINK_UP"),
    )  # fmt: skip
    assert all(h.roce for h in facts.hcas)
    assert [h.name for h in facts.fabric_hcas] == ["rocep1s0f1", "roceP2p1s0f1"]
    assert facts.rdma_devices == UVERBS
    # The other port's HCAs are DOWN too, but they are not the fabric's: no problem reported.
    assert not any("rocep1s0f0" in p for p in facts.problems())
    spark = {i.name: i for i in facts.interfaces}
    assert spark["enP7s7"].pci == "0007:01:00.0" and spark["docker0"].pci is None
    assert spark["lo"].operstate == "UNKNOWN"
    assert spark["docker0"].kind == "bridge" and spark["enp1s0f1np1"].kind is None
    assert facts.rdma == "present" and all(not r.failed for r in facts.runs)


def test_infiniband_link_layer() -> None:
    facts = parse_fabric(fixture("infiniband.txt"), IB_IP)
    assert [(h.name, h.link_layer, h.netdev, h.roce) for h in facts.hcas] == [
        ("mlx5_0", "InfiniBand", "ib0", False),
        ("mlx5_1", "InfiniBand", "ib1", False),
    ]
    assert facts.rdma_devices == ("/dev/infiniband/uverbs0", "/dev/infiniband/uverbs1")
    # The storage rail is a fabric of its own.
    assert parse_fabric(fixture("infiniband.txt"), "10.11.0.5").nccl_ib_hca == "=mlx5_1:1"


def test_no_rdma_gives_no_hcas_and_no_nccl_ib_hca() -> None:
    facts = parse_fabric(fixture("plain-no-rdma.txt"), PLAIN_IP)
    assert facts.hcas == () and facts.fabric_hcas == () and facts.rdma_devices == ()
    assert facts.nccl_ib_hca is None


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_ip_on_no_interface(name: str) -> None:
    facts = parse_fabric(fixture(name), "192.168.250.99")
    assert facts.interface is None and facts.mtu is None and facts.twins == ()
    assert facts.nccl_ib_hca is None and facts.socket_ifnames == ()
    assert "the fabric IP 192.168.250.99 is on no interface" in facts.problems()


# --- the twin rules and the other layouts ----------------------------------------------------


def test_the_ip_on_both_twins() -> None:
    def both(links: list[dict]) -> None:
        link(links, "enP2p1s0f1np1")["addr_info"].insert(0, inet(SPARK_IP))

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), both), SPARK_IP)
    assert facts.interface == "enp1s0f1np1" and facts.twins == ("enP2p1s0f1np1",)
    assert facts.also_on == () and facts.problems() == ()
    assert facts.socket_ifnames == ("enp1s0f1np1", "enP2p1s0f1np1")  # both have an address
    assert facts.nccl_ib_hca == "=rocep1s0f1:1,roceP2p1s0f1:1"


def test_twins_on_two_subnets_both_serve_sockets() -> None:
    def second_subnet(links: list[dict]) -> None:
        link(links, "enP2p1s0f1np1")["addr_info"].insert(0, inet("192.168.201.12"))

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), second_subnet), SPARK_IP)
    assert facts.socket_ifnames == ("enp1s0f1np1", "enP2p1s0f1np1")


def test_the_ip_on_a_bond_of_the_twins() -> None:
    def bond(links: list[dict]) -> None:
        for name in ("enp1s0f1np1", "enP2p1s0f1np1"):
            item = link(links, name)
            item["addr_info"] = []
            item["master"] = "bond0"
        links.append(
            {"ifindex": 9, "ifname": "bond0", "flags": ["BROADCAST", "MULTICAST", "MASTER", "UP",
             "LOWER_UP"], "mtu": 9000, "qdisc": "noqueue", "operstate": "UP",
             "addr_info": [inet(SPARK_IP)]}
        )  # fmt: skip

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), bond), SPARK_IP)
    assert facts.interface == "bond0" and facts.mtu == 9000
    assert facts.members == ("enp1s0f1np1", "enP2p1s0f1np1") and facts.twins == ()
    assert facts.nccl_ib_hca == "=rocep1s0f1:1,roceP2p1s0f1:1"
    assert facts.socket_ifnames == ("bond0",)
    assert facts.problems() == ()


def test_the_ip_on_a_vlan_of_a_twin() -> None:
    def vlan(links: list[dict]) -> None:
        link(links, "enp1s0f1np1")["addr_info"] = []
        links.append(
            {"ifindex": 9, "ifname": "enp1s0f1np1.100", "link": "enp1s0f1np1", "mtu": 9000,
             "operstate": "UP", "addr_info": [inet(SPARK_IP)]}
        )  # fmt: skip

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), vlan), SPARK_IP)
    assert facts.interface == "enp1s0f1np1.100" and facts.members == ("enp1s0f1np1",)
    assert facts.twins == ("enP2p1s0f1np1",)
    assert facts.nccl_ib_hca == "=rocep1s0f1:1,roceP2p1s0f1:1"


def test_a_loopback_prefix_owns_its_addresses() -> None:
    """127.0.0.1/8 on lo makes all of 127/8 local (`ip route get` says so too)."""
    facts = parse_fabric(fixture("local-no-rdma.txt"), "127.0.8.5")
    assert (facts.interface, facts.operstate, facts.twins) == ("lo", "UNKNOWN", ())
    assert facts.socket_ifnames == ("lo",) and facts.problems() == ()
    assert parse_fabric(fixture("local-no-rdma.txt"), "192.0.2.77").interface is None


def test_a_veth_peer_is_not_a_parent() -> None:
    """A veth names its peer in ``link`` (the test bed's fabric interfaces are veths)."""

    def veth(links: list[dict]) -> None:
        for name, peer in (("enp1s0f1np1", "vrd1a"), ("enP2p1s0f1np1", "vrd1b")):
            item = link(links, name)
            item.update(link=peer, linkinfo={"info_kind": "veth"})
            item.pop("parentbus"), item.pop("parentdev")
            links.append({"ifname": peer, "link": name, "linkinfo": {"info_kind": "veth"}})

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), veth), SPARK_IP)
    assert facts.members == () and facts.twins == ("enP2p1s0f1np1",)
    assert facts.nccl_ib_hca == "=rocep1s0f1:1,roceP2p1s0f1:1" and facts.problems() == ()


def test_renamed_netdevs_are_twins_through_their_hcas() -> None:
    text = fixture("spark-both-active.txt")
    text = text.replace("enp1s0f1np1", "fabric0").replace("enP2p1s0f1np1", "fabric1")
    facts = parse_fabric(text, SPARK_IP)
    assert facts.interface == "fabric0" and facts.twins == ("fabric1",)
    assert facts.nccl_ib_hca == "=rocep1s0f1:1,roceP2p1s0f1:1"


def test_mlx5_named_hcas_and_renamed_netdevs_are_twins_by_adapter_and_pci() -> None:
    text = fixture("spark-both-active.txt")
    for old, new in (
        ("roceP2p1s0f0", "mlx5_2"), ("roceP2p1s0f1", "mlx5_3"),
        ("rocep1s0f0", "mlx5_0"), ("rocep1s0f1", "mlx5_1"),
        ("enp1s0f1np1", "fabric0"), ("enP2p1s0f1np1", "fabric1"),
    ):  # fmt: skip
        text = text.replace(old, new)
    facts = parse_fabric(text, SPARK_IP)
    assert facts.twins == ("fabric1",)
    assert facts.nccl_ib_hca == "=mlx5_1:1,mlx5_3:1"


def test_two_adapters_are_never_twins() -> None:
    """Same names pattern, different sys_image_guid: two NICs in two PCI domains."""

    def other_adapter(devices: list[dict]) -> None:
        next(d for d in devices if d["ifname"] == "roceP2p1s0f1")["sys_image_guid"] = OTHER_GUID

    text = edit_section(fixture("spark-both-active.txt"), "rdma-dev", other_adapter)
    facts = parse_fabric(text, SPARK_IP)
    assert facts.twins == () and facts.nccl_ib_hca == "=rocep1s0f1:1"
    assert facts.problems() == ()


def test_the_spark_management_port_is_nobodys_twin() -> None:
    """enP7s7 sits at 0007:01:00.0, the same bus:device.function as enp1s0f0np0."""
    facts = parse_fabric(fixture("spark-both-active.txt"), "192.168.1.50")
    assert facts.interface == "enP7s7" and facts.twins == ()
    assert facts.problems() == ("no HCA serves enP7s7: NCCL will use TCP sockets",)


def test_a_twin_with_another_mtu() -> None:
    def mtu(links: list[dict]) -> None:
        link(links, "enP2p1s0f1np1")["mtu"] = 1500

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), mtu), SPARK_IP)
    assert facts.problems() == ("the twins' MTUs differ (enp1s0f1np1 9000, enP2p1s0f1np1 1500)",)


def test_the_fabric_interface_down_and_no_active_hca() -> None:
    def down(links: list[dict]) -> None:
        for name in ("enp1s0f1np1", "enP2p1s0f1np1"):
            link(links, name)["operstate"] = "DOWN"

    def ports_down(ports: list[dict]) -> None:
        for port in ports:
            port.update(state="DOWN", physical_state="DISABLED")

    text = edit_section(edit_links(fixture("spark-both-active.txt"), down), "rdma-link", ports_down)
    facts = parse_fabric(text, SPARK_IP)
    assert facts.nccl_ib_hca is None
    assert facts.problems() == (
        "the fabric interface enp1s0f1np1 is DOWN",
        "HCA rocep1s0f1 is DOWN",
        "HCA roceP2p1s0f1 is DOWN",
        "no HCA of enp1s0f1np1 is ACTIVE: NCCL will use TCP sockets",
    )


def test_no_uverbs_nodes() -> None:
    text = "".join(
        line for line in fixture("spark-both-active.txt").splitlines(keepends=True)
        if not line.startswith("uverbs")
    )  # fmt: skip
    facts = parse_fabric(text, SPARK_IP)
    assert facts.rdma_devices == ()
    assert facts.problems() == (
        "no /dev/infiniband/uverbs* device nodes: a container cannot open the HCAs",
    )


def test_the_ip_also_on_an_unrelated_interface() -> None:
    def twice(links: list[dict]) -> None:
        link(links, "enP7s7")["addr_info"].append(inet(SPARK_IP))

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), twice), SPARK_IP)
    assert facts.interface == "enP7s7"  # first in ip's order among the UP owners
    assert facts.also_on == ("enp1s0f1np1",)
    assert f"the fabric IP {SPARK_IP} is also on enp1s0f1np1 (not a twin of enP7s7)" in (
        facts.problems()
    )


def test_a_dual_port_hca_maps_its_ports_by_dev_port() -> None:
    """RoCE names each port's netdev; the sysfs rows agree (dev_port is 0-based)."""
    links = [
        {"ifname": "eth2", "mtu": 1500, "operstate": "UP", "addr_info": []},
        {"ifname": "eth3", "mtu": 1500, "operstate": "UP", "addr_info": [inet("10.3.0.1")]},
    ]
    ports = [
        {"ifindex": 0, "ifname": "mlx4_0", "port": 1, "state": "ACTIVE", "netdev": "eth2"},
        {"ifindex": 0, "ifname": "mlx4_0", "port": 2, "state": "DOWN"},
    ]
    rows = ["ibdev\teth2\tmlx4_0\t0", "ibdev\teth3\tmlx4_0\t1"]
    text = probe(links, [{"ifname": "mlx4_0"}], ports, rows)
    facts = parse_fabric(text, "10.3.0.1")
    assert [(h.port, h.netdevs) for h in facts.hcas] == [(1, ("eth2",)), (2, ("eth3",))]
    assert facts.hcas[1].link_layer == ""  # no netdev from rdma, no lid: unknown
    assert facts.nccl_ib_hca is None
    assert facts.problems()[:2] == (
        "HCA mlx4_0 port 2 is DOWN",
        "no HCA of eth3 is ACTIVE: NCCL will use TCP sockets",
    )


def test_ipv6_fabric_ip_and_spelling() -> None:
    def v6(links: list[dict]) -> None:
        item = link(links, "enp1s0f1np1")
        item["addr_info"].append(
            {"family": "inet6", "local": "fd00:200::12", "prefixlen": 64, "scope": "global"}
        )

    facts = parse_fabric(edit_links(fixture("spark-both-active.txt"), v6), "FD00:200:0::12")
    assert facts.interface == "enp1s0f1np1"
    # The twin has only a link-local IPv6 address: not usable for sockets.
    assert facts.socket_ifnames == ("enp1s0f1np1",)


def test_output_cut_short() -> None:
    text = fixture("spark-both-active.txt").split("@@ sysfs")[0]
    facts = parse_fabric(text, SPARK_IP)
    assert not facts.complete and facts.interface == "enp1s0f1np1"
    assert facts.nccl_ib_hca == "=rocep1s0f1:1,roceP2p1s0f1:1"
    assert facts.problems()[0] == "the probe's output ends early: the facts may be partial"


# --- never raises ---------------------------------------------------------------------------

FIXTURE_LINES = sorted(
    {line for path in FIXTURES.glob("*.txt") for line in path.read_text().splitlines()}
)
KEYS = st.sampled_from(["ifname", "mtu", "operstate", "addr_info", "local", "family", "link"])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=20,
)
CELL = st.sampled_from(["", "1", "0", "enp1s0f1np1", "rocep1s0f1", "/dev/infiniband/uverbs0"])
ROW = st.builds(
    lambda tag, cells: "\t".join([tag, *cells]),
    st.sampled_from(["ibdev", "uverbs", "junk"]),
    st.lists(CELL | st.text(max_size=8), max_size=4),
)
MARKERS = st.sampled_from(
    ["@@ ip-addr", "@@ rdma-dev", "@@ rdma-link", "@@ sysfs", "@@ end", "@@ rc 0", "@@ rc 1", "@@"]
)
LINE = st.sampled_from(FIXTURE_LINES) | ROW | MARKERS | st.text(max_size=40)
PROBE = (
    st.lists(LINE, max_size=25).map("\n".join)
    | st.builds(probe, JSON, JSON, JSON, st.lists(ROW, max_size=10))
    | st.text()
)
IPS = st.sampled_from([SPARK_IP, "fd00::1", "", "::", "1.2.3.4.5", "fe80::1%eth0"]) | st.text()


@settings(derandomize=True, database=None, max_examples=400, deadline=None)
@given(PROBE, IPS)
@example("@@ ip-addr\n" + "[" * 100_000 + "\n@@ end\n", SPARK_IP)
@example('@@ rdma-link\n[{"ifname": "x", "port": ' + "9" * 5000 + "}]\n@@ rc 0\n", "x")
@example("@@ rdma-dev\n" + "[" * 100_000 + "\n@@ rc 99999999999\n", "x")
@example('@@ ip-addr\n[{"ifname": "a", "mtu": true, "addr_info": 7}]\n', "")
def test_parse_fabric_never_raises(stdout: str, fabric_ip: str) -> None:
    facts = parse_fabric(stdout, fabric_ip)
    assert isinstance(facts, FabricFacts)
    assert all(isinstance(p, str) for p in facts.problems())
    assert facts.nccl_ib_hca is None or facts.nccl_ib_hca.startswith("=")
    assert isinstance(facts.socket_ifnames, tuple)


@pytest.mark.parametrize("garbage", ["", "\n\n", "not a probe", "@@ end\n", "[]", "\x00\xff"])
def test_garbage_gives_empty_facts(garbage: str) -> None:
    facts = parse_fabric(garbage, SPARK_IP)
    assert facts.interfaces == () and facts.hcas == () and facts.interface is None
    assert facts.nccl_ib_hca is None and facts.socket_ifnames == ()
