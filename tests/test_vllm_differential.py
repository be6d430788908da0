"""The stand-in against the real vLLM (0.32.0, CPU build): the same requests to both, comparing
what the product observes. Where they differ, the stand-in changes to match the real engine.

Each runs as a plain process on one node (TP=1) with the same flags and the tiny model, the
stand-in claiming the real engine's version. Compared: flags refused (exit code and vLLM's
words), the readiness sequence (connection refused while loading, then /health and /v1/models
together), the shapes of /v1/models, /health, /version, a chat completion that spends its budget
thinking and an unknown model's error, the log lines the product parses (load progress), and
the API key (both run with VLLM_API_KEY, as the product starts them): what it guards and the 401.
The multi-node rendezvous lines and the exit codes after faults are compared on the bed: the
real engine's in tests/test_real_vllm.py, the stand-in's in tests/test_mp_backend.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.testbed import real_vllm
from tests.testbed.bed import SERVED_NAME, bed_ip
from tests.testbed.procs import free_port, spawn, stop
from vllm_redeploy.parsers.vllm_log import last_load_progress
from vllm_redeploy.parsers.vllm_metrics import parse_metrics

pytestmark = [pytest.mark.integration, pytest.mark.real_vllm, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[1]
ENGINES = ("real", "standin")
FLAGS = ["--served-model-name", SERVED_NAME, "--reasoning-parser", "qwen3", "--enforce-eager",
         "--max-model-len", "1024"]  # fmt: skip
# Both engines run with an API key, given as the product gives it (VLLM_API_KEY); every request
# below sends it, but those of the test that compares what it guards.
API_KEY = f"sk-differential-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
THINKING = {"model": SERVED_NAME, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 2+2?"}]}  # fmt: skip


def argv(engine: str, *args: str) -> list[str]:
    if engine == "real":
        return [str(real_vllm.bin_dir() / "vllm"), *args]
    return [sys.executable, "-m", "tests.testbed.standins.vllm_standin", *args]


# Far shorter than either engine's start: up to 0.32 it does not bound the load (see below).
READY_TIMEOUT_S = "1"


def env(engine: str) -> dict[str, str]:
    common = {"PATH": "/usr/bin:/bin", "HOME": "/root", "PYTHONUNBUFFERED": "1",
              "VLLM_ENGINE_READY_TIMEOUT_S": READY_TIMEOUT_S, "VLLM_API_KEY": API_KEY}  # fmt: skip
    if engine == "real":
        inductor = real_vllm.compile_cache() / "inductor"  # where the product's [cache] puts it
        return common | {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    # One shard, as the tiny model has; the real engine's version.
    return common | {"PYTHONPATH": str(REPO), "VRD_VLLM_VERSION": real_vllm.VERSION,
                     "VRD_SHARDS": "1", "VRD_LOAD_SECONDS": "2"}  # fmt: skip


@dataclass
class Server:
    engine: str
    proc: subprocess.Popen[bytes]
    log: Path
    base: str
    states: list[str]  # the readiness sequence, each state once, as the product sees it

    def get(self, route: str, headers: dict[str, str] = AUTH) -> httpx.Response:
        return httpx.get(self.base + route, headers=headers, timeout=10)

    def post(
        self, route: str, body: dict[str, Any], headers: dict[str, str] = AUTH
    ) -> httpx.Response:
        return httpx.post(self.base + route, json=body, headers=headers, timeout=120)


def _state(host: str, port: int, base: str) -> str:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "no answer"
    try:
        health = httpx.get(base + "/health", timeout=2).status_code
        models = httpx.get(base + "/v1/models", headers=AUTH, timeout=2)
    except httpx.HTTPError as exc:
        return f"listening, {type(exc).__name__}"
    listed = models.status_code == 200 and SERVED_NAME in models.text
    return f"health {health}, " + ("model listed" if listed else f"models {models.status_code}")


def start(engine: str, workdir: Path) -> Server:
    host = bed_ip(31 if engine == "real" else 32)
    port = free_port(host)
    model = str(real_vllm.model_dir())
    args = ["serve", model, "--host", host, "--port", str(port), *FLAGS]
    log = workdir / f"{engine}.log"
    proc = spawn(argv(engine, *args), log, env(engine))
    base = f"http://{host}:{port}"
    states: list[str] = []
    deadline = time.monotonic() + 240
    while not states or states[-1] != "health 200, model listed":
        assert proc.poll() is None, f"{engine} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{engine} not served: {states}"
        state = _state(host, port, base)
        if not states or states[-1] != state:
            states.append(state)
        time.sleep(0.1)
    return Server(engine, proc, log, base, states)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    if (why := real_vllm.missing()) is not None:
        pytest.fail(why, pytrace=False)
    workdir = tmp_path_factory.mktemp("differential")
    started: dict[str, Server] = {}
    try:
        for engine in ENGINES:
            started[engine] = start(engine, workdir)
        yield started
    finally:
        for server in started.values():
            stop(server.proc, grace=10)


def shape(value: Any) -> Any:
    """A JSON value's shape: its keys, recursively, and the types of its leaves."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def test_readiness_refused_while_loading_then_health_and_models_together(
    servers: dict[str, Server],
) -> None:
    sequences = {engine: server.states for engine, server in servers.items()}
    assert sequences["real"] == ["refused", "health 200, model listed"], sequences
    assert sequences["standin"] == sequences["real"], sequences


