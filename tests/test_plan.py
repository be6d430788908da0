"""What the flow launches, derived from the configuration (no servers needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.launch import launch_fingerprint, plan_for
from vllm_redeploy.launch.backend import Backend
from vllm_redeploy.launch.choose import (
    BACKENDS,
    asks_the_image,
    backend_problem,
    candidates,
    choose,
    refusal,
    register,
)
from vllm_redeploy.launch.fingerprint import launch_changed, ray_era_fingerprint
from vllm_redeploy.launch.group import NodeFabric, container_argv
from vllm_redeploy.launch.ray import engine_spec, parse_members, ray_spec, vllm_serve_args
from vllm_redeploy.parsers.vllm_log import last_load_progress

EXAMPLE = Path(__file__).resolve().parent.parent / "cluster.example.toml"


PLAYBOOK = ("enp1s0f1np1", "rocep1s0f1")  # NVIDIA's two-Spark playbook cables the f1 port


def named(head: tuple[str, str] = PLAYBOOK, worker: tuple[str, str] = PLAYBOOK) -> str:
    """The example with each node's fabric interface and HCA named (the example finds them)."""
    a, b, rest = EXAMPLE.read_text().split("gpus = 1\n")
    lines = [
        f'gpus = 1\nfabric_interfaces = ["{i}"]\nib_hcas = ["{h}"]\n' for i, h in (head, worker)
    ]
    return a + lines[0] + b + lines[1] + rest


def example() -> ClusterConfig:
    return load_config(EXAMPLE, env_file=None)


def example_named(tmp_path: Path, worker: tuple[str, str] = PLAYBOOK) -> ClusterConfig:
    path = tmp_path / "c.toml"
    path.write_text(named(worker=worker))
    return load_config(path, env_file=None)


