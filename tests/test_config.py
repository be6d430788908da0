"""Cluster configuration: the example, every validation rule, sources and secrets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deployments.cli import app
from vllm_redeploy.config import ConfigError, load_config
from vllm_redeploy.config.runs import WebhookConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "cluster.example.toml"

MINIMAL = """
[[nodes]]
name = "a"
address = "10.0.0.1"
[[nodes]]
name = "b"
address = "10.0.0.2"
[vllm]
image = "vllm/vllm-openai:v0.19.0"
model = "/models/m"
tensor_parallel_size = 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def check_config(path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["check-config", "--config", str(path), *args])
    return result.exit_code, result.output


def test_the_example_describes_the_two_sparks() -> None:
    config = load_config(EXAMPLE, env_file=None)
    assert [(n.name, n.ip) for n in config.nodes] == [
        ("spark-a", "192.168.200.12"),
        ("spark-b", "192.168.200.13"),
    ]
    assert config.head.name == "spark-a" and [w.name for w in config.workers] == ["spark-b"]
    v = config.vllm
    assert (v.port, v.reasoning_parser, v.tensor_parallel_size, v.served_name) == (
        30000,
        "qwen3",
        2,
        "Qwen3.5-122B-A10B-FP8",
    )
    assert config.deadlines.model_load_s == 1200


def test_check_config_accepts_the_example() -> None:
    code, output = check_config(EXAMPLE)
    assert code == 0, output
    assert "spark-a" in output and "192.168.200.13" in output and "configuration OK" in output


def test_a_port_only_the_other_backend_binds_may_be_shared(tmp_path: Path) -> None:
    mp = MINIMAL.replace("tensor_parallel_size = 2", 'tensor_parallel_size = 2\nbackend = "mp"')
    code, output = check_config(write(tmp_path, mp + "[ray]\nport = 30000\n"))
    assert code == 0, output


def test_defaults_fill_in(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL), env_file=None)
    assert config.vllm.served_name == "/models/m"  # vLLM's own default: the --model argument
    assert config.nodes[0].transport == "ssh" and config.nodes[0].ssh_port == 22
    assert config.probe.max_tokens == 50 and config.probe.temperature == 0
    assert config.head.name == "a"


def test_a_node_can_claim_the_head(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path, MINIMAL.replace('address = "10.0.0.2"', 'address = "10.0.0.2"\nhead = true')
        ),
        env_file=None,
    )
    assert config.head.name == "b" and [w.name for w in config.workers] == ["a"]


