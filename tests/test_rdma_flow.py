"""RDMA really used, end to end (issue 14): the flow on a DGX-Spark-like bed whose nodes have RoCE
twins (tests/testbed/fabric.py), NCCL's choice judged from every rank's log by the product.

One bed: node-1 and node-2 with both twins ACTIVE, node-3 a server without RDMA. Each test runs the
real flow against the session's Prefect server with a cluster of some of these nodes.
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes, make_bed
from tests.testbed.bed import TestBed, to_toml
from vllm_redeploy.nodes.containers import LABEL_MANAGED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CLI = Path(sys.executable).parent / "vllm-redeploy"
RDMA = {"node-1": "both", "node-2": "both", "node-3": "none"}
# The most memlock this host lets a container have: an unlimited one where it can (what a real
# Spark gets); with IPC_LOCK, which RDMA containers always get, the kernel does not count it.
_HARD = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
MEMLOCK = -1 if _HARD == resource.RLIM_INFINITY else _HARD


@pytest.fixture(scope="module")
def spark_bed(prefect_api: str) -> Iterator[TestBed]:
    bed = make_bed(3, "gb10", first_ip=181, rdma=RDMA, backend="ray")  # Ray's containers' devices
    yield bed
    bed.down()


@pytest.fixture(autouse=True)
def no_group_left(spark_bed: TestBed) -> Iterator[None]:
    yield
    for node in spark_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            for c in client.containers.list(all=True, filters={"label": LABEL_MANAGED}):
                c.remove(force=True)


def write(bed: TestBed, nodes: list[str], name: str, **sections: dict[str, Any]) -> Path:
    """A cluster of some of the bed's nodes (node-1 the head), with ``sections`` merged in."""
    data = bed.settings()
    data["nodes"] = [n for n in data["nodes"] if n["name"] in nodes]
    data["vllm"]["tensor_parallel_size"] = len(nodes)
    data["vllm"]["env"]["VRD_LOAD_SECONDS"] = "1"
    data["fabric"] = {"memlock_bytes": MEMLOCK}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = bed.root / f"{name}.toml"
    path.write_text(to_toml(data))
    return path


def run(path: Path) -> Any:
    return redeploy_vllm_cluster(str(path), "redeploy", return_state=True)


def host_config(bed: TestBed, node: str, container: str) -> dict[str, Any]:
    with contextlib.closing(bed.node(node).engine.client()) as client:
        return client.containers.get(container).attrs["HostConfig"]


def test_rdma_nodes_give_their_containers_the_hcas_and_nccl_uses_them(
    spark_bed: TestBed,
) -> None:
    state = run(write(spark_bed, ["node-1", "node-2"], "rdma"))
    assert state.is_completed(), state.result(raise_on_failure=False)
    result = state.result()
    assert "transport" in result["steps"]
    summary = result["summary"]
    keep_for_notes("summary-rdma", summary)
    assert "NCCL between the nodes: **rdma**." in summary
    for node in ("node-1", "node-2"):
        fab = spark_bed.node(node).fabric
        assert fab is not None
        config = host_config(spark_bed, node, "vllm-redeploy-bed-ray")
        assert [d["PathOnHost"] for d in config["Devices"]] == ["/dev/infiniband"]
        assert config["CapAdd"] == ["IPC_LOCK"]
        limits = {u["Name"]: u["Hard"] for u in config["Ulimits"]}
        assert limits == {"memlock": MEMLOCK, "stack": 67108864}
        assert not config["Privileged"]
        row = next(line for line in summary.splitlines() if line.startswith(f"| {node} | rdma"))
        assert all(hca in row for hca in fab.hca_names), row


def test_without_the_devices_nccl_falls_back_and_the_run_fails_saying_what_to_fix(
    spark_bed: TestBed,
) -> None:
    path = write(
        spark_bed, ["node-1", "node-2"], "withheld", fabric={"rdma": "off", "require_rdma": True}
    )
    state = run(path)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    keep_for_notes("failure-rdma-required", message)
    assert message.startswith("transport: NCCL did not use RDMA on every node")
    assert "node-1: socket" in message and "node-2: socket" in message
    assert "its containers got no RDMA devices" in message
    assert "require_rdma = false" in message
    with contextlib.closing(spark_bed.node("node-1").engine.client()) as client:
        assert client.containers.list(filters={"label": LABEL_MANAGED}) == []  # torn down


def test_without_the_devices_and_not_required_the_run_serves_over_sockets(
    spark_bed: TestBed,
) -> None:
    state = run(write(spark_bed, ["node-1", "node-2"], "sockets", fabric={"rdma": "off"}))
    assert state.is_completed(), state.result(raise_on_failure=False)
    summary = state.result()["summary"]
    keep_for_notes("summary-socket", summary)
    assert "NCCL between the nodes: **socket**." in summary
    assert host_config(spark_bed, "node-2", "vllm-redeploy-bed-ray")["Devices"] in (None, [])


def test_a_node_without_hcas_makes_it_mixed(spark_bed: TestBed) -> None:
    path = write(spark_bed, ["node-1", "node-3"], "mixed")
    state = run(path)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "node-1: rdma" in message and "node-3: socket" in message, message
    assert "node-3: its containers got no RDMA devices" in message
    # Not required: served, and said so.
    state = run(write(spark_bed, ["node-1", "node-3"], "mixed-ok", fabric={"require_rdma": False}))
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert "NCCL between the nodes: **mixed**." in state.result()["summary"]


def test_nodes_shows_the_discovered_fabric_and_the_dry_run_the_options(
    spark_bed: TestBed,
) -> None:
    path = write(spark_bed, ["node-1", "node-2", "node-3"], "shown")
    shown = subprocess.run(
        [str(CLI), "nodes", "-c", str(path), "--json"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    reports = {r["name"]: r for r in json.loads(shown.stdout)}
    for node in ("node-1", "node-2"):
        fab = spark_bed.node(node).fabric
        assert fab is not None
        found = reports[node]["fabric"]
        assert found["interface"] == fab.interface and found["twins"] == [fab.twin]
        assert [h["state"] for h in found["hcas"]] == ["ACTIVE", "ACTIVE"]
        assert found["nccl_ib_hca"] == "=" + ",".join(f"{h}:1" for h in fab.hca_names)
    assert reports["node-3"]["fabric"]["hcas"] == []
    dry = subprocess.run(
        [str(CLI), "run", "--dry-run", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    text = dry.stdout
    assert "devices: /dev/infiniband; capabilities: IPC_LOCK; ulimits: memlock=" in text
    assert "devices: none; capabilities: none added" in text  # node-3's containers
    assert "entrypoint: ray (set explicitly" in text
    assert "NCCL_IB_HCA==" in text and "NCCL_DEBUG=INFO" in text
