"""The NCCL transport parser on real logs (the H200 captures), the brief's RDMA lines, garbage."""

from __future__ import annotations

import importlib.util
import json
import shlex
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_redeploy.parsers.nccl_log import NcclTransport, RankTransport, judge_transport

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
H200 = FIXTURES / "h200-x2"
SCRIPT = Path(__file__).parent.parent / "scripts" / "capture_nccl_logs.py"

NO_IB = ("NET/IB : No device found", "Failed to initialize NET plugin IB")
SOCKET_CHANNELS = ("NET/Socket/0",)
# scenario -> (judgement, rank's network, channels, warnings); every rank of a scenario alike
# except where EXPECTED_RANK says otherwise. See fixtures/nccl/README.md.
EXPECTED: dict[str, tuple[str, str | None, tuple[str, ...], tuple[str, ...]]] = {
    "a-net-socket": ("socket", "Socket", SOCKET_CHANNELS, NO_IB),
    "b-no-socket-interface": ("unknown", None, (), ("Bootstrap : no socket interface found",)),
    "c-default-p2p": ("socket", "Socket", ("P2P/CUMEM",), NO_IB),
    "d-ib-hca-absent": ("socket", "Socket", SOCKET_CHANNELS, NO_IB),
    "e-net-ib-forced": ("unknown", None, (), (*NO_IB, "Failed to initialize any NET plugin")),
    "f-net-socket-full-info": ("socket", "Socket", SOCKET_CHANNELS, NO_IB),
    "g-ib-disabled": ("socket", "Socket", SOCKET_CHANNELS, ("Failed to initialize NET plugin IB",)),
    "h-socket-ifname-eth0": ("socket", "Socket", SOCKET_CHANNELS, NO_IB),
}
# Rank 1 of b died of rank 0's failure before NCCL said anything of its own.
EXPECTED_RANK = {("b-no-socket-interface", 1): ("unknown", None, (), ())}
LOGS = sorted(H200.glob("*.log"))


def expected(path: Path) -> tuple[str, str | None, tuple[str, ...], tuple[str, ...]]:
    scenario, rank = path.name.removesuffix(".log").rsplit(".rank", 1)
    return EXPECTED_RANK.get((scenario, int(rank)), EXPECTED[scenario])


def test_every_capture_has_an_expectation() -> None:
    scenarios = {path.name.rsplit(".rank", 1)[0] for path in LOGS}
    assert scenarios == set(EXPECTED)
    assert len(LOGS) == 2 * len(EXPECTED)


@pytest.mark.parametrize("path", LOGS, ids=[path.name for path in LOGS])
def test_every_capture(path: Path) -> None:
    transport, network, channels, warnings = expected(path)
    result = judge_transport(path.read_text())
    assert result.transport == transport
    assert result.hcas == ()  # no HCA on the capture machine
    (rank,) = result.ranks  # one process per file
    assert (rank.host, rank.ip) == ("vm", None)
    assert rank.identity == f"vm:{rank.pid}"
    assert f"vm:{rank.pid}:" in path.read_text()
    assert rank.network == network
    assert rank.networks == ((network,) if network else ())
    assert rank.channels == channels
    assert rank.uses_network == (channels == SOCKET_CHANNELS)
    assert rank.warnings == warnings
    assert rank.hcas == ()
    if network:
        assert rank.interfaces == ("eth0",)
        assert rank.nccl_version == "2.28.9+cuda13.0"


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_both_ranks_of_a_capture_together(scenario: str) -> None:
    text = "".join((H200 / f"{scenario}.rank{r}.log").read_text() for r in (0, 1))
    result = judge_transport(text)
    assert result.transport == EXPECTED[scenario][0]
    assert len(result.ranks) == 2
    assert len({rank.pid for rank in result.ranks}) == 2


