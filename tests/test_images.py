"""Any image runs (issues 14 and 23): the image's ENTRYPOINT is kept where it runs its
arguments, and replaced by our program where it is a program.

Docker appends a container's command to the image's ENTRYPOINT: vllm/vllm-openai declares
``["vllm", "serve"]`` (replaced), NGC's vLLM a script that prepares the environment (the CUDA
forward-compatibility libraries; GB10 needs them) and ends by running its arguments on the
argument branch of an if/else (kept), community
builds none; and vLLM images from 0.18 on carry no Ray. The bed has an image of each shape
(tests/testbed/image.py), NGC's failing as a GB10 does when its script is skipped.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.test_plan import named
from tests.testbed import image
from tests.testbed.bed import SERVED_NAME, TestBed
from tests.testbed.procs import free_port
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.dry_run import plan_lines
from vllm_redeploy.launch import ImageEntrypoint, launch_fingerprint, plan_for
from vllm_redeploy.launch import ray as ray_backend
from vllm_redeploy.launch.entrypoint import runs_arguments
from vllm_redeploy.launch.group import container_argv, engine_container, split_argv
from vllm_redeploy.launch.ray import (
    RAY_CHECK_ARGV,
    engine_spec,
    ray_check_spec,
    ray_container,
    ray_spec,
    ray_start_args,
    vllm_serve_args,
)
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.nodes.containers import ContainerSpec, cluster_labels
from vllm_redeploy.probe import run_probe

EXAMPLE = Path(__file__).resolve().parent.parent / "cluster.example.toml"
FAST = {"VRD_LOAD_SECONDS": "1"}
BANNER = "== vLLM =="
NGC = Path(__file__).resolve().parent / "fixtures" / "ngc"
KEPT = (
    "the image's ENTRYPOINT /opt/nvidia/nvidia_entrypoint.sh is kept: it prepares the "
    'environment, then runs its arguments (exec "$@")'
)


# --- the plan, no servers -------------------------------------------------------------------


def example(tmp_path: Path, interfaces_differ: bool) -> ClusterConfig:
    text = EXAMPLE.read_text()
    if interfaces_differ:  # the worker cabled on the other port: the engine gets its sh wrapper
        text = named(worker=("enP2p1s0f1np1", "roceP2p1s0f1"))
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return load_config(path, env_file=None)


@pytest.mark.parametrize("interfaces_differ", [False, True], ids=["same-nics", "sh-wrapper"])
def test_every_container_names_its_own_program(tmp_path: Path, interfaces_differ: bool) -> None:
    config = example(tmp_path, interfaces_differ)
    for node in config.nodes:
        spec = ray_spec(node, config)
        assert spec.entrypoint == ["ray"] and container_argv(spec) == ray_start_args(node, config)
    check = ray_check_spec(config)
    assert check.entrypoint == ["sh"] and container_argv(check) == list(RAY_CHECK_ARGV)
    engine, serve = engine_spec(config), vllm_serve_args(config)
    if interfaces_differ:  # sh writes vLLM's copy-list file, then execs `vllm serve`
        assert engine.entrypoint == ["sh"] and engine.command[0] == "-c"
        assert container_argv(engine)[-len(serve) :] == serve
    else:
        assert engine.entrypoint == ["vllm"] and container_argv(engine) == serve


def test_split_argv() -> None:
    assert split_argv(["ray", "start", "--block"]) == (["ray"], ["start", "--block"])
    assert split_argv(("true",)) == (["true"], [])
    with pytest.raises(ValueError, match="program"):
        split_argv([])


def test_a_cluster_launched_without_entrypoint_is_not_taken_for_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same words launched the old way (image's ENTRYPOINT in front) fingerprint otherwise:
    `ensure` redeploys a cluster started before explicit entrypoints."""
    config = example(tmp_path, interfaces_differ=False)
    current = launch_fingerprint(config, "ray")
    explicit = ray_backend.engine_spec

    def old_shape(config: ClusterConfig, *args: Any) -> ContainerSpec:
        spec = explicit(config, *args)
        return replace(spec, entrypoint=None, command=container_argv(spec))

    monkeypatch.setattr(ray_backend, "engine_spec", old_shape)
    assert launch_fingerprint(config, "ray") != current


