"""Property tests of the configuration: whatever a TOML file, a .env file or the environment
says, `load_config` gives a valid ClusterConfig or a ConfigError with readable lines, never any
other exception; the real `check-config` process exits 0 or 2 without a traceback; and the
free-text values the configuration accepts (vLLM and Ray arguments, container environment,
secrets, the probe prompt) reach a node verbatim and are never run there as shell."""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import io
import json
import os
import re
import shlex
import string
import subprocess
import sys
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from deployments.install_notifier import ENV_PATH, SECRET_PATH, install_notifier
from tests.fuzz import fuzz_settings
from tests.testbed.dockerd import DockerEngine
from vllm_redeploy.config import (
    ENV_PREFIX,
    AutostartConfig,
    ClusterConfig,
    ConfigError,
    DeadlinesConfig,
    NodeConfig,
    ProbeConfig,
    RayConfig,
    SecretsConfig,
    SSHConfig,
    VLLMConfig,
    WebhookConfig,
    describe,
    load_config,
)
from vllm_redeploy.dry_run import plan_lines
from vllm_redeploy.launch import launch_fingerprint
from vllm_redeploy.launch.group import PER_NODE_VARS, container_argv, engine_container
from vllm_redeploy.launch.ray import (
    engine_spec,
    ray_container,
    ray_spec,
    ray_start_args,
    vllm_serve_args,
)
from vllm_redeploy.nodes import SSHRunner
from vllm_redeploy.nodes.docker import node_docker_for
from vllm_redeploy.nodes.result import render_command
from vllm_redeploy.probe import run_probe

ROOT = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "vllm-redeploy"

# --- hostile values ---------------------------------------------------------------------------

# Where an injected command would leave its mark; unique per session, so a hit is ours.
PWNED = f"/tmp/pwned-{uuid.uuid4().hex[:12]}"


def injections(mark: str) -> list[str]:
    """Shell that would create ``mark-<i>`` if any layer ran it (busybox has no `touch`, so
    most use a redirection, which every shell has)."""
    templates = [
        "; touch {m}",
        "$(touch {m})",
        "`touch {m}`",
        "\ntouch {m}\n",
        "x' ; touch {m} ; '",
        'x" ; touch {m} ; "',
        "| touch {m}",
        "&& echo > {m}",
        "$(echo > {m})",
        "`echo>{m}`",
        ";echo${{IFS}}>{m}",
        "> {m}",
        "--flag=$(echo > {m})",
        '\\"; echo > {m}; #',
        "${{PATH:0:0}}$(echo > {m})",
        "'$(echo > {m})'",
        "--x\n$(echo > {m})",
        "-e 'echo > {m}'",
    ]
    return [t.format(m=f"{mark}-{i}") for i, t in enumerate(templates)]


ODD = [
    "'\"\\`$!*?[]{}()<>|&;#~",
    "naïve ünïcödé ✓ 🚀 \u202e\u200b",
    "\t\r\x1b[31mred\x1b[0m",
    "[bold red]markup[/]",
    "%s%n%x{0}",
    "../../etc/passwd",
    "-" * 3 + "help",
    "",
    " ",
    "a" * 300,
]
HOSTILE = [*injections(PWNED), *ODD]


def one_argument(arg: str) -> bool:
    """What extra_args accepts as one item: one line, and not a flag with its value
    (``-e 'echo > x'``, refused with the fix)."""
    flag = arg.split("=", 1)[0]
    return "\n" not in arg and not (arg.startswith("-") and any(c.isspace() for c in flag))


hostile_text = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(max_size=30),
    st.builds(lambda a, b: a + b, st.sampled_from(HOSTILE), st.text(max_size=8)),
)
scalars = st.one_of(
    hostile_text,
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 2, 22, 65535, 65536, 2**31]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.datetimes(),
    st.dates(),
)
toml_keys = st.one_of(
    st.sampled_from(["x", "str", "int", "none", "a[0]", "function-after", "name", "node"]),
    st.text(min_size=1, max_size=12),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(toml_keys, children, max_size=4)
    ),
    max_leaves=8,
)

