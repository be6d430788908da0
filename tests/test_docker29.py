"""A cluster upgraded in part: node-2's engine answers as Docker 29 (tests/testbed/docker29.py, in
front of the bed's Docker 20.10), node-1's is 20.10. Docker 29 refuses API versions below 1.44
and, with the containerd image store, reports an image's manifest digest as its ``Id`` where the
classic store reports its config's (docker/cli#6670). The product negotiates the version with
each engine and compares images by what they hold, so the README scenario runs on both kinds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import docker
import docker.errors
import httpx
import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.testbed import image
from tests.testbed.bed import TestBed
from vllm_redeploy.config import load_config
from vllm_redeploy.nodes.access import NodeAccess

pytestmark = pytest.mark.integration
FAST = {"VRD_LOAD_SECONDS": "1"}


@pytest.fixture(scope="module")
def mixed_bed(prefect_api: None) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=211, docker29=("node-2",))
    try:
        yield bed
    finally:
        bed.down()


def gate_url(bed: TestBed) -> str:
    gate = bed.nodes[1].gate
    assert gate is not None
    return gate.url


def test_the_gate_answers_as_docker_29(mixed_bed: TestBed) -> None:
    with contextlib.closing(
        docker.DockerClient(base_url=gate_url(mixed_bed), version="1.41")
    ) as old:
        with pytest.raises(docker.errors.APIError) as refused:
            old.containers.list()
        assert refused.value.status_code == 400
        assert refused.value.explanation == (
            "client version 1.41 is too old. Minimum supported API version is 1.44, please "
            "upgrade your client to a newer version"
        )
        version = old.api.version(api_version=False)
        assert (version["Version"], version["ApiVersion"], version["MinAPIVersion"]) == (
            "29.0.4", "1.52", "1.44",
        )  # fmt: skip
    transport = httpx.HTTPTransport(uds=gate_url(mixed_bed).removeprefix("unix://"))
    with httpx.Client(transport=transport, base_url="http://docker") as raw:
        ping = raw.get("/_ping")
        assert ping.status_code == 200 and ping.headers["Api-Version"] == "1.52"
    # The containerd store's ID of an image is not the classic store's, for the same image.
    with contextlib.closing(
        docker.DockerClient(base_url=gate_url(mixed_bed), version="1.45")
    ) as new:
        gated = new.images.get(image.BED_IMAGE).id
    with contextlib.closing(mixed_bed.nodes[0].engine.client()) as classic:
        assert gated != classic.images.get(image.BED_IMAGE).id


def test_the_product_speaks_each_engines_version_and_compares_content(mixed_bed: TestBed) -> None:
    config = load_config(mixed_bed.config_path, env_file=None)
    found: dict[str, Any] = {}
    for node in config.nodes:
        with NodeAccess(node, config) as access:
            found[node.name] = (access.docker.image_id(image.BED_IMAGE), access.docker.api_version)
    assert found["node-1"][1] == "1.41" and found["node-2"][1] == "1.45", found
    assert found["node-1"][0] == found["node-2"][0] is not None, found


def test_the_readme_scenario_runs_on_both_kinds_of_engine(mixed_bed: TestBed) -> None:
    path = mixed_bed.write_config(mixed_bed.root / "run.toml", vllm={"env": FAST})
    state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    assert state.is_completed(), str(state.result(raise_on_failure=False))
    assert state.result()["probe"]["healthy"]


def test_an_image_copied_to_the_docker_29_node_is_taken_for_the_same(mixed_bed: TestBed) -> None:
    """After `docker save | docker load` onto node-2 its engine shows another ID for the same
    image: sync's check after the copy compares what the image holds."""
    with contextlib.closing(mixed_bed.nodes[1].engine.client()) as client:
        client.images.remove(mixed_bed.vllm_image, force=True, noprune=True)
    path = mixed_bed.write_config(
        mixed_bed.root / "sync.toml", vllm={"env": FAST}, sync={"image": "auto", "model": "off"}
    )
    state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
    assert state.is_completed(), str(state.result(raise_on_failure=False))
    assert "| node-2 | image |" in state.result()["summary"]
    with contextlib.closing(mixed_bed.nodes[1].engine.client()) as client:
        assert client.images.get(mixed_bed.vllm_image)