@pytest.mark.parametrize(
    ("script", "runs"),
    [
        ('#!/bin/sh\necho banner\nexec "$@"\n', True),
        ('#!/bin/bash\nset -e\n[ $# -gt 0 ] || set -- /bin/bash\nexec "${@}"\n# done\n', True),
        ('#!/bin/sh\nsource /etc/profile; exec "$@"\n', True),
        # NGC's structure (tests/fixtures/ngc): the if/else ending, on one line and on five
        ((NGC / "nvidia_entrypoint.sh").read_text(), True),
        ((NGC / "nvidia_entrypoint.multiline.sh").read_text(), True),
        ('if [ "$#" -gt 0 ]; then exec "$@"; else exec /bin/bash; fi', True),
        ('if (( $# == 0 )); then\n exec bash\nelse exec "${@}"\nfi', True),
        ('if [[ $# -eq 0 ]]; then exec "$@"; else exec "/bin/bash"; fi', False),  # wrong branch
        ('if [[ -z "$X" ]]; then exec /bin/bash; else exec "$@"; fi', False),  # not the count
        ('if [[ $# -eq 0 ]]; then exec /bin/bash; else exec "$@"; fi\necho after', False),
        ('#!/bin/sh\nexec "$@"\necho after\n', False),  # its last command is another
        ('#!/bin/sh\nexec vllm serve "$@"\n', False),  # a program with our words as arguments
        ("#!/bin/sh\nexec $@\n", False),  # unquoted: the words would be split again
        ("", False),
    ],
)
def test_an_entrypoint_runs_its_arguments_only_when_it_ends_by_running_them(
    script: str, runs: bool
) -> None:
    assert runs_arguments(script) is runs


def test_a_script_that_runs_its_arguments_is_kept_in_every_container(tmp_path: Path) -> None:
    config = example(tmp_path, interfaces_differ=False)
    script = (NGC / "nvidia_entrypoint.sh").read_text()
    ngc = ImageEntrypoint.of(["/opt/nvidia/nvidia_entrypoint.sh"], script)
    program = ImageEntrypoint.of(["vllm", "serve"], None)
    for backend in ("ray", "mp"):
        explicit = plan_for(backend, config, entrypoint=program)
        kept = plan_for(backend, config, entrypoint=ngc)
        assert kept.fingerprint == explicit.fingerprint  # what runs is still recognised
        for mine, theirs in zip(explicit.members, kept.members, strict=True):
            assert mine.spec.entrypoint and theirs.spec.entrypoint is None
            assert list(theirs.spec.command) == container_argv(mine.spec)
    assert ngc.why() == KEPT
    assert program.why() == (
        "the image's ENTRYPOINT vllm serve is replaced: it does not run its arguments"
    )


def test_the_dry_run_shows_each_entrypoint(tmp_path: Path) -> None:
    lines = plan_lines(example(tmp_path, interfaces_differ=False), inspect_nodes=False)
    text = "\n".join(lines)
    # backend auto: the Ray launch (2 Ray containers, the engine), then the mp one (2 vllm)
    assert text.count("entrypoint: ray (") == 2 and text.count("entrypoint: vllm (") == 3
    engine_line = next(
        i for i, line in enumerate(lines) if "start container" in line and "engine" in line
    )
    assert "vllm serve Qwen/Qwen3.5-122B-A10B-FP8" in lines[engine_line]
    assert lines[engine_line + 1].strip().startswith("entrypoint: vllm")


# --- on the bed -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_bed(prefect_api: None) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=161)
    yield bed
    bed.down()


@pytest.fixture(scope="module")
def plain_bed(prefect_api: None) -> Iterator[TestBed]:
    bed = make_bed(2, "h200", first_ip=171)
    yield bed
    bed.down()


def run_flow(bed: TestBed, tag: str, backend: str = "auto") -> Any:
    path = bed.write_config(
        bed.root / "run.toml", vllm={"image": tag, "env": FAST, "backend": backend}
    )
    return redeploy_vllm_cluster(str(path), "redeploy", return_state=True)


