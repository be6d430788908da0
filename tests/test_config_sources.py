"""Configuration mistakes caught before anything runs, each named by where its value came from:
the TOML file and line, the env file, or the environment variable (issue 33, item 5)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from deployments.cli import app
from tests.test_config import MINIMAL
from vllm_redeploy.config import ClusterConfig, ConfigError, describe, load_config
from vllm_redeploy.config.fields import ENV_PREFIX
from vllm_redeploy.config.toml_lines import key_line


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No VLLM_REDEPLOY_ variable of the caller's, and no .env of the checkout's."""
    import os

    for name in [n for n in os.environ if n.upper().startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(path: Path, env_file: Path | None = None) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        load_config(path, env_file=env_file)
    return raised.value.problems


def line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


def check_config(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["check-config", *args], env=env)
    return result.exit_code, result.output


# --- 1. an error names its source ---------------------------------------------------------------


def test_a_toml_error_names_the_file_and_line(tmp_path: Path) -> None:
    text = MINIMAL.replace('address = "10.0.0.2"', 'address = "10.0.0.2"\nssh_port = 0')
    text += "port = 70000\n"
    path = write(tmp_path, text)
    problems = problems_of(path)
    port = next(p for p in problems if p.startswith("vllm.port"))
    assert port.endswith(f"(from {path}, line {line_of(text, 'port = 70000')})"), port
    ssh_port = next(p for p in problems if p.startswith("nodes[1].ssh_port"))
    assert ssh_port.endswith(f"(from {path}, line {line_of(text, 'ssh_port = 0')})"), ssh_port


def test_an_environment_error_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_VLLM__PORT", "not-a-port")
    (problem,) = problems_of(write(tmp_path, MINIMAL + "port = 31000\n"))
    assert problem.startswith("vllm.port: ")
    assert problem.endswith("(from environment variable VLLM_REDEPLOY_VLLM__PORT)"), problem


def test_an_env_file_error_names_the_file_it_is_in(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL, "pair.toml")
    dotenv = tmp_path / ".env"
    dotenv.write_text("VLLM_REDEPLOY_VLLM__PORT=99999\nVLLM_REDEPLOY_RAY__PORT=0\n")
    (tmp_path / "pair.env").write_text("VLLM_REDEPLOY_RAY__PORT=70000\n")  # wins over .env
    problems = problems_of(path, env_file=dotenv)
    assert any(p.endswith(f"(from VLLM_REDEPLOY_VLLM__PORT in {dotenv})") for p in problems)
    ray = next(p for p in problems if p.startswith("ray.port"))
    assert ray.endswith(f"(from VLLM_REDEPLOY_RAY__PORT in {tmp_path / 'pair.env'})"), ray


def test_a_node_from_json_in_the_environment_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_NODES", '[{"name": "a", "address": "a.lan"}]')
    monkeypatch.setenv("VLLM_REDEPLOY_VLLM__TENSOR_PARALLEL_SIZE", "1")
    (problem,) = problems_of(write(tmp_path, MINIMAL))
    assert problem.startswith("nodes[0]: fabric_ip is required")
    assert problem.endswith("(from environment variable VLLM_REDEPLOY_NODES)")


def test_a_secret_is_never_shown_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "hf_NeverPrintThis123"
    monkeypatch.setenv("VLLM_REDEPLOY_SECRETS_HF_TOKEN", secret)  # one underscore: no setting
    path = write(tmp_path, MINIMAL + '[secrets]\nwebhook_secret = ["whsec-leak-42"]\n')
    text = "\n".join(problems_of(path))
    assert "VLLM_REDEPLOY_SECRETS_HF_TOKEN" in text and "secrets.webhook_secret" in text
    assert secret not in text and "whsec-leak-42" not in text


LINES = """\
name = "x"
vllm.port = 1                      # a dotted key at the top

[probe]
prompt = '''
[vllm]
port = 2
'''
max_tokens = 5

[[nodes]]
name = "a"

[[nodes]]
name = "b"
gpus = 2

["quoted table"]
gpus = 3
"""


@pytest.mark.parametrize(
    ("path", "line"),
    [
        (("name",), 1),
        (("vllm", "port"), 2),  # not the line inside the multi-line string
        (("probe", "max_tokens"), 9),
        (("nodes", 1, "gpus"), 16),
        (("nodes", 0), 11),
        (("nodes", 0, "name", "deeper"), 12),  # the key that holds it
        (("quoted table", "gpus"), None),  # a header this scan does not read: no line
        (("ray", "port"), None),
    ],
)
def test_the_line_of_a_key(path: tuple[str | int, ...], line: int | None) -> None:
    assert key_line(LINES, tomllib.loads(LINES), path) == line


def test_a_line_is_named_only_when_its_value_is_the_files() -> None:
    text = 'port = "a"\n'
    assert key_line(text, {"port": "another value"}, ("port",)) is None


# --- 2. a misspelt section in an environment variable ---------------------------------------------


def test_a_misspelt_section_in_the_environment_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_VLMM__PORT", "1")
    (problem,) = problems_of(write(tmp_path, MINIMAL))
    assert problem.startswith("VLLM_REDEPLOY_VLMM__PORT (in the environment): sets nothing")
    assert "(did you mean VLLM_REDEPLOY_VLLM__PORT?)" in problem
    assert "NAME, NODES, SSH, VLLM, RAY" in problem and problem.endswith("unset it")


def test_the_environment_and_dotenv_refuse_a_misspelt_name_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, MINIMAL)
    dotenv = tmp_path / ".env"
    dotenv.write_text("VLLM_REDEPLOY_VLMM__PORT=1\n")
    (in_file,) = problems_of(path, env_file=dotenv)
    dotenv.unlink()
    monkeypatch.setenv("VLLM_REDEPLOY_VLMM__PORT", "1")
    (in_environment,) = problems_of(path, env_file=dotenv)
    assert in_file.startswith(f"VLLM_REDEPLOY_VLMM__PORT (in {dotenv}): sets nothing")
    assert in_file.split(": ", 1)[1].split(":")[0] == in_environment.split(": ", 1)[1].split(":")[0]