def test_the_captures_were_made_by_the_script_as_it_is() -> None:
    spec = importlib.util.spec_from_file_location("capture_nccl_logs", SCRIPT)
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert set(script.SCENARIOS) == set(EXPECTED)
    for line in (H200 / "commands.txt").read_text().splitlines():
        name, _, command = line.partition(": ")
        scenario = name.removesuffix(".rank<N>.log")
        env = dict(arg.split("=", 1) for arg in shlex.split(command) if "=" in arg)
        assert env["NCCL_NVLS_ENABLE"] == "0"
        variables = {k: v for k, v in env.items() if k not in script.SAFETY_ENV}
        for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
            variables.pop(key)
        assert variables == script.SCENARIOS[scenario][1]
    rcs = (H200 / "rc.txt").read_text().split()
    assert rcs.count("rc=0") == 12 and rcs.count("rc=1") == 4


# --- synthetic logs from the brief's lines -------------------------------------------------

RAY = "\x1b[36m(RayWorkerWrapper pid={pid}, ip={ip})\x1b[0m "


def rdma_rank(
    host: str, pid: int, ip: str, hcas: str, network: str = "IB", ray: bool = True
) -> str:
    """One process's lines on a RoCE node, as vLLM's driver (no prefix) or a Ray worker."""
    prefix = RAY.format(pid=pid, ip=ip) if ray else ""
    lines = [
        "NCCL version 2.21.5+cuda12.4",
        f"NET/IB : Using {hcas} [RO]; OOB enp1s0f1np1:{ip}<0>",
        f"Using network {network}",
        f"Channel 00/0 : 0[0] -> 1[0] [send] via NET/{network}/0",
        f"Channel 01/0 : 0[0] -> 1[0] [send] via NET/{network}/1",
    ]
    return "".join(f"{prefix}{host}:{pid}:{pid + 7} [0] NCCL INFO {line}\n" for line in lines)


def socket_rank(host: str, pid: int, ip: str, ray: bool = True) -> str:
    prefix = RAY.format(pid=pid, ip=ip) if ray else ""
    lines = [
        "NET/IB : No device found.",
        f"NET/Socket : Using [0]enp1s0f1np1:{ip}<0>",
        "Using network Socket",
        "Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0",
    ]
    return "".join(f"{prefix}{host}:{pid}:{pid} [0] NCCL INFO {line}\n" for line in lines)


HCAS = "[0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE"
VLLM_NOISE = (
    "INFO 11-30 10:18:57 [parallel_state.py:1000] rank 0 in world size 2 is assigned as DP rank 0\n"
    "\x1b[36m(RayWorkerWrapper pid=2345, ip=192.168.200.13)\x1b[0m INFO 11-30 10:18:58 "
    "[pynccl.py:69] vLLM is using nccl==2.21.5\n"
)


def test_rdma_on_both_ranks_with_ray_prefixes_and_colours() -> None:
    text = (
        VLLM_NOISE
        + rdma_rank("spark1", 1234, "192.168.200.12", HCAS, ray=False)
        + rdma_rank("spark2", 2345, "192.168.200.13", HCAS)
    )
    result = judge_transport(text)
    assert result.transport == "rdma"
    assert result.hcas == ("rocep1s0f1:1", "roceP2p1s0f1:1")
    driver, worker = result.ranks
    assert (driver.host, driver.pid, driver.ip) == ("spark1", 1234, None)
    assert (worker.host, worker.pid, worker.ip) == ("spark2", 2345, "192.168.200.13")
    assert worker.identity == "192.168.200.13/spark2:2345"
    for rank in result.ranks:
        assert rank.network == "IB"
        assert rank.hcas == ("rocep1s0f1:1", "roceP2p1s0f1:1")
        assert rank.interfaces == ("enp1s0f1np1",)
        assert rank.channels == ("NET/IB/0", "NET/IB/1")
        assert rank.uses_network
        assert rank.warnings == ()
        assert rank.nccl_version == "2.21.5+cuda12.4"