def failure(state: Any) -> str:
    assert state.is_failed(), f"expected a failed run, got {state}"
    return str(state.result(raise_on_failure=False))


def all_containers(bed: TestBed) -> dict[str, dict[str, tuple[str, str]]]:
    """Per node: container name -> (ID, status), running or not."""
    found = {}
    for node in bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            found[node.name] = {c.name: (c.id, c.status) for c in client.containers.list(all=True)}
    return found


def run_once(
    bed: TestBed, tag: str, command: list[str], entrypoint: list[str] | None = None
) -> tuple[int, str]:
    """Run a container of ``tag`` on the first node to its end: (exit code, log)."""
    with contextlib.closing(bed.nodes[0].engine.client()) as client:
        container = client.containers.run(
            tag,
            command,
            entrypoint=entrypoint,
            volumes=image.runtime_mounts(),
            network_mode="host",
            detach=True,
        )
        try:
            code = container.wait(timeout=60)["StatusCode"]
            return code, container.logs().decode()
        finally:
            container.remove(force=True)


@pytest.mark.integration
def test_the_bed_images_are_shaped_like_the_real_ones(plain_bed: TestBed) -> None:
    for made in image.BED_IMAGES:
        ids = set()
        for node in plain_bed.nodes:
            with contextlib.closing(node.engine.client()) as client:
                found = client.images.get(made.tag)
            ids.add(found.id)
            assert found.attrs["Config"]["Entrypoint"] == (
                list(made.entrypoint) if made.entrypoint else None
            )
        assert len(ids) == 1, f"{made.tag} differs between nodes: {ids}"
    # NGC's entrypoint prints its banner, then runs the command it was given.
    code, log = run_once(plain_bed, image.NGC_IMAGE, ["echo", "the command ran"])
    assert code == 0 and BANNER in log and "NVIDIA Release 25." in log, log
    assert "Deep Learning Container License" in log and log.endswith("the command ran\n"), log


@pytest.mark.integration
def test_the_image_without_ray_has_none_but_runs_vllm(plain_bed: TestBed) -> None:
    code, log = run_once(plain_bed, image.NO_RAY_IMAGE, ["-c", "command -v ray"], ["sh"])
    assert code != 0 and log == "", (code, log)
    code, log = run_once(plain_bed, image.NO_RAY_IMAGE, ["-c", "import ray"], ["python3"])
    assert code == 1 and "No module named 'ray'" in log, log
    # The vLLM stand-in serves there on one GPU (no Ray needed), from the image's own entrypoint.
    node = plain_bed.nodes[0]
    port = free_port(node.ip)
    name = f"noray-{uuid.uuid4().hex[:6]}"
    with contextlib.closing(node.engine.client()) as client:
        client.containers.run(
            image.NO_RAY_IMAGE,
            [str(plain_bed.model_dir), "--host", node.ip, "--port", str(port)],
            name=name,
            environment={"VRD_LOAD_SECONDS": "0"},
            volumes=[*image.runtime_mounts(), plain_bed.model_mount],
            network_mode="host",
            detach=True,
        )
        try:
            assert _answers(f"http://{node.ip}:{port}/v1/models", 30), (
                client.containers.get(name).logs().decode()
            )
        finally:
            client.containers.get(name).remove(force=True)