def test_one_underscore_too_few_is_pointed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_VLLM_PORT", "30001")
    (problem,) = problems_of(write(tmp_path, MINIMAL))
    assert "(did you mean VLLM_REDEPLOY_VLLM__PORT?)" in problem


def test_the_projects_own_variables_are_no_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = {"VLLM_REDEPLOY_CONFIG": "/etc/x.toml", "VLLM_REDEPLOY_CLUSTER": "x"}
    for name, value in own.items():
        monkeypatch.setenv(name, value)
    dotenv = tmp_path / ".env"
    dotenv.write_text("VLLM_REDEPLOY_HOME=/opt/x\nVLLM_REDEPLOY_CONFIG=/etc/y.toml\nOTHER=1\n")
    assert load_config(write(tmp_path, MINIMAL), env_file=dotenv).name == "default"


# --- 3. a flag and its value in one item of extra_args --------------------------------------------


def test_a_flag_and_its_value_in_one_item_is_refused_with_the_fix(tmp_path: Path) -> None:
    text = MINIMAL + 'extra_args = ["--enforce-eager", "--max-num-seqs 16"]\n'
    path = write(tmp_path, text)
    (problem,) = problems_of(path)
    assert problem.startswith('vllm.extra_args: "--max-num-seqs 16" is a flag and its value')
    assert 'write extra_args = ["--enforce-eager", "--max-num-seqs", "16"]' in problem
    assert '(or "--max-num-seqs=16")' in problem
    assert problem.endswith(f"(from {path}, line {line_of(text, 'extra_args')})")


def test_ray_arguments_are_checked_alike_and_values_after_equals_may_hold_spaces(
    tmp_path: Path,
) -> None:
    fine = MINIMAL + 'extra_args = ["--compilation-config={\\"level\\": 3}", "-O3"]\n'
    assert load_config(write(tmp_path, fine), env_file=None).vllm.extra_args[1] == "-O3"
    (problem,) = problems_of(write(tmp_path, MINIMAL + '[ray]\nextra_args = ["--num-cpus 8"]\n'))
    assert problem.startswith("ray.extra_args:") and '["--num-cpus", "8"]' in problem


@pytest.mark.parametrize(
    ("section", "args"),
    [
        ("", '["--hf-token hf_live123"]'),
        ("", '["--hf-token=hf_live123"]'),
        ("", '["--max-num-seqs", "16", "--hf_token", "hf_live123"]'),  # vLLM reads _ as -
        ("[ray]\n", '["--redis-password=hf_live123"]'),
    ],
)
def test_a_flag_named_for_a_secret_is_refused_with_the_way_to_the_secret(
    tmp_path: Path, section: str, args: str
) -> None:
    """On the command line a secret shows in `ps`, `docker inspect` and the run's log. --api-key
    has its own words (tests/test_api_key.py)."""
    (problem,) = problems_of(write(tmp_path, MINIMAL + f"{section}extra_args = {args}\n"))
    assert "hf_live123" not in problem
    assert re.match(
        r"(vllm|ray)\.extra_args: --(hf.token|redis-password) in extra_args would", problem
    )
    assert "VLLM_REDEPLOY_SECRETS__HF_TOKEN" in problem and "never the TOML file" in problem


def test_flags_that_only_mention_tokens_or_keys_are_not_secrets(tmp_path: Path) -> None:
    args = '["--max-num-batched-tokens=8192", "--ssl-keyfile=/k.pem", "--tokenizer=x"]'
    config = load_config(write(tmp_path, MINIMAL + f"extra_args = {args}\n"), env_file=None)
    assert config.vllm.extra_args[0] == "--max-num-batched-tokens=8192"