def test_every_node_is_pinned_to_its_fabric_ip(tmp_path: Path) -> None:
    config = example_named(tmp_path)
    head, worker = config.nodes
    h, w = ray_spec(head, config), ray_spec(worker, config)
    assert "--node-ip-address=192.168.200.12" in h.command and "--head" in h.command
    assert "--node-ip-address=192.168.200.13" in w.command
    assert "--address=192.168.200.12:6379" in w.command
    assert (h.env["VLLM_HOST_IP"], w.env["VLLM_HOST_IP"]) == ("192.168.200.12", "192.168.200.13")
    assert w.env["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1" and w.env["NCCL_IB_HCA"] == "rocep1s0f1"


def test_gloo_gets_one_interface_where_nccl_gets_the_twins() -> None:
    """A Spark's twin interfaces are up on one node and down on another; Gloo needs the same
    number in every process (or the ranks wait for each other for ever), NCCL takes both."""
    config = example().model_copy(deep=True)
    for node in config.nodes:
        node.fabric_interfaces = []
    head = config.nodes[0]
    twins = NodeFabric(socket_ifnames=("enp1s0f1np1", "enP2p1s0f1np1"))
    env = ray_spec(head, config, twins).env
    assert env["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1,enP2p1s0f1np1"
    assert env["GLOO_SOCKET_IFNAME"] == "enp1s0f1np1"
    alone = ray_spec(head, config, NodeFabric(socket_ifnames=("enp1s0f1np1",))).env
    assert alone["GLOO_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"]


def test_vllm_serve_has_the_runbook_flags() -> None:
    args = vllm_serve_args(example())
    assert args[:3] == ["vllm", "serve", "Qwen/Qwen3.5-122B-A10B-FP8"]
    text = " ".join(args)
    for flag in (
        "--tensor-parallel-size 2",
        "--distributed-executor-backend ray",
        "--reasoning-parser qwen3",
        "--port 30000",
        "--served-model-name Qwen3.5-122B-A10B-FP8",
        "--max-num-seqs 16",
    ):
        assert flag in text
    assert "--enable-reasoning" not in text


def test_the_engine_is_a_driver_next_to_the_head_raylet() -> None:
    config = example()
    spec = engine_spec(config)
    assert spec.pid_mode == "container:vllm-redeploy-spark-pair-ray"
    assert spec.env["RAY_ADDRESS"] == "192.168.200.12:6379"
    assert "vllm-redeploy-spark-pair-ray-tmp:/tmp/ray" in spec.volumes
    repo = "/home/nvidia/.cache/huggingface/hub/models--Qwen--Qwen3.5-122B-A10B-FP8"
    assert f"{repo}:{repo}:ro" in spec.volumes


def test_secrets_go_by_environment_never_by_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_SECRETS__HF_TOKEN", "hf_secret_value_123")
    config = load_config(EXAMPLE, env_file=None)
    spec = engine_spec(config)
    assert spec.env["HF_TOKEN"] == "hf_secret_value_123"
    assert "hf_secret_value_123" not in " ".join(spec.command)
    assert launch_fingerprint(config) == launch_fingerprint(example())  # secret not in digest


def test_different_interface_names_are_kept_off_the_workers(tmp_path: Path) -> None:
    config = example_named(tmp_path, worker=("enP2p1s0f1np1", "roceP2p1s0f1"))
    wrapper = container_argv(engine_spec(config))
    assert wrapper[:2] == ["sh", "-c"]
    # Run the wrapper for real (with `echo` for vllm): the file is written, argv reaches the end.
    target = tmp_path / "cfg" / "ray_non_carry_over_env_vars.json"
    argv = ["sh", "-c", wrapper[2], "sh", str(target), wrapper[5], "echo", "$(id)", "a b"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert done.stdout == "$(id) a b\n"
    assert "NCCL_SOCKET_IFNAME" in target.read_text()


def test_the_launch_fingerprint_follows_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        EXAMPLE.read_text().replace(
            "gpu_memory_utilization = 0.80", "gpu_memory_utilization = 0.75"
        )
    )
    assert launch_fingerprint(load_config(path, env_file=None)) != launch_fingerprint(example())


@pytest.mark.parametrize(
    ("backend", "changes", "kept"),
    [("mp", "master_port", "ray.port"), ("ray", "ray.port", "master_port")],
)
def test_each_backend_digests_only_what_it_reads(backend: str, changes: str, kept: str) -> None:
    """mp's command line reads [vllm] master_port and nothing of [ray]; Ray the reverse."""
    before = example()

    def moved(setting: str) -> ClusterConfig:
        if setting == "master_port":
            update = {"vllm": before.vllm.model_copy(update={"master_port": 29611})}
        else:
            update = {"ray": before.ray.model_copy(update={"port": 6390})}
        return before.model_copy(update=update)

    assert launch_fingerprint(moved(changes), backend) != launch_fingerprint(before, backend)
    assert launch_fingerprint(moved(kept), backend) == launch_fingerprint(before, backend)


# The example's launch fingerprints, as running groups carry them: a change that moves either
# makes the next `ensure` redeploy every running group of that backend. Change them only with a
# change of what is launched, and say so.
PINNED = {"ray": "b36478a5b0fb92d4", "mp": "1f709343dfe721ff"}


@pytest.mark.parametrize("backend", sorted(PINNED))
def test_the_examples_launch_fingerprints_do_not_move(backend: str) -> None:
    config = example()
    assert launch_fingerprint(config, backend) == PINNED[backend]
    rdma = NodeFabric(rdma=True, ib_hca="rocep1s0f1", socket_ifnames=("enp1s0f1np1",))
    fabric = {node.name: rdma for node in config.nodes}  # the digest is the settings' alone
    assert plan_for(backend, config, fabric, "why").fingerprint == PINNED[backend]


def test_an_mp_group_stamped_before_is_told_apart_from_changed_settings() -> None:
    """Groups started while every digest took Ray's specs: ensure redeploys an mp one once,
    saying so; a Ray one is recognised as it was."""
    config = example()
    era = ray_era_fingerprint(config)
    assert plan_for("ray", config).fingerprint == era
    mp = plan_for("mp", config)
    assert "was started by an earlier vllm-redeploy" in launch_changed(config, mp, era)
    assert "other settings" in launch_changed(config, mp, "0123456789abcdef")


def test_ray_membership_parsing() -> None:
    members = parse_members('noise\n[{"ip": "192.168.200.12", "alive": true, "gpus": 1.0}]\n')
    assert [(m.ip, m.alive, m.gpus) for m in members] == [("192.168.200.12", True, 1.0)]


def test_load_progress_from_vllm_log_lines() -> None:
    log = (
        "Loading safetensors checkpoint shards:   0% Completed | 0/40 [00:00<?, ?it/s]\n"
        "Loading safetensors checkpoint shards:  45% Completed | 18/40 [03:01<03:40, 10.0s/it]\n"
    )
    progress = last_load_progress(log)
    assert progress is not None and (progress.percent, progress.done, progress.total) == (
        45,
        18,
        40,
    )
    assert last_load_progress("INFO starting") is None


def with_backend(name: str) -> ClusterConfig:
    config = example()
    return config.model_copy(update={"vllm": config.vllm.model_copy(update={"backend": name})})


def test_auto_takes_mp_where_the_images_vllm_has_nnodes_and_ray_only_for_one_without() -> None:
    auto = with_backend("auto")
    assert asks_the_image(auto) and asks_the_image(with_backend("mp"))
    both = {"mp": "--nnodes", "ray": "/usr/local/bin/ray"}
    assert choose(auto, both) == (
        "mp",
        "mp (the image's vLLM has --nnodes; vLLM's own multi-node launcher)",
    )
    assert choose(auto, {**both, "mp": ""}) == (
        "ray",
        "ray (the image carries Ray at /usr/local/bin/ray)",
    )
    with pytest.raises(ValueError, match="the image's vLLM has no --nnodes; the image carries no"):
        choose(auto, {"mp": "", "ray": None})
    # A vLLM that could not print its help: the launcher every vLLM image runs, as before.
    assert choose(auto, {"mp": None, "ray": "/usr/local/bin/ray"}) == (
        "mp",
        "mp (the image's vLLM did not answer `vllm serve --help`; vLLM's own multi-node launcher)",
    )
    assert candidates(auto) == [
        ("mp", "mp (if the image's vLLM has --nnodes; vLLM's own multi-node launcher)"),
        ("ray", "ray (if the image carries Ray)"),
    ]
    assert choose(with_backend("mp"), {}) == (
        "mp",
        "mp (configured; vLLM's own multi-node launcher)",
    )


def test_each_backend_refuses_an_image_it_cannot_run_on() -> None:
    ray_only = with_backend("ray")
    assert refusal(ray_only, {"ray": "/usr/bin/ray"}) is None
    refused = refusal(ray_only, {"ray": None})
    assert refused is not None and refused.startswith("`ray` does not run in image")
    assert 'set backend = "mp"' in refused
    mp_only = with_backend("mp")
    refused = refusal(mp_only, {"mp": ""})
    assert refused is not None and "has no --nnodes" in refused and 'Set backend = "ray"' in refused
    assert refusal(mp_only, {"mp": "--nnodes"}) is None and refusal(mp_only, {"mp": None}) is None
    assert refusal(with_backend("auto"), {}) is None


def test_a_name_the_registry_does_not_hold_is_a_configuration_problem() -> None:
    assert backend_problem(with_backend("mp")) is None
    unknown = with_backend("torchrun")
    assert backend_problem(unknown) == (
        "vllm.backend: Input should be 'auto', 'mp' or 'ray' (got 'torchrun')"
    )
    with pytest.raises(ValueError, match="got 'torchrun'"):
        choose(unknown, {})


def test_a_registered_backend_takes_its_place_in_autos_order() -> None:
    """One that asks the image goes after those that ask already; one that asks nothing last,
    where only a configuration that names it reaches it."""

    class Asks(Backend):
        name, condition, absent = "asks", "the image carries X", "the image carries no X"

        def found(self, answer: str | None) -> str | None:
            return f"the image carries X at {answer}" if answer else None

    class Named(Backend):
        name = "named"

    try:
        register(Asks())
        register(Named())
        assert list(BACKENDS) == ["mp", "ray", "asks", "named"]
        auto = with_backend("auto")
        absent = {"mp": "", "ray": None}
        assert choose(auto, {**absent, "asks": "/x"}) == (
            "asks",
            "asks (the image carries X at /x)",
        )
        with pytest.raises(ValueError, match="the image carries no X"):  # never "named"
            choose(auto, absent)
        assert backend_problem(with_backend("named")) is None
    finally:
        BACKENDS.pop("asks", None)
        BACKENDS.pop("named", None)
    assert list(BACKENDS) == ["mp", "ray"]


def test_the_example_keeps_the_fingerprint_earlier_releases_stamped() -> None:
    """A group started by an earlier vllm-redeploy is not replaced by an upgrade alone: the
    example's fingerprints as 2fe36d2 (before [vllm] load_format and auto's new order)
    computed them. auto's loader choice is the run's, never the fingerprint's."""
    config = example()
    assert launch_fingerprint(config, "ray") == "b36478a5b0fb92d4"
    assert launch_fingerprint(config, "mp") == "1f709343dfe721ff"
