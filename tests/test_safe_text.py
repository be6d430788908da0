"""Foreign values in messages: no value adds a line, moves the cursor, changes colours or injects
markup, whichever message builder it passes through (issue 12). Properties over the helpers in
``vllm_redeploy.safe_text`` and over every builder that shows foreign text."""

from __future__ import annotations

import ast
import io
import json
import re

from hypothesis import example, given
from hypothesis import strategies as st
from markdown_it import MarkdownIt
from rich.console import Console

from deployments.cli.status_view import print_status
from tasks.stop_autostart import StopReport
from tests.fuzz import fuzz_settings
from vllm_redeploy.config import ConfigError, load_config
from vllm_redeploy.gpus import judge_gpus
from vllm_redeploy.launch.backend import GroupStatus
from vllm_redeploy.listeners import Others, Owner, Stopping, kept_listeners, owners, parse_ss
from vllm_redeploy.nodes import CommandFailed, CommandResult, NodeUnreachable
from vllm_redeploy.nodes.docker import DockerError
from vllm_redeploy.probe import ProbeVerdict, judge
from vllm_redeploy.safe_text import block, fenced, for_terminal, one_line, shown, strip_escapes
from vllm_redeploy.status import (
    ClusterStatus,
    ContainerStatus,
    EndpointStatus,
    GpuHolder,
    GpuStatus,
    NodeStatus,
)
from vllm_redeploy.summary import RunSummary, render_markdown

# The value: a newline, a carriage return, "clear the screen", and rich markup.
NASTY = "evil\n\r\x1b[2J[bold]x"
ESCAPES = [
    "\x1b[2J",  # clear screen
    "\x1b[31mred\x1b[0m",  # colour
    "\x1b]0;title\x07",  # window title (OSC, BEL-terminated)
    "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\",  # hyperlink (OSC, ST-terminated)
    "\x9b2J",  # 8-bit CSI
    "\x1bPq#0;2;0;0;0\x1b\\",  # DCS (sixel)
    "\x1b7\x1b8",  # save/restore cursor
]
hostile = st.one_of(
    st.text(),
    st.text(
        alphabet=st.sampled_from(
            [
                "\n",
                "\r",
                "\x1b",
                "[",
                "]",
                "`",
                "~",
                "|",
                "\u2028",
                "\u202e",
                "\x9b",
                "\x07",
                "\t",
                "a",
                "#",
                "*",
                "/",
            ]
        )
    ),
    st.sampled_from([NASTY, *ESCAPES]),
    st.lists(st.sampled_from([NASTY, *ESCAPES, "```", "~~~", "ok"])).map("".join),
)
FUZZ = fuzz_settings(300)


def assert_one_safe_line(text: str) -> None:
    assert text.isprintable(), repr(text)


def assert_terminal_safe(text: str) -> None:
    """Lines of text: nothing but printable characters, newlines and tabs."""
    assert "\x1b" not in text and "\r" not in text, repr(text)
    assert all(c.isprintable() or c in "\n\t" for c in text), repr(text)


# --- the helpers ---------------------------------------------------------------------------


@FUZZ
@given(hostile)
@example(NASTY)
def test_shown_is_one_line_and_reads_back_as_the_value(value: str) -> None:
    text = shown(value)
    assert_one_safe_line(text)
    if value.isprintable():
        assert text == value  # plain values are not decorated
    else:
        assert ast.literal_eval(text) == value  # exactly the value, as Python would write it


@FUZZ
@given(hostile)
def test_one_line_escapes_every_control_character(value: str) -> None:
    text = one_line(value)
    assert_one_safe_line(text)
    assert one_line(text) == text  # idempotent: safe to apply twice


@FUZZ
@given(hostile)
@example(NASTY)
def test_for_terminal_and_block_leave_no_escape_sequence(value: str) -> None:
    assert_terminal_safe(for_terminal(value))
    lines = block(value).split("\n")
    assert all(line.startswith("    ") for line in lines), lines
    assert_terminal_safe(block(value))