# --- 4. strings for numbers and booleans ----------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (
            'address = "10.0.0.2"',
            'address = "10.0.0.2"\ngpus = "1"',
            'nodes[1].gpus: a whole number is needed, not the string "1": write gpus = 1',
        ),
        (
            "tensor_parallel_size = 2",
            'tensor_parallel_size = 2\nport = "30000"',
            'vllm.port: a whole number is needed, not the string "30000": write port = 30000',
        ),
        (
            "tensor_parallel_size = 2",
            'tensor_parallel_size = 2\n[autostart]\ndisable_units = "no"',
            "autostart.disable_units: true or false is needed, not the string "
            '"no": write disable_units = false',
        ),
        (
            'name = "a"',
            'name = "a"\nhead = 1',
            "nodes[0].head: true or false is needed, not 1: write head = true",
        ),
        (
            "tensor_parallel_size = 2",
            'tensor_parallel_size = "two"',
            'vllm.tensor_parallel_size: a whole number is needed, not the string "two"',
        ),
    ],
)
def test_a_toml_string_for_a_number_or_boolean_is_refused(
    tmp_path: Path, before: str, after: str, expected: str
) -> None:
    text = MINIMAL.replace(before, after, 1)
    path = write(tmp_path, text)
    (problem,) = problems_of(path)
    key = expected.split(":")[0].split(".")[-1].split("]")[-1]
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith(f"{key} ="))
    assert problem == f"{expected} (from {path}, line {line})"


def test_environment_and_env_file_strings_are_still_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_VLLM__PORT", "30001")
    dotenv = tmp_path / ".env"
    dotenv.write_text(
        "VLLM_REDEPLOY_AUTOSTART__DISABLE_UNITS=yes\nVLLM_REDEPLOY_PROBE__TEMPERATURE=0.5\n"
    )
    config = load_config(write(tmp_path, MINIMAL), env_file=dotenv)
    assert (config.vllm.port, config.autostart.disable_units, config.probe.temperature) == (
        30001,
        True,
        0.5,
    )


def test_a_range_error_still_shows_beside_the_type_mistake(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace('name = "a"', 'name = "a"\ngpus = "0"'))
    problems = problems_of(path)
    assert problems[0].startswith('nodes[0].gpus: a whole number is needed, not the string "0"')
    assert problems[1].startswith("nodes[0].gpus: Input should be greater than or equal to 1")


# --- 5. VLLM_REDEPLOY_CONFIG ------------------------------------------------------------------


def test_the_cli_takes_the_path_from_vllm_redeploy_config(tmp_path: Path) -> None:
    path = write(tmp_path, 'name = "from-env"\n' + MINIMAL, "x.toml")
    code, output = check_config(env={"VLLM_REDEPLOY_CONFIG": str(path)})
    assert code == 0 and "cluster from-env" in output, output
    other = write(tmp_path, MINIMAL, "other.toml")
    code, output = check_config("-c", str(other), env={"VLLM_REDEPLOY_CONFIG": str(path)})
    assert code == 0 and "cluster default" in output, output  # --config wins


def test_without_either_the_path_is_cluster_toml(tmp_path: Path) -> None:
    code, output = check_config(env={"VLLM_REDEPLOY_CONFIG": ""})
    assert code == 2 and "cluster.toml" in output and "VLLM_REDEPLOY_CONFIG" in output


def test_every_command_with_a_config_option_reads_vllm_redeploy_config() -> None:
    group = typer.main.get_command(app)
    commands = group.commands  # type: ignore[attr-defined]
    # install-controller's --config is optional: the file to install, not the one to load.
    options = [
        (name, param)
        for name, command in commands.items()
        for param in command.params
        if "--config" in getattr(param, "opts", []) and name != "install-controller"
    ]
    assert len(options) >= 10
    for name, param in options:
        assert param.envvar == "VLLM_REDEPLOY_CONFIG", name


# --- 6. check-config prints every section, as TOML ------------------------------------------------


def printed_toml(output: str) -> str:
    start = output.index("# the resolved configuration")
    return output[start : output.index("configuration OK")]


def test_check_config_prints_toml_that_loads_back_as_the_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_SECRETS__HF_TOKEN", "hf_DoNotShow42")
    text = MINIMAL + 'extra_args = ["--max-num-seqs", "16"]\n[vllm.env]\nA = "b\\u001b"\n'
    path = write(tmp_path, text)
    code, output = check_config("-c", str(path))
    assert code == 0, output
    assert "hf_DoNotShow42" not in output and '# hf_token = "*****"' in output
    printed = tomllib.loads(printed_toml(output))
    expected = describe(load_config(path, env_file=None))
    del expected["head"], expected["vllm"]["served_name"], expected["secrets"]["hf_token"]
    assert printed == without_none(expected)
    assert list(printed) == list(ClusterConfig.model_fields)  # every section, in order


def without_none(data: object) -> object:
    if isinstance(data, dict):
        return {k: without_none(v) for k, v in data.items() if v is not None}
    if isinstance(data, list):
        return [without_none(v) for v in data]
    return data


def test_check_config_output_can_be_pasted_back(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    _, output = check_config("-c", str(path))
    pasted = write(tmp_path, printed_toml(output), "pasted.toml")
    assert load_config(pasted, env_file=None) == load_config(path, env_file=None)


def test_check_config_json_still_works(tmp_path: Path) -> None:
    import json

    code, output = check_config("-c", str(write(tmp_path, MINIMAL)), "--json")
    data = json.loads(output)
    assert code == 0 and data["vllm"]["port"] == 30000 and data["head"] == "a"