def test_an_engine_ready_timeout_shorter_than_the_load_cuts_neither_short(
    servers: dict[str, Server],
) -> None:
    """0.32.0 starts its VLLM_ENGINE_READY_TIMEOUT_S clock only after the engine's handshake,
    which comes after the load (vllm#48031 found the same on 0.24): both served with 1 s while
    each refused connections for longer. The product sets it all the same, for 0.33 on."""
    for server in servers.values():
        assert server.states[0] == "refused" and server.states[-1] == "health 200, model listed"
        log = server.log.read_text()
        assert "Timed out waiting for engine core" not in log, (server.engine, log[-2000:])


def test_models_health_and_version_answer_alike(servers: dict[str, Server]) -> None:
    seen = {}
    for engine, server in servers.items():
        models = server.get("/v1/models").json()
        health = server.get("/health")
        seen[engine] = {
            "models": shape(models),
            "id": models["data"][0]["id"],
            "max_model_len": models["data"][0]["max_model_len"],
            "health": (health.status_code, health.text),
            "version": server.get("/version").json(),
        }
    assert seen["real"]["version"] == {"version": real_vllm.VERSION}, seen["real"]
    # The product reads these; other keys (root, parent, permission) may differ in shape.
    for key in ("id", "max_model_len", "health", "version"):
        assert seen["standin"][key] == seen["real"][key], (key, seen)
    assert seen["standin"]["models"]["data"][0].keys() >= {"id", "object", "max_model_len"}
    assert seen["standin"]["models"].keys() == seen["real"]["models"].keys(), seen


def test_a_budget_spent_thinking_has_the_same_shape(servers: dict[str, Server]) -> None:
    answers = {e: s.post("/v1/chat/completions", THINKING).json() for e, s in servers.items()}
    real = answers["real"]["choices"][0]
    assert real["message"]["content"] is None and real["finish_reason"] == "length", real
    assert real["message"]["reasoning"] and "reasoning_content" not in real["message"], real
    standin = answers["standin"]["choices"][0]
    # What the probe reads: the fields it takes the answer from, and their types.
    for key in ("content", "reasoning"):
        assert shape(standin["message"][key]) == shape(real["message"][key]), (key, answers)
    assert standin["finish_reason"] == real["finish_reason"]
    assert set(standin["message"]) >= {"role", "content", "reasoning"}, standin
    assert "reasoning_content" not in standin["message"], standin
    usage = {e: a["usage"]["completion_tokens"] for e, a in answers.items()}
    assert usage == {"real": 16, "standin": 16}, usage


def test_an_unknown_model_is_the_same_404(servers: dict[str, Server]) -> None:
    body = THINKING | {"model": "no-such-model"}
    answers = {e: s.post("/v1/chat/completions", body) for e, s in servers.items()}
    real, standin = answers["real"], answers["standin"]
    assert real.status_code == standin.status_code == 404
    assert shape(standin.json()) == shape(real.json()), (real.json(), standin.json())
    assert standin.json()["error"]["message"] == real.json()["error"]["message"]