def test_escape_sequences_are_removed_and_the_text_kept() -> None:
    assert strip_escapes("\x1b[31mred\x1b[0m and \x1b]0;title\x07plain") == "red and plain"
    assert for_terminal("a\x1b[2Jb\r\nc\rd") == "ab\nc\\rd"
    assert for_terminal("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\") == "link"


def fence_tokens(markdown: str) -> list[tuple[str, str]]:
    return [(t.type, t.content) for t in MarkdownIt("commonmark").parse(markdown)]


@FUZZ
@given(hostile)
@example("```\n# heading\n```")
@example("````` and ``` and `")
def test_a_fenced_block_cannot_be_closed_by_its_content(value: str) -> None:
    markdown = fenced(value) + "\n\n# after"
    tokens = fence_tokens(markdown)
    assert tokens[0] == ("fence", for_terminal(value).strip("\n") + "\n")
    assert [t for t, _ in tokens[1:]] == ["heading_open", "inline", "heading_close"]


# --- the message builders -------------------------------------------------------------------


@FUZZ
@given(hostile, st.sampled_from([200, 400, 500, 502]))
@example(NASTY, 500)
def test_the_probe_verdict_is_one_safe_line_whatever_the_server_sends(
    body: str, status: int
) -> None:
    for text in (body, json.dumps({"error": {"message": body}}), _completion(body)):
        verdict = judge(status, text, 0.1)
        assert_one_safe_line(verdict.detail)


def _completion(content: str) -> str:
    message = {"content": content, "reasoning": content}
    return json.dumps({"choices": [{"message": message, "finish_reason": content}]})


@FUZZ
@given(
    st.text(alphabet=st.characters(blacklist_characters="\n,\r\x00"), min_size=1).filter(
        str.strip  # nvidia-smi trims its cells: a name of only blanks reads as none
    )
)
@example("\x1b[2J[bold]python3")
def test_gpu_problems_name_any_process_safely(name: str) -> None:
    report = judge_gpus(
        "node-1",
        f"4242, {name}, 20998\n",  # nvidia-smi --query-compute-apps
        "0, GPU-1, NVIDIA H200, 143771, 21000, 122000\n",  # --query-gpu
        "MemTotal: 1000 kB\nMemAvailable: 900 kB\n",
    )
    assert report.problems and all(p.isprintable() for p in report.problems), report.problems


@FUZZ
@given(hostile)
def test_remote_errors_keep_their_headline_on_one_line(value: str) -> None:
    result = CommandResult("node-1", ("ls", value), 2, value, value, 0.1)
    message = str(CommandFailed(result))
    headline, *rest = message.split("\n")
    assert_one_safe_line(headline)
    assert all(line.startswith("    ") or line.startswith("last ") for line in rest), rest
    assert_terminal_safe(message)
    assert_one_safe_line(str(NodeUnreachable("node-1", value, value)))
    assert_one_safe_line(str(DockerError("node-1", f"Docker on node-1: {value}")))


@FUZZ
@given(st.lists(hostile, max_size=3), st.lists(hostile, max_size=3))
def test_reports_and_owners_show_names_safely(removed: list[str], names: list[str]) -> None:
    assert_one_safe_line(StopReport("node-1", (), (), tuple(removed), tuple(names)).summary())
    ss_lines = [f'LISTEN 0 4096 0.0.0.0:30000 0.0.0.0:* users:(("{n}",pid=7,fd=3))' for n in names]
    listeners = parse_ss("\n".join(ss_lines))
    assert_one_safe_line(owners(listeners))
    owner = {7: Owner(unit=names[0] if names else None)}
    nobody = Stopping({}, frozenset())
    kept = kept_listeners({30000: listeners}, owner, nobody, Others({}, {}))
    assert_one_safe_line("; ".join(k.words("API port") for k in kept))


@FUZZ
@given(hostile, st.lists(hostile, max_size=3), hostile)
@example(NASTY, [NASTY], NASTY)
def test_the_summary_markdown_keeps_its_structure(
    failure: str, notes: list[str], answer: str
) -> None:
    summary = RunSummary(
        "bed",
        "redeploy",
        action="failed at wait-ready",
        steps={"preflight": 1.0, "wait-ready": 2.0},
        notes=notes,
        stopped=[StopReport("node-1", (), (), (answer,), ())],
        failed_step="wait-ready",
        failure=failure,
        probe=ProbeVerdict(True, "answered", content=answer, reasoning=answer),
    )
    markdown = render_markdown(summary)
    assert_terminal_safe(markdown)
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings == [
        "bed: failed at wait-ready",
        *(["Nodes"] if summary.stopped else []),
        "Probe",
        *(["Notes"] if notes else []),
    ]
    assert [t.type for t in tokens].count("fence") == 1  # the failure, whatever it holds
    assert not any(t.type == "link_open" for t in tokens)


def nasty_status() -> ClusterStatus:
    probe = ProbeVerdict(False, one_line(f"HTTP 500: {NASTY}"), status_code=500)
    endpoint = EndpointStatus(
        "http://127.0.0.1:30000/v1", "model", [NASTY], None, 200, shown(NASTY), probe
    )
    node = NodeStatus(
        "node-1",
        "127.0.0.1",
        "127.0.0.1",
        "head",
        True,
        1.0,
        None,
        [ContainerStatus(NASTY, "engine", NASTY, False, None, 1)],
        GpuStatus(False, [GpuHolder(1, NASTY, 10)], [NASTY]),
    )
    down = NodeStatus("node-2", "127.0.0.2", "127.0.0.2", "worker", False, error=NASTY)
    return ClusterStatus("bed", [node, down], GroupStatus(), endpoint, [one_line(NASTY)])


def test_status_shows_foreign_values_without_escapes_or_markup() -> None:
    """Straight into the table renderer: the status collector already cleans what it reads, so
    this checks the last line of defence on its own."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, force_terminal=True, color_system="truecolor")
    print_status(nasty_status(), console=console)
    text = buffer.getvalue()
    visible = re.sub(r"\x1b\[[0-9;]*m", "", text)  # rich's own colours are fine
    assert "\x1b[2J" not in text and "\r" not in text
    assert "[bold]" in visible  # shown literally, not taken as markup
    assert "evil\n" not in visible


def test_a_config_error_names_a_hostile_path_on_one_line(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "cluster.toml"
    config.write_text(
        'name = "bed"\n[[nodes]]\nname = "n1"\naddress = "127.0.0.1"\n'
        '[vllm]\nimage = "img:1"\nmodel = "/m"\n'
    )
    monkeypatch.setenv("VLLM_REDEPLOY_SSH__KEY_FILE", NASTY)
    try:
        load_config(config, env_file=None)
    except ConfigError as exc:
        assert exc.problems == [
            f"ssh.key_file: the key file {NASTY!r} does not exist; fix the path or remove the key"
        ]
    else:
        raise AssertionError("a missing key file was accepted")