def test_the_same_pid_and_hostname_on_two_nodes_are_two_ranks() -> None:
    text = rdma_rank("vllm", 77, "192.168.200.12", HCAS) + rdma_rank(
        "vllm", 77, "192.168.200.13", "[0]mlx5_0:1/IB/SHARP"
    )
    result = judge_transport(text)
    assert [rank.identity for rank in result.ranks] == [
        "192.168.200.12/vllm:77",
        "192.168.200.13/vllm:77",
    ]
    assert result.hcas == ("rocep1s0f1:1", "roceP2p1s0f1:1", "mlx5_0:1")


def test_the_ib_plugin_counts_as_rdma() -> None:
    text = rdma_rank("a", 1, "10.0.0.1", HCAS, network="IBext_v8") + rdma_rank(
        "b", 2, "10.0.0.2", HCAS, network="IBext"
    )
    result = judge_transport(text)
    assert result.transport == "rdma"
    assert [rank.networks for rank in result.ranks] == [("IBext_v8",), ("IBext",)]
    assert {rank.network for rank in result.ranks} == {"IB"}


def test_one_rank_ib_one_socket_is_mixed() -> None:
    text = rdma_rank("spark1", 1234, "192.168.200.12", HCAS, ray=False) + socket_rank(
        "spark2", 2345, "192.168.200.13"
    )
    result = judge_transport(text)
    assert result.transport == "mixed"
    assert [rank.network for rank in result.ranks] == ["IB", "Socket"]
    assert result.hcas == ("rocep1s0f1:1", "roceP2p1s0f1:1")


def test_only_sockets_is_socket_with_no_device_found_recorded() -> None:
    text = socket_rank("spark1", 1234, "192.168.200.12", ray=False) + socket_rank(
        "spark2", 2345, "192.168.200.13"
    )
    result = judge_transport(text)
    assert result.transport == "socket"
    assert result.hcas == ()
    for rank in result.ranks:
        assert rank.network == "Socket"
        assert rank.warnings == ("NET/IB : No device found",)
        assert rank.interfaces == ("enp1s0f1np1",)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        VLLM_NOISE,
        # NCCL lines, but no choice of network: never guessed from the others
        "h:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.0.0.1<0>\n"
        "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0\n",
        "h:1:1 [0] NCCL INFO Using netw",  # cut short
        "Using network IB\n",  # not from NCCL
    ],
)
def test_no_using_network_line_is_unknown(text: str) -> None:
    assert judge_transport(text).transport == "unknown"


def test_another_plugin_is_not_judged() -> None:
    result = judge_transport("h:1:1 [0] NCCL INFO Using network AWS Libfabric\n")
    assert result.transport == "unknown"
    assert result.ranks[0].network == "AWS Libfabric"


def test_the_captured_warn_line_and_what_torch_repeats() -> None:
    text = (
        "\n[2026-11-30 10:22:19] vm:778:778 [0] bootstrap.cc:114 NCCL WARN "
        "Bootstrap : no socket interface found\n"
        "[rank0]: Bootstrap : no socket interface found\n"
    )
    (rank,) = judge_transport(text).ranks
    assert (rank.identity, rank.warnings) == ("vm:778", ("Bootstrap : no socket interface found",))


def test_ray_folded_repeats_and_glued_lines() -> None:
    ray = RAY.format(pid=9, ip="10.0.0.2")
    text = (
        f"{ray}n2:9:9 [0] NCCL INFO Using network IB [repeated 3x across cluster]\n"
        # two processes writing at once: one physical line, two NCCL lines
        "n1:5:5 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>n1:6:6 [1] NCCL INFO Using "
        "network Socket\n"
        # colour codes whose ESC was lost, and Windows line ends
        "[36m(RayWorkerWrapper pid=9, ip=10.0.0.2)[0m n2:9:9 [0] NCCL INFO NET/IB : Using "
        "[0]mlx5_1:1/IB ; OOB ib0:10.0.0.2<0>\r\n"
    )
    result = judge_transport(text)
    assert result.transport == "mixed"
    ib, first, second = result.ranks
    assert (ib.identity, ib.networks, ib.hcas) == ("10.0.0.2/n2:9", ("IB",), ("mlx5_1:1",))
    assert ib.interfaces == ("ib0",)
    assert (first.identity, first.interfaces, first.network) == ("n1:5", ("eth0",), None)
    assert (second.identity, second.network) == ("n1:6", "Socket")