def _answers(url: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        time.sleep(0.3)
    return False


@pytest.mark.integration
def test_without_an_explicit_entrypoint_the_image_runs_vllm_serve_ray_start(
    plain_bed: TestBed,
) -> None:
    """The original bug: the command alone, and Docker runs `vllm serve ray start ...`."""
    path = plain_bed.write_config(
        plain_bed.root / "old.toml", vllm={"image": image.VLLM_OPENAI_IMAGE}
    )
    config = load_config(path, env_file=None)
    worker = config.nodes[1]
    spec = ray_spec(worker, config)
    name = f"old-shape-{uuid.uuid4().hex[:6]}"
    old_shape = replace(spec, name=name, entrypoint=None, command=container_argv(spec))
    with NodeAccess(worker, config) as node:
        node.docker.run_detached(old_shape)
        try:
            code = node.docker.wait(name, timeout_s=30)
            log = node.docker.logs_tail(name)
            with contextlib.closing(plain_bed.node(worker.name).engine.client()) as client:
                attrs = client.containers.get(name).attrs
        finally:
            node.docker.remove(name)
    assert [attrs["Path"], *attrs["Args"]] == ["vllm", "serve", *ray_start_args(worker, config)]
    assert code == 2 and "unrecognized arguments: start --block" in log, log
    assert spec.entrypoint == ["ray"]  # what the product passes now


@pytest.mark.integration
def test_an_image_without_ray_fails_preflight_and_starts_nothing(plain_bed: TestBed) -> None:
    """With backend = "ray" (auto would take the mp backend: tests/test_mp_backend.py)."""
    before = all_containers(plain_bed)
    message = failure(run_flow(plain_bed, image.NO_RAY_IMAGE, backend="ray"))
    assert "preflight" in message and f"image {image.NO_RAY_IMAGE}" in message, message
    assert "an image that carries Ray" in message, message
    assert all_containers(plain_bed) == before  # nothing started, nothing stopped
    config = load_config(plain_bed.root / "run.toml", env_file=None)
    ours = [f"{k}={v}" for k, v in cluster_labels(config.name).items()]
    for node in plain_bed.nodes:
        with contextlib.closing(node.engine.client()) as client:
            found = client.containers.list(all=True, filters={"label": ours})
            assert found == [], f"{node.name}: {[c.name for c in found]}"


@pytest.mark.integration
@pytest.mark.parametrize(
    "tag", [image.VLLM_OPENAI_IMAGE, image.NGC_IMAGE], ids=["vllm-openai", "ngc"]
)
def test_the_cluster_serves_from_an_image_with_an_entrypoint(serve_bed: TestBed, tag: str) -> None:
    # Ray's, named: its two kinds of container (auto would take mp: these vLLMs have --nnodes).
    state = run_flow(serve_bed, tag, backend="ray")
    assert state.is_completed(), failure(state)
    assert state.result()["probe"]["healthy"]
    verdict = run_probe(f"http://{serve_bed.nodes[0].ip}:30000", SERVED_NAME, "Hi.", 50, 0.0, 10)
    assert verdict.healthy, verdict
    config = load_config(serve_bed.root / "run.toml", env_file=None)
    made = next(m for m in image.BED_IMAGES if m.tag == tag)
    kept = tag == image.NGC_IMAGE  # its script runs its arguments: our program is its command
    for node in config.nodes:
        with contextlib.closing(serve_bed.node(node.name).engine.client()) as client:
            assert client.images.get(tag).attrs["Config"]["Entrypoint"] == list(
                made.entrypoint or ()
            )
            ray = client.containers.get(ray_container(config))
            # Docker reports what it runs: the entrypoint (the image's, or ours), then the rest.
            ran = [ray.attrs["Path"], *ray.attrs["Args"]]
            assert ray.attrs["Config"]["Entrypoint"] == (
                [image.NGC_ENTRYPOINT] if kept else ["ray"]
            )
            assert ran == ([image.NGC_ENTRYPOINT] if kept else []) + ray_start_args(node, config)
            assert (BANNER in ray.logs().decode()) is kept
            if node is config.head:
                engine = client.containers.get(engine_container(config))
                ran = [engine.attrs["Path"], *engine.attrs["Args"]]
                assert ran == ([image.NGC_ENTRYPOINT] if kept else []) + vllm_serve_args(config)
                assert (BANNER in engine.logs().decode()) is kept
    if kept:
        why = KEPT
        assert f"node-1: {why}" in state.result()["notes"]
        before = all_containers(serve_bed)
        lines = plan_lines(config)  # reads the script from a container it never starts
        assert all_containers(serve_bed) == before  # and leaves none behind
        assert f"    entrypoint: /opt/nvidia/nvidia_entrypoint.sh ({why})" in lines, lines