BAD = [
    (
        "unknown key",
        MINIMAL.replace('address = "10.0.0.1"', 'adress = "10.0.0.1"'),
        ["nodes[0].adress", "did you mean 'address'"],
    ),
    ("unknown section", MINIMAL + "[vlm]\nport = 1\n", ["vlm: unknown key"]),
    ("no nodes", 'nodes = []\n[vllm]\nimage = "i"\nmodel = "/m"\n', ["no nodes are configured"]),
    (
        "duplicate names",
        MINIMAL.replace('name = "b"', 'name = "a"'),
        ["node names must be unique; repeated: a"],
    ),
    ("no address", MINIMAL.replace('address = "10.0.0.2"\n', ""), ["nodes[1].address: required"]),
    (
        "bad ip",
        MINIMAL.replace('address = "10.0.0.2"', 'address = "10.0.0.2"\nfabric_ip = "10.0.0.300"'),
        ["nodes[1].fabric_ip: not a valid IP address"],
    ),
    (
        "host name without fabric ip",
        MINIMAL.replace('"10.0.0.2"', '"spark-b.lan"'),
        ["fabric_ip is required"],
    ),
    (
        "port out of range",
        MINIMAL.replace("tensor_parallel_size = 2", "tensor_parallel_size = 2\nport = 70000"),
        ["vllm.port", "70000"],
    ),
    (
        "ssh port out of range",
        MINIMAL.replace('name = "a"', 'name = "a"\nssh_port = 0'),
        ["nodes[0].ssh_port"],
    ),
    (
        "tp x pp above gpus",
        MINIMAL.replace(
            "tensor_parallel_size = 2", "tensor_parallel_size = 2\npipeline_parallel_size = 2"
        ),
        ["= 4 needs more GPUs than the nodes have (2)"],
    ),
    (
        "model path with shell",
        MINIMAL.replace('"/models/m"', '"/models/m; touch /tmp/pwned"'),
        ["vllm.model", "shell characters"],
    ),
    ("relative model path", MINIMAL.replace('"/models/m"', '"models/m"'), ["vllm.model"]),
    (
        "served name with space",
        MINIMAL + 'served_model_name = "my model"\n',
        ["vllm.served_model_name"],
    ),
    (
        "container pattern with shell",
        MINIMAL + '[autostart]\ncontainers = ["glm-*", "$(reboot)"]\n',
        ["autostart.containers[1]"],
    ),
    (
        "unit with space",
        MINIMAL + '[autostart]\nunits = ["glm server.service"]\n',
        ["autostart.units[0]"],
    ),
    (
        "missing key file",
        MINIMAL.replace('name = "a"', 'name = "a"\nssh_key_file = "/nonexistent/id_x"'),
        ["nodes[0].ssh_key_file", "does not exist"],
    ),
    (
        "removed vllm flag",
        MINIMAL + 'extra_args = ["--enable-reasoning"]\n',
        ["--enable-reasoning was removed", "reasoning_parser"],
    ),
    (
        "different interface counts (Gloo)",
        MINIMAL.replace(
            'name = "a"', 'name = "a"\nfabric_interfaces = ["enp1s0f1np1", "enP2p1s0f1np1"]'
        ),
        ["different numbers of fabric_interfaces (a 2, b 1;", "GLOO_SOCKET_IFNAME"],
    ),
    (
        "api port on ray's",
        MINIMAL.replace("tensor_parallel_size = 2", "tensor_parallel_size = 2\nport = 6379"),
        ["vllm.port and ray.port are both 6379: each needs its own port on the head"],
    ),
    (
        "rendezvous port on the api's",
        MINIMAL.replace(
            "tensor_parallel_size = 2", "tensor_parallel_size = 2\nmaster_port = 30000"
        ),
        ["vllm.port and vllm.master_port are both 30000"],
    ),
    (
        "cron of six fields",
        MINIMAL + '[schedule]\nnightly = "0 0 4 * * *"\n',
        ["schedule.nightly", "is not a cron line of five fields"],
    ),
    (
        "cron out of range",
        MINIMAL + '[schedule]\nnightly = "0 25 * * *"\n',
        ["schedule.nightly: '0 25 * * *' is not a cron line Prefect accepts (Invalid cron string"],
    ),
    (
        "unknown time zone",
        MINIMAL + '[schedule]\ntimezone = "Europe/Atlantis"\n',
        ["schedule.timezone", "is not an IANA time zone"],
    ),
    ("bad toml", "[[nodes]\n", ["not valid TOML"]),
    (
        "wrong type",
        MINIMAL.replace("tensor_parallel_size = 2", 'tensor_parallel_size = "two"'),
        ["vllm.tensor_parallel_size"],
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [(t, e) for _, t, e in BAD], ids=[i for i, _, _ in BAD]
)
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, text: str, expected: list[str]) -> None:
    code, output = check_config(write(tmp_path, text))
    assert code == 2
    for fragment in expected:
        assert fragment in output
    assert "Traceback" not in output


def test_missing_file_says_how_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_CONFIG_DIR", str(tmp_path / "none-installed"))
    code, output = check_config(tmp_path / "nope.toml")
    assert code == 2 and "`vllm-redeploy init`" in " ".join(output.split())


def test_init_writes_the_shipped_example_and_never_over_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    first = CliRunner().invoke(app, ["init"])
    assert first.exit_code == 0, first.output
    assert (tmp_path / "cluster.toml").read_text() == EXAMPLE.read_text()
    (tmp_path / "cluster.toml").write_text("# mine\n")
    again = CliRunner().invoke(app, ["init"])
    assert again.exit_code == 2 and "exists: nothing was written" in again.output
    assert (tmp_path / "cluster.toml").read_text() == "# mine\n"