def test_vllm_worker_prefix_has_no_ip() -> None:
    text = "(Worker_TP1 pid=5678) node:5678:5690 [1] NCCL INFO Using network Socket\n"
    (rank,) = judge_transport(text).ranks
    assert (rank.identity, rank.ip, rank.network) == ("node:5678", None, "Socket")


def test_as_dict_is_json() -> None:
    result = judge_transport(rdma_rank("spark2", 2345, "192.168.200.13", HCAS))
    data = json.loads(json.dumps(result.as_dict()))
    assert data["transport"] == "rdma"
    assert data["hcas"] == ["rocep1s0f1:1", "roceP2p1s0f1:1"]
    (rank,) = data["ranks"]
    assert rank["identity"] == "192.168.200.13/spark2:2345"
    assert rank["ip"] == "192.168.200.13"
    assert rank["pid"] == 2345
    assert rank["network"] == "IB"
    assert rank["channels"] == ["NET/IB/0", "NET/IB/1"]
    assert rank["uses_network"] is True
    assert judge_transport("").as_dict() == {"transport": "unknown", "hcas": [], "ranks": []}


def test_a_long_hostile_line_is_quick() -> None:
    line = "a" * 200_000 + ":1:1 [0]" + ("(x pid=1," * 20_000) + "1:" * 50_000
    start = time.monotonic()
    assert judge_transport(line).transport == "unknown"
    assert time.monotonic() - start < 5


# --- never raises --------------------------------------------------------------------------

FRAGMENTS = [
    line
    for path in LOGS[:4]
    for line in path.read_text().splitlines(keepends=True)
    if "NCCL" in line
] + [
    RAY.format(pid=1, ip="10.0.0.1"),
    "\x1b[",
    "(RayWorkerWrapper pid=",
    ", ip=",
    ") ",
    "h:1:1 [0] NCCL INFO ",
    "h:99999999999999999999:1 [0] NCCL INFO Using network IB\n",
    " NCCL WARN ",
    "Using network ",
    "NET/IB : Using [0]",
    "; OOB ",
    " [repeated 2x across cluster]",
    "\r",
    "\n",
]


@settings(derandomize=True, database=None, max_examples=300)
@given(st.text())
def test_never_raises_on_any_text(text: str) -> None:
    check(judge_transport(text))


@settings(derandomize=True, database=None, max_examples=300)
@given(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=20)), max_size=30))
def test_never_raises_on_pieces_of_real_lines(pieces: list[str]) -> None:
    check(judge_transport("".join(pieces)))


def check(result: NcclTransport) -> None:
    assert result.transport in ("rdma", "socket", "mixed", "unknown")
    assert all(isinstance(rank, RankTransport) for rank in result.ranks)
    assert len(set(result.hcas)) == len(result.hcas)
    json.dumps(result.as_dict())


def test_lines_quoted_without_nccls_prefix_are_judged_as_one_process() -> None:
    """The brief, the docs and operators quote NCCL's lines without its host:pid:tid prefix."""
    quoted = (
        "NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; "
        "OOB enp1s0f1np1:192.168.200.12<0>\n"
        "NCCL INFO Using network IB\n"
    )
    verdict = judge_transport(quoted)
    assert verdict.transport == "rdma"
    assert verdict.hcas == ("rocep1s0f1:1", "roceP2p1s0f1:1")
    (rank,) = verdict.ranks
    assert rank.identity == "(no process prefix)"
    sockets = (
        "NCCL INFO NET/Socket : Using [0]enp1s0f1np1:192.168.200.12<0>\n"
        "NCCL INFO Using network Socket\n"
    )
    assert judge_transport(sockets).transport == "socket"
