"""Whatever NCCL logging [vllm.env] asks for, the containers' NCCL prints the line the transport
proof reads; checked against the bed's NCCL, which follows NCCL's levels and subsystems."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from tests.testbed.standins import nccl
from vllm_redeploy.config import ConfigError, load_config
from vllm_redeploy.launch.group import node_env
from vllm_redeploy.nccl_logging import file_problem, nccl_logging, notes
from vllm_redeploy.parsers.nccl_log import judge_transport

ASKED = [
    {},
    {"NCCL_DEBUG": "WARN"},  # cluster.example.toml until it ran
    {"NCCL_DEBUG": "VERSION"},
    {"NCCL_DEBUG": "none"},
    {"NCCL_DEBUG": "warn", "NCCL_DEBUG_SUBSYS": "COLL"},
    {"NCCL_DEBUG": "INFO"},
    {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "NET"},
    {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "^INIT,NET,ENV"},
    {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "^INIT"},
    {"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "ALL"},
    {"NCCL_DEBUG_SUBSYS": "TUNING"},
]


def nccl_lines(env: dict[str, str]) -> list[str]:
    lines: list[str] = []
    nccl.init_rank(nccl.Comm(0, ["a", "b"], 0x1), env, lines.append)
    return lines


def transport(env: dict[str, str]) -> str:
    return judge_transport("\n".join(nccl_lines(env))).transport


def test_the_examples_warn_level_alone_blinds_the_proof() -> None:
    assert transport({"NCCL_DEBUG": "WARN"}) == "unknown"


@pytest.mark.parametrize("asked", ASKED, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_the_transport_is_read_whatever_the_operator_asks(asked: dict[str, str]) -> None:
    assert transport({**asked, **nccl_logging(asked)}) == "socket"


def test_an_operators_level_that_already_prints_the_line_is_kept() -> None:
    assert nccl_logging({"NCCL_DEBUG": "TRACE"}) == {"NCCL_DEBUG": "TRACE"}
    assert nccl_logging({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,COLL"}) == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,COLL",
    }
    assert notes({"NCCL_DEBUG": "INFO"}) == []
    # quiet asked: the shortest that proves, not NCCL's default subsystems
    assert nccl_logging({"NCCL_DEBUG": "WARN"})["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    quiet = nccl_lines(nccl_logging({"NCCL_DEBUG": "WARN"}))
    assert len(quiet) < len(nccl_lines({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ALL"}))


def write(tmp_path: Path, env: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(
        'name = "c"\n[[nodes]]\nname = "a"\naddress = "127.0.0.1"\n'
        f'[vllm]\nimage = "i:1"\nmodel = "/m"\n[vllm.env]\n{env}\n'
    )
    return path


def test_the_containers_get_the_raised_level_and_check_config_says_why(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, 'NCCL_DEBUG = "WARN"'), env_file=None)
    env = node_env(config.nodes[0], config)
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    (warning,) = notes(config.vllm.env)
    assert "NCCL_DEBUG = 'WARN'" in warning and "NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET" in (
        warning
    )
    checked = CliRunner().invoke(app, ["check-config", "--config", str(write(tmp_path, ""))])
    assert checked.exit_code == 0 and "warning:" not in checked.output
    path = write(tmp_path, 'NCCL_DEBUG = "WARN"')
    checked = CliRunner().invoke(app, ["check-config", "--config", str(path)], terminal_width=300)
    assert checked.exit_code == 0, checked.output
    said = " ".join(checked.output.split())
    assert "warning: [vllm.env] NCCL_DEBUG = 'WARN' would hide NCCL's INFO line" in said


def test_a_debug_file_is_refused_as_the_proof_could_not_read_it(tmp_path: Path) -> None:
    assert file_problem({"NCCL_DEBUG": "INFO"}) is None
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, 'NCCL_DEBUG_FILE = "/tmp/nccl.%h.%p"'), env_file=None)
    assert "NCCL_DEBUG_FILE sends NCCL's log lines into a file" in str(refused.value)
    assert "remove it" in str(refused.value)