SECTIONS: dict[str, type] = {
    "ssh": SSHConfig,
    "vllm": VLLMConfig,
    "ray": RayConfig,
    "autostart": AutostartConfig,
    "deadlines": DeadlinesConfig,
    "probe": ProbeConfig,
    "webhook": WebhookConfig,
    "secrets": SecretsConfig,
}
KEY_PATHS: list[tuple[Any, ...]] = [
    ("name",),
    ("nodes",),
    *((section,) for section in SECTIONS),
    *((section, field) for section, model in SECTIONS.items() for field in model.model_fields),
    *(("nodes", i, field) for i in (0, 1) for field in NodeConfig.model_fields),
]
# Fields of free text, lists of it, or tables of it: where hostile text is most likely accepted.
TEXT_LISTS = [
    ("vllm", "extra_args"),
    ("ray", "extra_args"),
    ("vllm", "volumes"),
    ("autostart", "containers"),
    ("autostart", "units"),
    ("nodes", 0, "fabric_interfaces"),
]

BASE: dict[str, Any] = {
    "name": "fuzz",
    "nodes": [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"}],
    "vllm": {"image": "vllm/vllm-openai:v0.19.0", "model": "/models/m", "tensor_parallel_size": 2},
}

# --- TOML writing (every value as an inline value, so any nesting is expressible) --------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else toml_string(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def to_toml(data: dict[str, Any]) -> str:
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in data.items())


# --- mutations of a valid configuration -----------------------------------------------------


def _container(data: dict[str, Any], path: tuple[Any, ...], create: bool) -> Any:
    """The dict or list that holds ``path[-1]``, or None when the document has another shape."""
    here: Any = data
    for part in path[:-1]:
        if isinstance(part, int):
            if not isinstance(here, list) or len(here) <= part:
                return None
            here = here[part]
        elif isinstance(here, dict):
            if part not in here and create:
                here[part] = {}
            here = here.get(part)
        else:
            return None
    return here if isinstance(here, dict) else None


def mutate(data: dict[str, Any], mutations: list[tuple[str, tuple[Any, ...], Any]]) -> None:
    for kind, path, value in mutations:
        holder = _container(data, path, create=kind == "set")
        if holder is None:
            continue
        if kind == "delete":
            holder.pop(path[-1], None)
        else:
            holder[path[-1]] = value