def test_an_installed_cluster_is_found_by_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """install-controller's /etc/vllm-redeploy/<cluster>.toml and <cluster>.env: `-c NAME`, or
    no -c at all where one cluster is installed and ./cluster.toml is not there."""
    installed = tmp_path / "etc"
    installed.mkdir()
    (installed / "pair.toml").write_text(MINIMAL)
    (installed / "pair.env").write_text("VLLM_REDEPLOY_VLLM__PORT=31000\n")
    monkeypatch.setenv("VLLM_REDEPLOY_CONFIG_DIR", str(installed))
    monkeypatch.chdir(tmp_path)
    for args in (["-c", "pair"], []):
        done = CliRunner().invoke(app, ["check-config", "--json", *args])
        assert done.exit_code == 0, done.output
        assert '"port": 31000' in done.output  # its own env file came with it
    (installed / "other.toml").write_text(MINIMAL)
    done = CliRunner().invoke(app, ["check-config"])  # two installed: which one is not guessed
    assert done.exit_code == 2
    assert "installed here: other, pair" in " ".join(done.output.split())


def test_real_process_exit_code_and_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL.replace('address = "10.0.0.1"', 'adress = "10.0.0.1"'))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "vllm-redeploy"), "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "nodes[0].adress" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_environment_beats_dotenv_beats_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, MINIMAL + "port = 31000\nmax_model_len = 4096\n")
    dotenv = tmp_path / ".env"
    dotenv.write_text("VLLM_REDEPLOY_VLLM__PORT=32000\nVLLM_REDEPLOY_VLLM__MAX_MODEL_LEN=8192\n")
    monkeypatch.setenv("VLLM_REDEPLOY_VLLM__PORT", "33000")
    config = load_config(path, env_file=dotenv)
    assert config.vllm.port == 33000  # environment wins
    assert config.vllm.max_model_len == 8192  # .env over the file
    assert config.vllm.image == "vllm/vllm-openai:v0.19.0"  # file values stay


def test_bad_environment_value_names_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_REDEPLOY_VLLM__PORT", "not-a-port")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL), env_file=None)
    assert any(p.startswith("vllm.port") for p in info.value.problems)


def test_secrets_are_masked_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token, hook = "hf_SuperSecretToken123", "whsec-do-not-print"
    monkeypatch.setenv("VLLM_REDEPLOY_SECRETS__HF_TOKEN", token)
    monkeypatch.setenv("VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET", hook)
    path = write(tmp_path, MINIMAL)
    config = load_config(path, env_file=None)
    assert (
        config.secrets.hf_token is not None and config.secrets.hf_token.get_secret_value() == token
    )
    assert token not in repr(config) and token not in str(config.model_dump())
    for args in ((), ("--json",)):
        code, output = check_config(path, *args)
        assert code == 0 and token not in output and hook not in output and "*****" in output


def test_secret_of_the_wrong_shape_is_not_echoed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, MINIMAL + '[secrets]\nhf_token = ["hf_leaky_value_987"]\n')
    code, output = check_config(path)
    assert code == 2 and "secrets.hf_token" in output and "hf_leaky_value_987" not in output


@pytest.mark.parametrize(
    ("url", "host", "unreachable"),
    [
        ("http://192.0.2.10:8787", "127.0.0.1", True),  # the default bind, a LAN URL
        ("http://controller:8787", "127.0.0.2", True),  # all of 127.0.0.0/8
        ("http://192.0.2.10:8787", "0.0.0.0", False),
        ("http://192.0.2.10:8787", "192.0.2.10", False),
        ("http://127.0.0.1:8787", "127.0.0.1", False),  # the nodes are this machine
        ("http://localhost:8787", "127.0.0.1", False),
        (None, "127.0.0.1", False),
    ],
)
def test_a_webhook_bound_to_loopback_that_the_nodes_are_to_reach_is_named(
    url: str | None, host: str, unreachable: bool
) -> None:
    """Item 9 of issue 50: nothing said so, and the notifiers retried for an hour."""
    why = WebhookConfig(url=url, host=host).unreachable()
    assert (why is not None) == unreachable, why
    if why:
        assert why.startswith(f"the webhook binds {host}:8787, which only this machine reaches")
        assert f"[webhook] url ({url})" in why and "Set [webhook] host" in why
