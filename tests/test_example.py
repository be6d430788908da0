"""The shipped cluster.example.toml runs as copied: the README scenario on the strict bed (two
GB10 nodes with RoCE twins, the login ``nvidia`` with sudo for the old stack's unit only on
node-2, node-2 behind the Docker 29 gate, an NGC-shaped image with Ray, the model as
`hf download` leaves it).

Only what must differ on this machine is changed (BED_CHANGES, each with its reason); every other
line of the example is used as written, and the test checks that it was. When someone edits the
example, this test says whether it still runs.
"""

from __future__ import annotations

import resource
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import keep_for_notes, make_bed
from tests.test_flow import containers
from tests.testbed import image
from tests.testbed.bed import EMULATED, GPU_TOTAL_MIB, TestBed, ray_port, to_toml
from vllm_redeploy.config import load_config
from vllm_redeploy.status import collect_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
EXAMPLE = Path(__file__).resolve().parents[1] / "cluster.example.toml"
_HARD = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]


@pytest.fixture(scope="module")
def example_bed(prefect_api: str) -> Iterator[TestBed]:
    bed = make_bed(
        2,
        "gb10",
        first_ip=121,
        vllm_image=image.NGC_IMAGE,
        rdma={"node-1": "both", "node-2": "both"},
        docker29=("node-2",),
        sudo={"node-2": "units"},
    )
    yield bed
    bed.down()


def bed_changes(bed: TestBed, example: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """Dotted key -> (the bed's value, why it cannot be the example's)."""
    a, b = bed.nodes
    head = a.ip
    changes: dict[str, tuple[Any, str]] = {
        "nodes.0.address": (a.ip, "the bed's nodes are loopback addresses"),
        "nodes.1.address": (b.ip, "the bed's nodes are loopback addresses"),
        "nodes.0.ssh_port": (a.spec.ssh_port, "each bed node's sshd has its own port"),
        "nodes.1.ssh_port": (b.spec.ssh_port, "each bed node's sshd has its own port"),
        "ssh.known_hosts": (str(bed.known_hosts), "the bed's host keys"),
        "ssh.key_file": (str(bed.client_key), "the bed's client key (commented in the example)"),
        "vllm.image": (image.NGC_IMAGE, "NGC's shape built here: nvcr.io cannot be pulled"),
        "vllm.hf_cache": (str(bed.hub), "the bed's Hugging Face cache"),
        "vllm.host": (head, "beds side by side serve on their own addresses"),
        "vllm.gpu_device_request": (False, "no GPUs here: the stand-ins emulate them"),
        "vllm.volumes": (
            [
                *example["vllm"].get("volumes", []),
                *image.runtime_mounts(),
                *(f"{bed.root / d}:{bed.root / d}" for d in EMULATED),
                *(f"{n.root / 'proc'}:{n.root / 'proc'}" for n in bed.nodes),
                "/proc/meminfo:/proc/meminfo:ro",
            ],
            "the example's, and what emulates the GPUs, the HCAs and each node's memory",
        ),
        **{
            f"vllm.env.{k}": (v, "the emulated GB10 and the stand-in's load time")
            for k, v in {
                "VRD_UNIFIED_MEMORY": "1",
                "VRD_BED_ROOT": str(bed.root),
                "VRD_GPU_TOTAL_MIB": str(GPU_TOTAL_MIB["gb10"]),
                "VRD_LOAD_SECONDS": "3",
            }.items()
        },
        "ray.port": (ray_port(head), "Ray's GCS listens on all addresses: beds side by side"),
        "ray.object_store_bytes": (78643200, "Ray's smallest: 2 cores and 24 GiB here"),
        "ray.extra_args": (["--num-cpus=1"], "2 cores here"),
        "cache.dir": (str(bed.root / "compile-cache"), "the nodes share this machine's disk"),
    }
    if _HARD != resource.RLIM_INFINITY:
        changes["fabric.memlock_bytes"] = (_HARD, "this machine's hard memlock limit")
    return changes


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        items: Any = data.items()
    elif isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        items = ((str(i), x) for i, x in enumerate(data))
    else:
        return {prefix: data}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat |= flatten(value, f"{prefix}.{key}" if prefix else key)
    return flat


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    here: Any = data
    for part in parents:
        here = here[int(part)] if isinstance(here, list) else here.setdefault(part, {})
    here[last] = value


def touched(key: str, changes: dict[str, Any]) -> bool:
    """A change sets this key, a key below it, or a key above it (an empty table's)."""
    return any(key == c or key.startswith(f"{c}.") or c.startswith(f"{key}.") for c in changes)


@pytest.fixture(scope="module")
def copied(example_bed: TestBed) -> Path:
    example = tomllib.loads(EXAMPLE.read_text())
    data = tomllib.loads(EXAMPLE.read_text())
    changes = bed_changes(example_bed, example)
    for dotted, (value, _why) in changes.items():
        set_dotted(data, dotted, value)
    path = example_bed.root / "cluster.toml"
    path.write_text(to_toml(data))
    written = flatten(tomllib.loads(path.read_text()))
    as_written = {k: v for k, v in flatten(example).items() if not touched(k, changes)}
    assert as_written and {k: written[k] for k in as_written} == as_written
    keep_for_notes(
        "example-lines",
        "\n".join(
            [f"as written: {k} = {v!r}" for k, v in sorted(as_written.items())]
            + [f"changed: {k} ({why})" for k, (_, why) in changes.items()]
        ),
    )
    return path


def test_the_shipped_example_runs_the_readme_scenario(example_bed: TestBed, copied: Path) -> None:
    state = redeploy_vllm_cluster(str(copied), "redeploy", return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    result = state.result()
    keep_for_notes("example-run", result["summary"])
    assert result["probe"]["healthy"], result["probe"]
    assert "NCCL between the nodes: **rdma**." in result["summary"]

    config = load_config(copied, env_file=None)
    status = collect_status(config)
    # auto: the example's NGC 26.03 is vLLM 0.17.1, whose `vllm serve` has --nnodes: no Ray.
    assert "- backend mp (the image's vLLM has --nnodes" in result["summary"]
    assert status.healthy and status.backend == "mp", status.problems

    before = containers(example_bed)
    again = redeploy_vllm_cluster(str(copied), "ensure", return_state=True)
    assert again.is_completed(), again.result(raise_on_failure=False)
    assert again.result()["action"] == "already healthy: nothing changed"
    assert containers(example_bed) == before