def test_the_load_progress_lines_parse_alike(servers: dict[str, Server]) -> None:
    progress = {
        e: last_load_progress(s.log.read_text(errors="replace")) for e, s in servers.items()
    }
    assert progress["real"] is not None and progress["real"].percent == 100, progress
    assert progress["standin"] == progress["real"], progress


@pytest.mark.parametrize(
    ("flags", "code", "words"),
    [
        (["--bogus-flag"], 2, "vllm: error: unrecognized arguments: --bogus-flag"),
        (["--enable-reasoning", "--reasoning-parser", "qwen3"], 2,
         "vllm: error: unrecognized arguments: --enable-reasoning"),
        (["--reasoning-parser", "nosuch"], 1, "Reasoning parser 'nosuch' not found."),
    ],
)  # fmt: skip
def test_refused_flags_fail_alike(flags: list[str], code: int, words: str) -> None:
    if (why := real_vllm.missing()) is not None:
        pytest.fail(why, pytrace=False)
    done = {}
    for engine in ENGINES:
        args = ["serve", str(real_vllm.model_dir()), "--port", "1", *flags]
        result = subprocess.run(
            argv(engine, *args), capture_output=True, text=True, timeout=120, env=env(engine)
        )
        done[engine] = (result.returncode, words in result.stdout + result.stderr)
    assert done["real"] == (code, True), done
    assert done["standin"] == done["real"], done


def test_the_metrics_that_tell_busy_from_stuck_read_alike(servers: dict[str, Server]) -> None:
    """/metrics on both: the running and waiting gauges at rest, and the token counters moved
    by a generation (the watcher's busy-or-stuck judgement reads these)."""
    for engine, server in servers.items():
        before = parse_metrics(server.get("/metrics").text)
        assert server.post("/v1/chat/completions", THINKING).status_code == 200
        after = parse_metrics(server.get("/metrics").text)
        assert (after.running, after.waiting) == (0, 0), engine
        assert after.tokens > before.tokens, (engine, before, after)
        assert after.generated > before.generated, (engine, before, after)  # the watcher relays
        assert after.kv_cache_usage is not None and 0 <= after.kv_cache_usage <= 1, engine


def test_the_api_key_guards_the_same_routes_with_the_same_401(servers: dict[str, Server]) -> None:
    """vLLM's key (VLLM_API_KEY, the product's way) guards /v1 (and /v2) only, whatever the
    route, with one 401 body; a bearer of the key in any case passes; /health, /metrics and
    /version stay open. Neither engine prints the key."""
    wrong = {"Authorization": "Bearer sk-not-it"}
    basic = {"Authorization": f"Basic {API_KEY}"}
    lower = {"Authorization": f"bearer {API_KEY}"}
    asked = [
        ("GET", "/v1/models", {}),
        ("GET", "/v1/models", wrong),
        ("GET", "/v1/models", basic),
        ("GET", "/v1/models", lower),
        ("POST", "/v1/chat/completions", {}),
        ("GET", "/v1/no-such-route", {}),
        ("GET", "/v2/no-such-route", {}),
        ("GET", "/health", {}),
        ("GET", "/metrics", {}),
        ("GET", "/version", {}),
    ]
    seen: dict[str, list[tuple[str, str, int, str | None]]] = {}
    for engine, server in servers.items():
        seen[engine] = []
        for method, route, headers in asked:
            if method == "GET":
                answer = server.get(route, headers)
            else:
                answer = server.post(route, THINKING, headers)
            body = answer.text if answer.status_code == 401 else None
            seen[engine].append((method, route, answer.status_code, body))
        assert API_KEY not in server.log.read_text(errors="replace"), engine
    refused = [(m, r, code, body) for m, r, code, body in seen["real"] if code == 401]
    assert [r for _, r, _, _ in refused] == [
        "/v1/models", "/v1/models", "/v1/models", "/v1/chat/completions",
        "/v1/no-such-route", "/v2/no-such-route",
    ], seen["real"]  # fmt: skip
    assert {body for *_, body in refused} == {'{"error":"Unauthorized"}'}, refused
    assert seen["standin"] == seen["real"], seen