def plausible(path: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """Values of roughly the right type for ``path``, mostly hostile text."""
    if path[-1] == "env":
        return st.dictionaries(
            st.one_of(st.sampled_from(["A", "HF_HOME", "VRD_X", "1BAD", "a-b"]), hostile_text),
            hostile_text,
            max_size=3,
        )
    if any(path[-2:] == tp[-2:] for tp in TEXT_LISTS):
        return st.lists(hostile_text, max_size=4)
    return hostile_text


mutation = st.one_of(
    st.sampled_from(KEY_PATHS).flatmap(
        lambda p: st.tuples(st.just("set"), st.just(p), st.one_of(values, plausible(p)))
    ),
    st.tuples(st.just("delete"), st.sampled_from(KEY_PATHS), st.none()),
    st.tuples(
        st.just("set"),
        st.tuples(st.sampled_from([(), *((s,) for s in SECTIONS), ("nodes", 0)]), toml_keys).map(
            lambda t: (*t[0], t[1])
        ),
        values,
    ),
)


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A TOML document (BASE, mutated) and the secret values it carries in secret fields."""
    data = copy.deepcopy(BASE)
    mutate(data, draw(st.lists(mutation, max_size=6)))
    secrets = []
    for path in (("secrets", "hf_token"), ("secrets", "webhook_secret"), ("ssh", "key_passphrase")):
        if draw(st.booleans()):
            secret = f"sk-{uuid.UUID(int=draw(st.integers(0, 2**128 - 1))).hex}" + draw(
                hostile_text
            )
            shape = draw(st.sampled_from(["plain", "list", "table"]))
            value: Any = {"plain": secret, "list": [secret], "table": {"v": secret}}[shape]
            holder = _container(data, path, create=True)
            if holder is not None:
                holder[path[-1]] = value
                secrets.append(secret)
    return to_toml(data), secrets


# --- checking an outcome ----------------------------------------------------------------------


def assert_clear(exc: ConfigError, source: Path, secrets: list[str]) -> None:
    """A ConfigError a person can act on: the file named, one readable line per problem."""
    assert exc.source == str(source)
    assert exc.problems and all(isinstance(p, str) and p.strip() for p in exc.problems), exc
    text = str(exc)
    assert text.startswith(f"{source}: ")
    for problem in exc.problems:  # one line each, nothing a terminal would act on
        assert problem.isprintable(), problem
    for bad in ("Traceback", "errors.pydantic.dev", "For further information", "input_value="):
        assert bad not in text, text
    for secret in secrets:
        assert secret not in text, "a secret value is echoed in the error"


def exercise(config: ClusterConfig, secrets: list[str]) -> None:
    """What an accepted configuration must support: shown, planned, dry-run, fingerprinted."""
    assert isinstance(config, ClusterConfig)
    shown = json.dumps(describe(config))
    argvs = [vllm_serve_args(config), *(ray_start_args(n, config) for n in config.nodes)]
    specs = [engine_spec(config), *(ray_spec(n, config) for n in config.nodes)]
    assert all(isinstance(a, str) for spec in specs for a in spec.command)
    plan = "\n".join(plan_lines(config, inspect_nodes=False))
    assert len(launch_fingerprint(config)) == 16
    for argv in argvs:  # what --dry-run prints is what runs: one word per argument
        assert shlex.split(render_command(argv)) == argv
    for secret in secrets:
        if any(secret == v for v in config.secret_values()):
            assert secret not in shown and secret not in plan, "a secret shows in the plan"


def outcome(path: Path, secrets: list[str], env_file: Path | None = None) -> ClusterConfig | None:
    try:
        config = load_config(path, env_file=env_file)
    except ConfigError as exc:
        assert_clear(exc, path, secrets)
        return None
    exercise(config, secrets)
    return config


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(ENV_PREFIX)}
    os.environ.update(values)
    try:
        yield
    finally:
        for key in values:
            os.environ.pop(key, None)
        os.environ.update(saved)


FUZZ = fuzz_settings(200)

# --- in-process properties ----------------------------------------------------------------------


@FUZZ
@given(documents())
def test_any_document_loads_or_fails_clearly(doc: tuple[str, list[str]]) -> None:
    text, secrets = doc
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(text, encoding="utf-8")
        outcome(path, secrets)


FREE_TEXT: list[tuple[tuple[Any, ...], st.SearchStrategy[Any]]] = [
    (("vllm", "extra_args"), st.lists(hostile_text, max_size=5)),
    (("ray", "extra_args"), st.lists(hostile_text, max_size=5)),
    (
        ("vllm", "env"),
        st.dictionaries(
            st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), hostile_text, max_size=4
        ),
    ),
    (("probe", "prompt"), hostile_text),
    (("secrets", "hf_token"), hostile_text),
    (("secrets", "webhook_secret"), hostile_text),
]


@st.composite
def free_text_documents(draw: st.DrawFn) -> str:
    """BASE with hostile text in the fields meant for free text: mostly accepted."""
    data = copy.deepcopy(BASE)
    for path, strategy in FREE_TEXT:
        if draw(st.booleans()):
            holder = _container(data, path, create=True)
            assert holder is not None
            holder[path[-1]] = draw(strategy)
    return to_toml(data)


@FUZZ
@given(free_text_documents())
def test_free_text_fields_take_hostile_text_and_plan_it_safely(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(text, encoding="utf-8")
        outcome(path, [])


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=300),
        st.text(max_size=300).map(str.encode),
        st.tuples(st.integers(0, 200), st.binary(min_size=1, max_size=6)).map(
            lambda t: to_toml(BASE).encode()[: t[0]] + t[1] + to_toml(BASE).encode()[t[0] :]
        ),
        st.integers(1, 3000).map(lambda n: b"a = " + b"[" * n + b"]" * n),
        st.integers(1, 3000).map(lambda n: b"a = " + b"{b = " * n + b"1" + b"}" * n),
    )
)
def test_any_bytes_load_or_fail_clearly(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_bytes(data)
        outcome(path, [])


@FUZZ
@given(
    st.sampled_from([(), *((s,) for s in SECTIONS), ("nodes", 1)]),
    st.one_of(toml_keys, st.sampled_from(["str", "int", "float", "bool", "none", "x[y]"])),
    values,
)
def test_an_unknown_key_is_named(parent: tuple[Any, ...], key: str, value: Any) -> None:
    data = copy.deepcopy(BASE)
    holder = _container(data, (*parent, key), create=True)
    assert holder is not None
    if key in holder or (parent == () and key in ClusterConfig.model_fields):
        return  # a known key, not an unknown one
    model = SECTIONS.get(parent[0]) if parent and parent[0] in SECTIONS else None
    if model is not None and key in model.model_fields:
        return
    if parent == ("nodes", 1) and key in NodeConfig.model_fields:
        return
    holder[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(to_toml(data), encoding="utf-8")
        with pytest.raises(ConfigError) as info:
            load_config(path, env_file=None)
    assert_clear(info.value, path, [])
    shown = key if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", key) else repr(key[:64])
    where = ".".join(str(p) for p in parent).replace(".1", "[1]")
    expected = f"{where}.{shown}" if where else shown
    assert any(p.startswith(f"{expected}: unknown key") for p in info.value.problems), (
        expected,
        info.value.problems,
    )


ENV_FIELDS = [
    "__".join(str(p).upper() for p in path if not isinstance(p, int))
    for path in KEY_PATHS
    if not any(isinstance(p, int) for p in path)
]
env_names = st.one_of(
    st.sampled_from(ENV_FIELDS),
    st.sampled_from(ENV_FIELDS).map(str.lower),
    st.sampled_from(ENV_FIELDS).map(lambda f: f + "__" + "X"),
    st.text(string.ascii_uppercase + string.digits + "_", min_size=1, max_size=12),
).map(lambda name: ENV_PREFIX + name)
env_values = st.one_of(
    hostile_text,
    values.map(lambda v: json.dumps(v, default=str)),
    st.sampled_from(['["--a", "$(touch /tmp/x)"]', '{"A": "1"}', "[", "{", "null", "1e999"]),
).filter(lambda v: "\0" not in v)


@FUZZ
@given(st.dictionaries(env_names, env_values, max_size=4), documents())
def test_environment_overrides_load_or_fail_clearly(
    env: dict[str, str], doc: tuple[str, list[str]]
) -> None:
    text, secrets = doc
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(text, encoding="utf-8")
        with environment(env):
            outcome(path, secrets)


@FUZZ
@given(st.dictionaries(env_names, env_values, max_size=4), st.booleans())
# Found by a random run in CI (issue 12): the key file's path was echoed with its newline.
@example(env={"VLLM_REDEPLOY_SSH__KEY_FILE": "--x\n$(echo > /tmp/pwned-...)"}, quoted=True)
@example(env={"VLLM_REDEPLOY_SSH__KNOWN_HOSTS": "~nouser\r\x1b[2J[bold]"}, quoted=True)
def test_dotenv_overrides_load_or_fail_clearly(env: dict[str, str], quoted: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(to_toml(BASE), encoding="utf-8")
        dotenv = Path(tmp) / ".env"
        dotenv.write_text(
            "".join(f"{k}={json.dumps(v) if quoted else v}\n" for k, v in env.items()),
            encoding="utf-8",
        )
        with environment({}):
            outcome(path, [], env_file=dotenv)


def test_examples_of_what_used_to_escape(tmp_path: Path) -> None:
    """Inputs that once raised something other than ConfigError, each with its message."""
    cases: list[tuple[bytes, dict[str, str], str]] = [
        (b'name = "\xff\xfe"\n', {}, "not UTF-8"),
        (b"a = " + b"[" * 2000 + b"]" * 2000, {}, "nested too deeply"),
        (to_toml(BASE).encode(), {"VLLM_REDEPLOY_NODES": "not json"}, "VLLM_REDEPLOY_NODES"),
        (
            to_toml(BASE).encode(),
            {"VLLM_REDEPLOY_VLLM__EXTRA_ARGS": "[oops"},
            "VLLM_REDEPLOY_VLLM__EXTRA_ARGS",
        ),
        (
            to_toml({**BASE, "ssh": {"key_file": "~nosuchuser-vrd/id"}}).encode(),
            {},
            "ssh.key_file",
        ),
        (to_toml({**BASE, "ssh": {"key_file": "/" + "k" * 5000}}).encode(), {}, "ssh.key_file"),
        (
            to_toml({**BASE, "ssh": {"known_hosts": "~nosuchuser-vrd/kh"}}).encode(),
            {},
            "ssh.known_hosts",
        ),
        (b"str = 1\n" + to_toml(BASE).encode(), {}, "str: unknown key"),
    ]
    for data, env, expected in cases:
        path = tmp_path / "cluster.toml"
        path.write_bytes(data)
        with environment(env), pytest.raises(ConfigError) as info:
            load_config(path, env_file=None)
        assert_clear(info.value, path, [])
        assert expected in str(info.value), (expected, info.value.problems)


# --- the real check-config process -------------------------------------------------------------


def check_config_process(
    path: Path, cwd: Path, env: dict[str, str] | None = None
) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    proc = subprocess.run(
        [str(CLI), "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**clean, **(env or {}), "COLUMNS": "200"},
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def assert_cli_outcome(code: int, output: str, secrets: list[str]) -> None:
    assert code in (0, 2), output
    assert "Traceback" not in output, output
    if code == 0:
        assert "configuration OK" in output
    else:
        assert "Configuration problem in" in output and "\n  - " in output
    for secret in secrets:
        assert secret not in output


HAND_PICKED: list[tuple[str, bytes, dict[str, str], int]] = [
    ("not utf-8", b'name = "\xff\xfe"\n', {}, 2),
    ("deeply nested", b"a = " + b"[" * 3000 + b"]" * 3000, {}, 2),
    ("name with shell", to_toml({**BASE, "name": "$(touch " + PWNED + "-cli)"}).encode(), {}, 2),
    ("unknown key named str", b"str = 1\n" + to_toml(BASE).encode(), {}, 2),
    ("env not json", to_toml(BASE).encode(), {"VLLM_REDEPLOY_VLLM__ENV": "{oops"}, 2),
    (
        "key file of no user",
        to_toml({**BASE, "ssh": {"key_file": "~nouser-vrd/k"}}).encode(),
        {},
        2,
    ),
    (
        "hostile but accepted",
        to_toml(
            {
                **BASE,
                "vllm": {
                    **BASE["vllm"],
                    "extra_args": [a for a in injections(PWNED + "-cli") if one_argument(a)],
                    "env": {"X": f"$(touch {PWNED}-cli-env)"},
                },
                "probe": {"prompt": f"`touch {PWNED}-cli-prompt`"},
            }
        ).encode(),
        {"VLLM_REDEPLOY_SECRETS__HF_TOKEN": f"sk-cli-secret$(touch {PWNED}-cli-secret)"},
        0,
    ),
]


@pytest.mark.parametrize(
    ("data", "env", "code"), [c[1:] for c in HAND_PICKED], ids=[c[0] for c in HAND_PICKED]
)
def test_check_config_process_on_hostile_files(
    tmp_path: Path, data: bytes, env: dict[str, str], code: int
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_bytes(data)
    got, output = check_config_process(path, tmp_path, env)
    assert got == code, output
    assert_cli_outcome(got, output, [v for k, v in env.items() if "SECRET" in k])
    assert not list(Path("/tmp").glob(Path(PWNED).name + "*"))


def test_check_config_process_on_a_hostile_file_name(tmp_path: Path) -> None:
    # Rich markup in the path must be printed, not interpreted (it used to raise MarkupError).
    for name in ("a[/]b.toml", "[bold]x[/bold].toml"):
        got, output = check_config_process(tmp_path / name, tmp_path)
        assert got == 2 and "Traceback" not in output, output
        assert name in output and "does not exist" in output


@fuzz_settings(8)
@given(documents())
def test_check_config_process_on_generated_files(doc: tuple[str, list[str]]) -> None:
    text, secrets = doc
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(text, encoding="utf-8")
        code, output = check_config_process(path, Path(tmp))
    assert_cli_outcome(code, output, secrets)


# --- accepted hostile values never run on a node -------------------------------------------------

# Records its own argv and environment, NUL-separated and exact, where the test reads them.
RECORDER = (
    "#!/bin/sh\ncat /proc/$$/cmdline > {out}/{name}.argv\ncat /proc/$$/environ > {out}/{name}.env\n"
)
DUMP = (
    "import json, os, sys\n"
    "env = {k: v for k, v in os.environ.items() if k.startswith('VRD_H')}\n"
    "print(json.dumps([sys.argv[1:], env]))"
)


def marks_left(container_tmp: list[str] | None = None) -> list[str]:
    found = [str(p) for p in Path("/tmp").glob(Path(PWNED).name + "*")]
    return found + [n for n in container_tmp or [] if Path(PWNED).name in n]


def hostile_config(tmp: Path, mark: str) -> tuple[Path, list[str]]:
    """A configuration that puts every injection into every free-text field that accepts it."""
    attacks = injections(mark)
    one_line = [a for a in attacks if one_argument(a)]
    data = {
        "name": f"fz{uuid.uuid4().hex[:8]}",
        "nodes": [
            {"name": "a", "address": "10.0.0.1", "fabric_interfaces": ["eth0"]},
            {"name": "b", "address": "10.0.0.2", "fabric_interfaces": ["enp1s0"]},
        ],
        "vllm": {
            "image": "vrd-test/busybox:1",
            "model": "/models/m",
            "tensor_parallel_size": 2,
            "gpu_device_request": False,
            "shm_size": "64m",
            "extra_args": one_line,
            "env": {
                "PATH": "/vrd-bin:/bin",
                **{f"VRD_H{i}": a for i, a in enumerate(attacks)},
            },
        },
        "ray": {"extra_args": one_line},
        "probe": {"prompt": " ".join(attacks)},
        "webhook": {"url": "http://127.0.0.1:8787"},
        "secrets": {
            "hf_token": f"hf_{attacks[1]}{attacks[3]}",
            "webhook_secret": f"whsec-{attacks[2]}{attacks[4]}",
        },
    }
    path = tmp / "hostile.toml"
    path.write_text(to_toml(data), encoding="utf-8")
    return path, attacks


def test_hostile_values_in_restricted_fields_are_refused(tmp_path: Path) -> None:
    """The other half: fields that end up in names, paths, units or flags refuse shell."""
    restricted = [
        ("name",),
        ("vllm", "model"),
        ("vllm", "image"),
        ("vllm", "served_model_name"),
        ("vllm", "reasoning_parser"),
        ("vllm", "shm_size"),
        ("vllm", "host"),
        ("nodes", 0, "name"),
        ("nodes", 0, "address"),
        ("nodes", 0, "ssh_user"),
        ("webhook", "url"),
        ("webhook", "host"),
    ]
    lists = [("autostart", "containers"), ("autostart", "units"), ("vllm", "volumes")]
    for path in restricted + lists:
        for attack in injections(PWNED):
            data = copy.deepcopy(BASE)
            holder = _container(data, path, create=True)
            assert holder is not None
            holder[path[-1]] = [attack] if path in lists else attack
            file = tmp_path / "r.toml"
            file.write_text(to_toml(data), encoding="utf-8")
            with pytest.raises(ConfigError) as info:
                load_config(file, env_file=None)
            assert_clear(info.value, file, [])


class _Recorder(BaseHTTPRequestHandler):
    bodies: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps(
            {
                "choices": [
                    {"message": {"content": "Hello.", "reasoning": None}, "finish_reason": "stop"}
                ]
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


def _read_nul(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def _tmp_listing(engine: DockerEngine, container: str) -> list[str]:
    """Every path under /tmp inside the (stopped) container."""
    with contextlib.closing(engine.client()) as client:
        bits, _ = client.containers.get(container).get_archive("/tmp")
        with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
            return tar.getnames()


def _extract(engine: DockerEngine, container: str, path: str) -> bytes:
    with contextlib.closing(engine.client()) as client:
        bits, _ = client.containers.get(container).get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
            member = tar.extractfile(tar.getmembers()[0])
            assert member is not None
            return member.read()


@pytest.mark.integration
def test_accepted_hostile_values_reach_the_node_verbatim_and_never_run(
    tmp_path: Path, ssh_runner: SSHRunner, dockerd: DockerEngine, test_image: str
) -> None:
    bin_dir, host_bin, out_dir = tmp_path / "bin", tmp_path / "host-bin", tmp_path / "out"
    for directory in (bin_dir, host_bin, out_dir):
        directory.mkdir()
    mark = f"{PWNED}-node"
    for where, program, out in (
        (bin_dir, "vllm", "/vrd-out"),  # inside the containers
        (bin_dir, "ray", "/vrd-out"),
        (host_bin, "ray", str(out_dir)),  # on the node itself, for the pasted dry run
    ):
        script = where / program
        script.write_text(RECORDER.format(out=out, name=f"{where.name}-{program}"))
        script.chmod(0o755)
    for applet in ("mkdir", "dirname", "printf"):  # what the engine's launch wrapper uses
        (bin_dir / applet).symlink_to("/bin/busybox")

    path, attacks = hostile_config(tmp_path, mark)
    config = load_config(path, env_file=None)  # accepted, every value as written
    assert config.vllm.extra_args == [a for a in attacks if one_argument(a)]
    assert config.probe.prompt == " ".join(attacks)
    secrets = list(config.secret_values())
    assert len(secrets) == 2

    # 1. The dry run prints each command so that a shell reads back exactly the argv.
    lines = plan_lines(config, inspect_nodes=False)
    ray_line = next(line for line in lines if "start container " + ray_container(config) in line)
    rendered = ray_line.split("): ", 1)[1]
    assert shlex.split(rendered) == ray_start_args(config.head, config)
    # Ray's engine (auto prints mp's launch first, whose leader has the engine's name too).
    ray_launch = lines[next(i for i, line in enumerate(lines) if "backend ray (" in line) :]
    engine_line = next(line for line in ray_launch if engine_container(config) in line)
    assert shlex.split(engine_line.split(": ", 1)[1]) == container_argv(engine_spec(config))
    assert not any(s in "\n".join(lines) for s in secrets)
    # ... and that rendering, pasted into a shell on the node, runs `ray` with exactly that argv.
    ssh_runner.run(["sh", "-c", rendered], env={"PATH": f"{host_bin}:/usr/bin:/bin"}, timeout=30)
    pasted = _read_nul(out_dir / "host-bin-ray.argv")
    assert pasted == ["/bin/sh", str(host_bin / "ray"), *ray_start_args(config.head, config)[1:]]
    assert not marks_left()

    # 2. The SSH transport: argv and environment arrive one word each, byte for byte.
    env = {k: v for k, v in config.vllm.env.items() if k.startswith("VRD_H")}
    result = ssh_runner.run(["python3", "-c", DUMP, *attacks], env=env, timeout=30)
    assert json.loads(result.stdout) == [attacks, env]
    assert not marks_left()

    # 3. Docker over the same SSH connection: the real Ray and engine containers (the image
    # swapped for busybox, whose `ray` and `vllm` record what they were started with).
    docker = node_docker_for(ssh_runner)
    mounts = [f"{bin_dir}:/vrd-bin:ro", f"{out_dir}:/vrd-out"]
    ray = replace(ray_spec(config.head, config), image=test_image, volumes=mounts)
    engine = replace(engine_spec(config), image=test_image, volumes=mounts, pid_mode=None)
    try:
        for spec in (ray, engine):
            docker.remove(spec.name)
            docker.run_detached(spec)
            assert docker.wait(spec.name, 60) == 0, docker.logs_tail(spec.name)
        ray_argv = _read_nul(out_dir / "bin-ray.argv")
        engine_argv = _read_nul(out_dir / "bin-vllm.argv")
        assert ray_argv == ["/bin/sh", "/vrd-bin/ray", *ray_start_args(config.head, config)[1:]]
        assert engine_argv == ["/bin/sh", "/vrd-bin/vllm", *vllm_serve_args(config)[1:]]
        engine_env = dict(v.split("=", 1) for v in _read_nul(out_dir / "bin-vllm.env"))
        assert {k: engine_env.get(k) for k in engine.env} == dict(engine.env)
        assert engine_env["HF_TOKEN"] == secrets[0]  # the hostile token, as a value only
        wrapper_file = "/tmp/vllm-redeploy-config/ray_non_carry_over_env_vars.json"
        assert json.loads(_extract(dockerd, engine.name, wrapper_file)) == list(PER_NODE_VARS)
        listing = _tmp_listing(dockerd, engine.name) + _tmp_listing(dockerd, ray.name)
        assert not marks_left(listing), listing
    finally:
        for spec in (ray, engine):
            docker.remove(spec.name)
        docker.close()

    # 4. The notifier's install: the hostile webhook secret goes on stdin into a file, verbatim.
    prefix = tmp_path / "root"
    install_notifier(config, "a", str(prefix), enable=False, runner=ssh_runner)
    assert (prefix / SECRET_PATH).read_text() == secrets[1] + "\n"
    assert "NODE=a\n" in (prefix / ENV_PATH).read_text()

    # 5. The probe: the hostile prompt travels as JSON, verbatim.
    _Recorder.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        run_probe(url, config.vllm.served_name, config.probe.prompt, 5, 0.0, 10)
    finally:
        server.shutdown()
    sent = json.loads(_Recorder.bodies[0])
    assert sent["messages"][-1]["content"] == " ".join(attacks)

    assert not marks_left()
