"""The compile caches: where they go in every container, and warm or cold from the engine's log
(the real engine's lines from tests/fixtures, vLLM's GPU lines from its source)."""

from __future__ import annotations

from pathlib import Path

from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.launch import launch_fingerprint
from vllm_redeploy.launch.caches import CACHE_VARS, compile_cache_words
from vllm_redeploy.launch.mp import plan as mp_plan
from vllm_redeploy.launch.ray import engine_spec, ray_spec
from vllm_redeploy.parsers.vllm_log import compile_cache_state

REPO = Path(__file__).resolve().parent.parent
REAL = REPO / "tests" / "fixtures" / "vllm_cpu_0.32.0"


def config(tmp_path: Path, cache: str = "", env: str = "") -> ClusterConfig:
    text = (REPO / "cluster.example.toml").read_text()
    text = text.replace("[vllm.env]\n", f"[vllm.env]\n{env}\n") + f"\n[cache]\n{cache}\n"
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return load_config(path, env_file=None)


def test_every_container_of_the_group_gets_the_cache_by_default(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    want = f"/var/cache/vllm-redeploy/{cfg.name}"
    specs = [engine_spec(cfg), *(ray_spec(n, cfg) for n in cfg.nodes)]
    specs += [m.spec for m in mp_plan(cfg, {}, "test").members]
    for spec in specs:
        assert f"{want}:{want}" in spec.volumes, spec.name
        assert spec.env["VLLM_CACHE_ROOT"] == f"{want}/vllm"
        assert spec.env["TRITON_CACHE_DIR"] == f"{want}/triton"
        assert all(spec.env[var].startswith(want + "/") for var in CACHE_VARS)


def test_one_setting_turns_it_off_and_the_operators_own_values_win(tmp_path: Path) -> None:
    off = config(tmp_path, "enabled = false")
    spec = engine_spec(off)
    assert not any(var in spec.env for var in CACHE_VARS)
    assert not any(v.startswith("/var/cache/") for v in spec.volumes)
    own = config(tmp_path, 'dir = "/nvme/vllm"', 'TRITON_CACHE_DIR = "/mine"')
    spec = engine_spec(own)
    assert "/nvme/vllm:/nvme/vllm" in spec.volumes
    assert (
        spec.env["VLLM_CACHE_ROOT"] == "/nvme/vllm/vllm" and spec.env["TRITON_CACHE_DIR"] == "/mine"
    )
    # A group started without the cache differs from one with it: `ensure` replaces it once.
    assert launch_fingerprint(off) != launch_fingerprint(own)


def test_the_real_engine_compiling_from_nothing_is_cold() -> None:
    state = compile_cache_state((REAL / "compile-cold.log").read_text())
    assert state is not None and state.state == "cold" and state.unloadable is None


def test_a_cached_function_the_engine_cannot_load_is_named() -> None:
    state = compile_cache_state((REAL / "compile-cached.log").read_text())
    assert state is not None and state.state == "cold"
    assert state.unloadable == "'function' object has no attribute 'finalize_loading'"
    assert "could not be loaded: 'function' object" in state.summary()


def test_vllms_gpu_lines_say_warm_or_cold_with_the_compile_time() -> None:
    warm = (
        "(Worker_TP0 pid=88) INFO 12-02 01:22:46 [decorators.py:320] [backbone] Directly load "
        "AOT compilation from path /var/cache/vllm-redeploy/spark/vllm/torch_compile_cache/"
        "torch_aot_compile/f5d6/rank_0_0/model\n"
        "(Worker_TP0 pid=88) INFO 12-02 01:22:47 [monitor.py:62] [backbone] torch.compile took "
        "3.21 s in total\n"
    )
    state = compile_cache_state(warm)
    assert state is not None and (state.state, state.compile_s) == ("warm", 3.21)
    cold = (
        "INFO [backends.py:398] [backbone] Compiling a graph for compile range (1, 8192) takes "
        "41.20 s\nINFO [monitor.py:62] [backbone] torch.compile took 52.05 s in total\n"
    )
    state = compile_cache_state(cold)
    assert state is not None and (state.state, state.compile_s) == ("cold", 52.05)
    off = "INFO [backends.py:1102] [backbone] vLLM's torch.compile cache is disabled.\n"
    assert compile_cache_state(off + cold).state == "disabled"  # type: ignore[union-attr]
    assert compile_cache_state("Loading weights took 0.01 seconds\n") is None


def test_the_summary_says_where_and_what_this_start_did(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    state = compile_cache_state((REAL / "compile-cold.log").read_text())
    words = compile_cache_words(cfg, state)
    assert words.startswith(
        f"`/var/cache/vllm-redeploy/{cfg.name}` on every node; this start: cold"
    )
    eager = compile_cache_words(config(tmp_path, "enabled = false"), None)
    assert (
        eager == "off ([cache] enabled = false); the engine did not use torch.compile (eager mode)"
    )
