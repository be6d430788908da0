"""vLLM stand-in: ``vllm serve MODEL [flags]`` without a GPU, shaped like vLLM 0.19, and checked
against the real vLLM 0.32.0 (its CPU build) where the product reads it: refused flags, the
readiness sequence, the API's answers and the load log (tests/test_vllm_differential.py).

It parses vLLM's flags (unknown ones, ``--enable-reasoning`` included, fail like vLLM's argparse),
logs in vLLM's format, binds the API port at once but listens only after the emulated weight load
(so clients see "connection refused" meanwhile), then serves vLLM's OpenAI-compatible HTTP API with
reasoning-shaped answers.

With TP x PP > 1, or ``--distributed-executor-backend ray``, it joins the Ray cluster
(``RAY_ADDRESS``, else "auto") and reserves one GPU per rank the way vLLM does: a placement group
of ``{"GPU": 1}`` bundles whose first bundle is pinned to ``node:<VLLM_HOST_IP>``, waiting (and
saying so in vLLM's words) while it cannot be placed. One Ray actor per rank holds "GPU memory"
on its own node through :mod:`gpu_state`. A rank that dies while the weights load fails the
engine at once (the load is a call to every rank); once serving, nothing watches them, as vLLM's
Ray executor's ``check_health`` assumes its workers are healthy: ``/health`` and ``/v1/models``
stay 200 until a request's model step finds the rank gone, gets HTTP 500, and the server exits 1.
On a unified-memory node (GB10, ``VRD_UNIFIED_MEMORY=1``) the ranks check, fill and hold the node's
emulated memory instead (:mod:`unified_memory`).
With more than one rank, every rank then joins one NCCL communicator (:mod:`nccl`): it picks IB
or sockets from what its own container sees (verbs devices, memlock, the node's HCAs, its
interfaces, its environment plus what vLLM copies from the driver) and prints NCCL's lines when
``NCCL_DEBUG`` asks; Ray forwards them to the engine's log. A rank NCCL fails in fails the engine.

With ``--nnodes N`` > 1 it is vLLM's own multi-node launcher instead (no Ray, see
:mod:`mp_launcher`): node-rank 0 leads (hosts the rendezvous on ``--master-port``, loads, serves),
``--headless`` ranks follow (join it from their VLLM_HOST_IP, serve nothing). Each node's ranks
hold that node's GPUs and print their NCCL lines in that node's log.

An API key (``--api-key``, else ``VLLM_API_KEY``) guards what vLLM 0.32.0's middleware guards:
every path under /v1 (/v2, /inference, /cohere) answers 401 ``{"error":"Unauthorized"}`` without
``Authorization: Bearer <key>``; /health, /metrics and /version stay open.

Test-bed knobs (environment):

- ``VRD_VLLM_VERSION`` (0.19.0), ``VRD_LOAD_SECONDS`` (2: from the process's start to serving,
  as an operator times `vllm serve`; joining Ray comes out of it), ``VRD_COMPILE_SECONDS`` (0:
  what torch.compile adds when VLLM_CACHE_ROOT holds no compiled function), ``VRD_SHARDS`` (4),
  ``VRD_GPU_STATE`` (per node; unset: hold nothing), ``VRD_GPU_TOTAL_MIB`` (143771),
  ``VRD_UNIFIED_MEMORY`` (1: the node's memory model on GB10 nodes, see :mod:`unified_memory`),
  ``VRD_REASONING_FIELD`` = reasoning | reasoning_content | both,
  ``VRD_PG_LOG_INTERVAL`` (10 s, doubling like vLLM), ``VRD_PG_WAIT_TIMEOUT`` (1800 s, vLLM's),
  ``VRD_DEAD_EXIT_DELAY`` (3 s between a dead rank and the exit),
  ``VRD_RENDEZVOUS_TIMEOUT`` (shortens the mp rendezvous' 600 s), ``VRD_HANDSHAKE_TIMEOUT``
  (300 s: a headless node-rank 0 waiting for a front-end), ``VRD_NEEDS_LIBRARY`` (a directory
  that must be on LD_LIBRARY_PATH, else serve fails as FlashInfer's JIT does on a GB10 without
  NGC's CUDA forward-compatibility libraries), ``VRD_PRINT_ENV`` (variable names, comma-separated,
  printed as NAME=value before vLLM's first line, as an entrypoint that dumps its environment).
- ``VRD_FAULT``: comma-separated ``name[:value]``: crash_during_load, exit_during_load:N, hang,
  wrong_name:NAME, health_503, empty, garbage (one token over and over), slow:SECONDS, http_500,
  html_error, malformed_json,
  firewall:NODE_IP (an mp follower on that node cannot reach the leader: its packets are dropped).

Only the standard library and Ray are imported (Ray lazily): this runs inside test containers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.testbed import memory
from tests.testbed.standins import gpu_state, loaders, mp_launcher, nccl, rdma, unified_memory

PROCESS_STARTED = time.monotonic()

DEFAULT_VERSION = "0.19.0"
DEFAULT_MAX_MODEL_LEN = 262144
DEFAULT_GPU_TOTAL_MIB = 143771
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # what `vllm serve` loads when no model is named
WEIGHTS_SHARE = 0.6  # of utilization x total: one rank's weights
KNOWN_FAULTS = (
    "crash_during_load",
    "exit_during_load",
    "hang",
    "wrong_name",
    "health_503",
    "empty",
    "garbage",  # NaNs in the kernels: the model emits "!" for every token
    "slow",
    "http_500",
    "html_error",
    "malformed_json",
    "firewall",  # firewall:<node ip>: an mp follower there cannot reach the leader
)
REASONING_PARSERS = (
    "deepseek_r1",
    "deepseek_v3",
    "ernie45",
    "glm45",
    "granite",
    "hunyuan_a13b",
    "kimi_k2",
    "minimax_m2",
    "minimax_m2_append_think",
    "mistral",
    "olmo3",
    "openai_gptoss",
    "qwen3",
    "seed_oss",
    "step3",
)
# The end of vLLM 0.32's traceback for a --reasoning-parser it does not know.
UNKNOWN_PARSER_TRACE = """Traceback (most recent call last):
  File "vllm/reasoning/abs_reasoning_parsers.py", line 247, in get_reasoning_parser
    raise KeyError(
KeyError: "Reasoning parser '{name}' not found. Available parsers: {known}"
"""
PTX_TRACE = """Traceback (most recent call last):
  File "flashinfer/jit/core.py", line 184, in build_and_load
    return self.load(so_path)
RuntimeError: CUDA error: the provided PTX was compiled with an unsupported toolchain. \
(cudaErrorUnsupportedPtxVersion)
"""
# vLLM reads the model's config.json first (transformers_utils/config.py, 0.32.0): a path that
# exists must hold it (links followed: a dangling one is no file), else a repo id must be in the
# Hugging Face cache (offline) or on the Hub (none here).
INVALID_MODEL_TRACE = """Traceback (most recent call last):
  File "vllm/transformers_utils/config.py", line 837, in get_config
    raise ValueError(
ValueError: Could not detect config format for no config file found. With config_format 'auto', \
ensure your model has either config.json (HF format) or params.json (Mistral format). Otherwise \
please specify your_custom_config_format in engine args for customized config parser.

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "vllm/transformers_utils/config.py", line 860, in get_config
    raise ValueError(error_message) from e
ValueError: Invalid repository ID or local directory specified: '{model}'.
Please verify the following requirements:
1. Provide a valid Hugging Face repository ID.
2. Specify a local directory that contains a recognized configuration file.
   - For Hugging Face models: ensure the presence of a 'config.json'.
   - For Mistral models: ensure the presence of a 'params.json'.
"""
# vLLM's API server gives up on its engine core after VLLM_ENGINE_READY_TIMEOUT_S, then exits 1
# (the message of core_client.py, 0.32.0). Up to 0.32 the bound starts only once the engine's
# handshake is done, after the load (measured: 0.32.0 serves with it set to 1; vllm#48031 says the
# same of 0.24); from 0.33 (vllm#50039) it bounds the engine's whole start.
READY_TIMEOUT_BOUNDS_START = (0, 33)
READY_TIMEOUT_TRACE = """Traceback (most recent call last):
  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core_client.py", line 742, in \
__init__
    raise TimeoutError(
TimeoutError: Timed out waiting for engine core processes to start. This is often caused by slow \
weight loading for large models. Waited {seconds}s (configured by VLLM_ENGINE_READY_TIMEOUT_S). To \
increase the timeout, set the environment variable: VLLM_ENGINE_READY_TIMEOUT_S=<seconds>
"""
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
# vLLM's API key (entrypoints/serve/middleware, 0.32.0): --api-key, else this variable, guards
# every path under these prefixes with this answer; the rest (/health, /metrics) stays open.
API_KEY_VARIABLE = "VLLM_API_KEY"
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
SENSITIVE_ARGS = frozenset({"api_key", "hf_token"})  # logged as '***'


# --------------------------------------------------------------------------- knobs


def model_config_found(model: str, env: Mapping[str, str]) -> bool:
    """vLLM's ``file_or_path_exists(model, "config.json")``, offline."""
    local = Path(model)
    if local.exists():
        return (local / "config.json").is_file()
    home = Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    repo = Path(env.get("HF_HUB_CACHE") or home / "hub") / f"models--{model.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return False
    return bool(revision) and (repo / "snapshots" / revision / "config.json").is_file()


def node_gpu_state(env: dict[str, str]) -> str | None:
    """This node's GPU state: VRD_GPU_STATE, or inside the bed's containers (where only
    cluster-wide settings reach) the bed's per-node directory, found by the node's fabric IP."""
    if env.get(gpu_state.ENV_STATE):
        return env[gpu_state.ENV_STATE]
    if env.get("VRD_BED_ROOT") and env.get("VLLM_HOST_IP"):
        return f"{env['VRD_BED_ROOT']}/gpu/{env['VLLM_HOST_IP']}"
    return None


@dataclass(frozen=True)
class Knobs:
    """Everything the test bed sets through the environment."""

    version: str = DEFAULT_VERSION
    load_seconds: float = 2.0
    shards: int = 4
    gpu_state_dir: str | None = None
    gpu_total_mib: int = DEFAULT_GPU_TOTAL_MIB
    unified_memory: bool = False
    reasoning_field: str = "reasoning"
    pg_log_interval: float = 10.0
    pg_wait_timeout: float = 1800.0
    dead_exit_delay: float = 3.0
    faults: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Knobs:
        # Read at call time: inside a Ray actor this must be that node's environment.
        env = dict(os.environ) if env is None else env
        field_mode = env.get("VRD_REASONING_FIELD", "reasoning")
        if field_mode not in ("reasoning", "reasoning_content", "both"):
            raise SystemExit(
                f"VRD_REASONING_FIELD={field_mode!r}: use reasoning, reasoning_content or both"
            )
        return cls(
            version=env.get("VRD_VLLM_VERSION", DEFAULT_VERSION),
            load_seconds=float(env.get("VRD_LOAD_SECONDS", "2")),
            shards=max(1, int(env.get("VRD_SHARDS", "4"))),
            gpu_state_dir=node_gpu_state(env),
            gpu_total_mib=int(env.get("VRD_GPU_TOTAL_MIB", str(DEFAULT_GPU_TOTAL_MIB))),
            unified_memory=env.get(unified_memory.ENV) == "1",
            reasoning_field=field_mode,
            pg_log_interval=float(env.get("VRD_PG_LOG_INTERVAL", "10")),
            pg_wait_timeout=float(env.get("VRD_PG_WAIT_TIMEOUT", "1800")),
            dead_exit_delay=float(env.get("VRD_DEAD_EXIT_DELAY", "3")),
            faults=parse_faults(env.get("VRD_FAULT", "")),
        )

    def fault(self, name: str) -> bool:
        return name in self.faults

    def fault_value(self, name: str, default: str) -> str:
        return self.faults.get(name) or default


def parse_faults(spec: str) -> dict[str, str | None]:
    faults: dict[str, str | None] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition(":")
        if name not in KNOWN_FAULTS:
            raise SystemExit(f"VRD_FAULT: unknown fault {name!r}; known: {', '.join(KNOWN_FAULTS)}")
        faults[name] = value or None
    return faults


# --------------------------------------------------------------------------- logging


class Log:
    """vLLM's line format: ``(APIServer pid=N) INFO MM-DD HH:MM:SS [file.py:line] message``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pid = os.getpid()

    def write(self, text: str, stream: Any = None) -> None:
        with self._lock:
            out = stream or sys.stdout
            out.write(text if text.endswith("\n") else text + "\n")
            out.flush()

    def emit(self, proc: str | None, level: str, where: str, message: str) -> None:
        """A line of process ``proc``; None: one whose output vLLM leaves undecorated (the
        main process of `vllm serve --headless`)."""
        stamp = time.strftime("%m-%d %H:%M:%S")
        process = f"({proc} pid={self.pid}) " if proc else ""
        prefix = f"{process}{level} {stamp} [{where}] "
        # vLLM's NewLineFormatter repeats the prefix on every line of a multi-line message.
        self.write("\n".join(prefix + line for line in message.splitlines() or [""]))

    def traceback(self, text: str, proc: str | None = None) -> None:
        """An uncaught exception: Python's traceback on stderr, under the process's prefix."""
        process = f"({proc} pid={self.pid}) " if proc else ""
        self.write("\n".join(process + line for line in text.splitlines()), sys.stderr)

    def api(self, level: str, where: str, message: str) -> None:
        self.emit("APIServer", level, where, message)

    def engine(self, level: str, where: str, message: str) -> None:
        self.emit("EngineCore_DP0", level, where, message)

    def uvicorn(self, message: str, level: str = "INFO") -> None:
        self.write(f"(APIServer pid={self.pid}) {level + ':':<9} {message}")


# --------------------------------------------------------------------------- CLI


class VllmArgumentParser(argparse.ArgumentParser):
    """Like vLLM's FlexibleArgumentParser: ``--max_model_len`` means ``--max-model-len``."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args([_dash_flag(a) for a in argv], namespace)


def _dash_flag(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    return key.replace("_", "-") + eq + value


def model_len(text: str) -> int:
    """vLLM accepts 262144, 32k or 1m for --max-model-len."""
    units = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def build_parser(version: str) -> VllmArgumentParser:
    parser = VllmArgumentParser(prog="vllm", description="vLLM CLI")
    parser.add_argument("-v", "--version", action="version", version=version)
    commands = parser.add_subparsers(dest="subparser", required=True)
    serve = commands.add_parser(
        "serve",
        help="Start the vLLM OpenAI Compatible API server.",
        usage="vllm serve [model_tag] [options]",
    )
    add_serve_arguments(serve)
    return parser


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model_tag", nargs="?", default=None, help="The model tag to serve")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", default=DEFAULT_MODEL)
    serve.add_argument("--served-model-name", nargs="+", default=None)
    serve.add_argument("--trust-remote-code", action="store_true")
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
    )
    serve.add_argument("--max-model-len", type=model_len, default=None)
    serve.add_argument("--load-format", default="auto")
    serve.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["external_launcher", "mp", "ray", "uni"],
    )
    serve.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    serve.add_argument("--swap-space", type=float, default=4)
    serve.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"],
    )
    serve.add_argument("--max-num-seqs", type=int, default=None)
    serve.add_argument("--enforce-eager", action="store_true")
    serve.add_argument("--api-key", nargs="+", default=None)
    # Any name parses; an unknown one fails when the server looks it up (vLLM 0.32: exit 1).
    serve.add_argument("--reasoning-parser", default="")
    add_multi_node_arguments(serve)


def add_multi_node_arguments(serve: argparse.ArgumentParser) -> None:
    """vLLM 0.19's own multi-node launcher (ParallelConfig's group, and the frontend's)."""
    serve.add_argument("--master-addr", default="127.0.0.1")
    serve.add_argument("--master-port", type=int, default=29501)
    serve.add_argument("--nnodes", "-n", type=int, default=1)
    serve.add_argument("--node-rank", "-r", type=int, default=0)
    serve.add_argument("--distributed-timeout-seconds", type=int, default=None)
    serve.add_argument("--headless", action="store_true")
    serve.add_argument("--api-server-count", "-asc", type=int, default=None)


def non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    """What vLLM logs at start-up: every serve argument that differs from its default, the
    API key redacted (vLLM 0.32's redact_sensitive_args)."""
    bare = argparse.ArgumentParser()
    add_serve_arguments(bare)
    defaults = vars(bare.parse_args([]))
    changed = {k: v for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    return {k: "***" if k in SENSITIVE_ARGS else v for k, v in changed.items()}


def api_keys(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, ...]:
    """The keys the API wants: --api-key's, else VLLM_API_KEY's; empty ones do not count
    (vLLM's init_entrypoints_middleware)."""
    return tuple(key for key in (args.api_key or [env.get(API_KEY_VARIABLE)]) if key)


@dataclass(frozen=True)
class ServeConfig:
    model: str
    served_names: list[str]
    host: str
    port: int
    tp: int
    pp: int
    backend: str | None
    reasoning_parser: str
    gpu_util: float
    max_model_len: int
    launch: mp_launcher.MpLaunch = field(default_factory=mp_launcher.MpLaunch)
    enforce_eager: bool = False
    api_keys: tuple[str, ...] = ()  # none: the API is open
    load_format: str = "auto"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def uses_ray(self) -> bool:
        if self.launch.multi_node:  # vLLM picks mp for nnodes > 1 (and refuses ray)
            return False
        return self.backend == "ray" or (self.world_size > 1 and self.backend is None)


def mp_launch(args: argparse.Namespace) -> mp_launcher.MpLaunch:
    return mp_launcher.MpLaunch(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        headless=args.headless,
        world_size=args.tensor_parallel_size * args.pipeline_parallel_size,
        timeout_s=mp_launcher.rendezvous_timeout(args.distributed_timeout_seconds, os.environ),
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    model = args.model_tag or args.model
    args.model = model  # vLLM copies the positional tag into --model (and logs both)
    return ServeConfig(
        launch=mp_launch(args),
        model=model,
        served_names=list(args.served_model_name or [model]),
        host=args.host or "0.0.0.0",
        port=args.port,
        tp=args.tensor_parallel_size,
        pp=args.pipeline_parallel_size,
        backend=args.distributed_executor_backend,
        reasoning_parser=args.reasoning_parser,
        gpu_util=args.gpu_memory_utilization,
        max_model_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
        enforce_eager=args.enforce_eager,
        api_keys=api_keys(args, os.environ),
        load_format=args.load_format,
    )


# --------------------------------------------------------------------------- the "model"

THINKING = (
    'Thinking Process:\n\n1. **Analyze the Request:**\n * Input: "{excerpt}"\n'
    " * Task: Reply helpfully and concisely.\n"
    " * Constraints: Keep it short, friendly, and accurate.\n\n2. **Identify the Core Need:**\n"
    " * The user wants a direct reply, not a long explanation.\n"
    " * A greeting fits because the message is short and conversational.\n\n"
    '3. **Drafting the Response:**\n * Option A: "Hi." (Too terse.)\n'
    ' * Option B: "Hello! How can I help you today?" (Friendly and open.)\n'
    " * Option C: One warm sentence that greets the user and offers help.\n\n"
    "4. **Review against Constraints:**\n * Is it one sentence? Yes.\n"
    " * Is it polite and clear? Yes.\n * Does it avoid unnecessary detail? Yes.\n\n"
    "5. **Final Polish:** Choose Option C and make it sound natural, warm, and brief.\n\n"
    "6. **Final Output Generation:** (Matches the selected option.)"
)
ANSWER = "Hello! I'm a helpful AI assistant, and I'm happy to help with whatever you need today."
THINK_START, THINK_END, EOS = "<think>", "</think>", "<|im_end|>"


@dataclass(frozen=True)
class Generation:
    reasoning: str | None
    content: str | None
    finish_reason: str
    completion_tokens: int


def generate(prompt: str, max_tokens: int | None, parser: str, thinking: bool) -> Generation:
    """Greedy, deterministic output; one whitespace-separated word is one token."""
    think_words = THINKING.format(excerpt=_excerpt(prompt)).split(" ")
    answer_words = ANSWER.split(" ")
    if not thinking:
        tokens = [*answer_words, EOS]
    elif parser:
        tokens = [*think_words, THINK_END, *answer_words, EOS]
    else:
        tokens = [THINK_START, *think_words, THINK_END, *answer_words, EOS]
    produced = tokens if max_tokens is None else tokens[: max(0, max_tokens)]
    finish = "stop" if produced and produced[-1] == EOS else "length"
    reasoning, content = _split_reasoning(produced, parser if thinking else "")
    return Generation(reasoning, content, finish, len(produced))


def _split_reasoning(produced: list[str], parser: str) -> tuple[str | None, str | None]:
    words = [w for w in produced if w != EOS]
    if not parser:  # the raw text, tags included, as Qwen3 writes it
        text = " ".join(words).replace(f"{THINK_START} ", f"{THINK_START}\n")
        text = text.replace(f" {THINK_END}", f"\n{THINK_END}")
        return None, text.replace(f"{THINK_END} ", f"{THINK_END}\n\n")
    if THINK_END not in words:
        return " ".join(words), None
    cut = words.index(THINK_END)
    return " ".join(words[:cut]), " ".join(words[cut + 1 :]) or None


def _excerpt(prompt: str, words: int = 12) -> str:
    parts = prompt.split()
    return " ".join(parts[:words]) + (" ..." if len(parts) > words else "")


def message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    # Chat-template overhead: role markers per message plus the generation prompt.
    return sum(len(message_text(m.get("content")).split()) + 4 for m in messages) + 3


# --------------------------------------------------------------------------- GPU holding


class FreeMemoryError(ValueError):
    """Other processes hold the memory this rank wants."""


def check_free_memory(
    directory: Path, gpu: int, want_mib: int, total_mib: int, util: float
) -> None:
    """vLLM refuses to start when other processes hold the memory it wants."""
    if not (directory / "config.json").exists():
        return
    held = sum(p.used_mib for p in gpu_state.live_processes(directory) if p.gpu == gpu)
    free = total_mib - held
    if free < want_mib:
        raise FreeMemoryError(unified_memory.free_memory_message(free, total_mib, want_mib, util))


def node_memory(knobs: Knobs) -> memory.NodeMemory | None:
    """This node's memory when the GPU allocates from it (GB10) and the knob asks for it."""
    return unified_memory.node_memory(knobs.gpu_state_dir) if knobs.unified_memory else None


def hold_gpu(knobs: Knobs, name: str, util: float, gpu: int = 0) -> gpu_state.Registration | None:
    if not knobs.gpu_state_dir:
        return None
    directory = Path(knobs.gpu_state_dir)
    want = int(util * knobs.gpu_total_mib)
    node = node_memory(knobs)
    if node is None:
        check_free_memory(directory, gpu, want, knobs.gpu_total_mib, util)
    elif problem := unified_memory.shortfall(node, want, knobs.gpu_total_mib, util, knobs.version):
        raise FreeMemoryError(problem)
    return gpu_state.register(directory, name, want, gpu=gpu)


def start_load(knobs: Knobs, name: str, util: float) -> unified_memory.UnifiedLoad | None:
    """What the rank's load takes from a unified-memory node (None elsewhere)."""
    node = node_memory(knobs)
    if node is None:
        return None
    kib = unified_memory.KIB_PER_MIB
    weights = int(WEIGHTS_SHARE * util * knobs.gpu_total_mib * kib)
    return unified_memory.UnifiedLoad(node, name, weights, int(util * knobs.gpu_total_mib * kib))


class RayWorkerWrapper:
    """One rank. Named like vLLM's actor so Ray's log prefixes read the same."""

    def __init__(self, rank: int, tp: int, world: int, util: float) -> None:
        import ray

        knobs = Knobs.from_env()  # this node's environment, not the driver's
        gpu_ids = ray.get_runtime_context().get_accelerator_ids().get("GPU") or ["0"]
        self.gpu = int(gpu_ids[0])
        stamp = time.strftime("%m-%d %H:%M:%S")
        print(
            f"INFO {stamp} [parallel_state.py:1208] rank {rank} in world size {world} is "
            f"assigned as DP rank 0, PP rank {rank // tp}, TP rank {rank % tp}, EP rank {rank}",
            flush=True,
        )
        try:
            self._hold = hold_gpu(knobs, "ray::RayWorkerWrapper", util, self.gpu)
        except FreeMemoryError as error:
            raise ValueError(str(error)) from None  # the type vLLM's workers raise
        self._load = start_load(knobs, "ray::RayWorkerWrapper", util)
        self.rank = rank

    def ping(self) -> int:
        return os.getpid()

    def load_shard(self, shards: int, cached: bool = True) -> None:
        if self._load is not None:
            self._load.shard(shards, cached)

    def init_kv_cache(self) -> None:
        if self._load is not None:
            self._load.kv_cache()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def init_device(self, node_ips: list[str], comm_id: int, copied: dict[str, str]) -> str:
        """NCCL's communicator, as this rank's process sees the node: its environment (with
        what vLLM copies from the driver), devices, limits and interfaces."""
        comm = nccl.Comm(self.rank, node_ips, comm_id)
        try:
            return nccl.init_rank(
                comm, {**os.environ, **copied}, lambda line: print(line, flush=True)
            )
        except nccl.NcclError as error:
            raise RuntimeError(str(error)) from None


# --------------------------------------------------------------------------- engine


class EngineFailed(Exception):
    """The engine could not start; the message is what vLLM would have logged, ``procs`` what
    the API server then lists as failed core processes."""

    def __init__(self, message: str, procs: str = "{}") -> None:
        super().__init__(message)
        self.procs = procs


@dataclass
class Engine:
    """Holds the GPU memory (locally or through Ray ranks) and watches it."""

    config: ServeConfig
    knobs: Knobs
    log: Log
    dead: threading.Event = field(default_factory=threading.Event)
    serving: threading.Event = field(default_factory=threading.Event)
    holds: list[gpu_state.Registration] = field(default_factory=list)  # flocks live with these
    loads: list[unified_memory.UnifiedLoad] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)
    ranks: RayRanks | None = None
    mp: mp_launcher.MpNode | None = None

    def start(self) -> None:
        self.log.engine("INFO", "core.py:93", self._config_line())
        if self.config.uses_ray:
            self.ranks = RayRanks(self)
            self.ranks.start()
        elif self.config.launch.multi_node:
            self._lead()
        else:
            self._hold_locally()

    def _hold_locally(self) -> None:
        world = self.config.world_size
        for rank in range(world):
            self._hold("VLLM::EngineCore" if world == 1 else f"VLLM::Worker_TP{rank}", rank)

    def _hold(self, name: str, gpu: int) -> None:
        hold = hold_gpu(self.knobs, name, self.config.gpu_util, gpu=gpu)
        if hold is not None:
            self.holds.append(hold)
        load = start_load(self.knobs, name, self.config.gpu_util)
        if load is not None:
            self.loads.append(load)

    def _lead(self) -> None:
        launch = self.config.launch
        leader = mp_launcher.leader_line(launch, os.environ)
        self.log.engine("INFO", "multiproc_executor.py:134", leader)
        try:
            self.start_mp()
        except mp_launcher.ExecutorFailed:
            raise EngineFailed(mp_launcher.ENGINE_START_TRACE, mp_launcher.ENGINE_PROCS) from None

    def start_mp(self) -> None:
        """This node's ranks of vLLM's own multi-node launch: the rendezvous and NCCL, then
        each holds its GPU. Raises mp_launcher.ExecutorFailed (the failed worker logged)."""
        c = self.config
        log = self.log
        self.mp = mp_launcher.MpNode(c.launch, c.tp, c.pp, log.emit, log.write, os.environ)
        self.mp.start()
        for local, rank in enumerate(c.launch.ranks):
            try:
                self._hold("VLLM::" + mp_launcher.worker_name(rank, c.tp, c.pp), local)
            except FreeMemoryError as error:
                raise self.mp.memory_failed(rank, str(error)) from None
        self.mp.devices_ready()

    def load_shard(self, shards: int, cached: bool = True) -> None:
        """Every rank has read one more of ``shards`` files (unified memory: see start_load),
        through the page cache unless ``cached`` is off (direct I/O)."""
        if self.ranks is not None and self.knobs.unified_memory:
            self.ranks.call("load_shard", shards, cached)
        for load in self.loads:
            load.shard(shards, cached)

    def init_kv_cache(self) -> None:
        if self.mp is not None and self.config.launch.leader:
            self._profile_run()
        if self.ranks is not None and self.knobs.unified_memory:
            self.ranks.call("init_kv_cache")
        for load in self.loads:
            load.kv_cache()

    def _profile_run(self) -> None:
        """The first collective after the load: a node gone meanwhile fails the engine."""
        assert self.mp is not None
        try:
            self.mp.all_reduce(mp_launcher.PROFILE_RUN)
        except mp_launcher.PeerLost:
            raise EngineFailed(mp_launcher.WORKER_FAILED_TRACE, mp_launcher.ENGINE_PROCS) from None

    def execute_model(self) -> None:
        """One model step. On mp it is a collective of every node, on Ray a call to every rank:
        vLLM serves on (``/health`` 200) after a node or rank is gone, until the next step fails
        and kills the engine."""
        if self.dead.is_set():
            return
        if self.ranks is not None:
            self.ranks.step()
        if self.mp is None:
            return
        try:
            self.mp.model_step()
        except mp_launcher.StepTimedOut:
            # The executor's collective_rpc gave up on a rank that never answered.
            fatal = "EngineCore encountered a fatal error.\n" + mp_launcher.traceback_text(
                mp_launcher.MODEL_STEP, "TimeoutError: RPC call to execute_model timed out."
            )
            self.log.engine("ERROR", "core.py:1110", fatal)
            self.dead.set()
        except mp_launcher.PeerLost:
            fatal = f"EngineCore encountered a fatal error.\n{mp_launcher.STEP_FAILED_TRACE}"
            self.log.engine("ERROR", "core.py:1110", fatal)
            self.log.api("ERROR", "async_llm.py:526", "AsyncLLM output_handler failed.")
            dead = f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}"
            self.log.api("ERROR", "async_llm.py:526", dead)
            self.dead.set()

    def watch(self) -> None:
        """Until serving, a dead rank kills the engine: the load is a call to every rank."""
        if self.ranks is not None:
            threading.Thread(target=self.ranks.watch, name="rank-monitor", daemon=True).start()

    def _config_line(self) -> str:
        c = self.config
        return (
            f"Initializing a V1 LLM engine (v{self.knobs.version}) with config: model={c.model!r}, "
            f"speculative_config=None, tokenizer={c.model!r}, skip_tokenizer_init=False, "
            "tokenizer_mode=auto, revision=None, trust_remote_code=False, dtype=torch.bfloat16, "
            f"max_seq_len={c.max_model_len}, download_dir=None, load_format=auto, "
            f"tensor_parallel_size={c.tp}, pipeline_parallel_size={c.pp}, data_parallel_size=1, "
            "disable_custom_all_reduce=False, enforce_eager=False, kv_cache_dtype=auto, "
            "device_config=cuda, structured_outputs_config=StructuredOutputsConfig("
            f"backend='auto', reasoning_parser={c.reasoning_parser!r}), seed=0, "
            f"served_model_name={c.served_names[0]}, enable_prefix_caching=True"
        )


STEP_WAIT_S = 120.0  # how long a model step waits for a rank Ray cannot reach (the stand-in's)


class RayRanks:
    """vLLM's initialize_ray_cluster plus one RayWorkerWrapper per rank."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.log = engine.log
        self.world = engine.config.world_size

    def start(self) -> None:
        import ray

        _ship_code_by_value()
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
        install_sigterm(self.log)  # ray.init replaced it with a handler that only dumps stacks
        node_id = ray.get_runtime_context().get_node_id()
        driver_ip = os.environ.get("VLLM_HOST_IP") or ray.util.get_node_ip_address()
        self._warn_on_gpu_counts(node_id)
        self._need_local_gpu(node_id, driver_ip)
        group = self._placement_group(driver_ip)
        self._verify_bundles(group, node_id)
        self.engine.actors = self._start_ranks(group)

    def call(self, method: str, *args: Any) -> None:
        """Run ``method`` on every rank at once, as vLLM's collective_rpc does."""
        import ray

        try:
            ray.get([getattr(a, method).remote(*args) for a in self.engine.actors])
        except ray.exceptions.RayError as error:
            cause = f"ray.exceptions.{type(error).__name__}: {error}"
            raise EngineFailed(RAY_RPC_TRACE + cause) from None

    def _warn_on_gpu_counts(self, node_id: str) -> None:
        import ray
        from ray._private.state import total_resources_per_node

        local = int(total_resources_per_node().get(node_id, {}).get("GPU", 0))
        if self.world > local:
            self.log.engine(
                "WARNING",
                "ray_utils.py:337",
                f"Tensor parallel size ({self.world}) exceeds available GPUs ({local}). This may "
                "result in Ray placement group allocation failures. Consider reducing "
                f"tensor_parallel_size to {local} or less, or ensure your Ray cluster has "
                f"{self.world} GPUs available.",
            )
        self.log.engine(
            "INFO",
            "ray_utils.py:396",
            "No current placement group found. Creating a new placement group.",
        )
        if self.world > ray.cluster_resources().get("GPU", 0):
            self.log.engine(
                "WARNING",
                "ray_utils.py:407",
                "The number of required GPUs exceeds the total number of available GPUs in the "
                "placement group.",
            )

    def _need_local_gpu(self, node_id: str, driver_ip: str) -> None:
        from ray._private.state import available_resources_per_node

        resources = available_resources_per_node().get(node_id, {})
        if resources.get("GPU", 0) < 1:
            raise EngineFailed(
                f"ValueError: Current node has no GPU available. current_node_resource="
                f"{resources}. vLLM engine cannot start without GPU. Make sure you have at least "
                f"1 GPU available in a node current_node_id={node_id!r} current_ip={driver_ip!r}."
            )

    def _placement_group(self, driver_ip: str) -> Any:
        import ray

        specs: list[dict[str, float]] = [{"GPU": 1.0} for _ in range(self.world)]
        specs[0][f"node:{driver_ip}"] = 0.001
        group = ray.util.placement_group(specs, strategy="PACK")
        self._wait_until_ready(group, specs)
        return group

    def _wait_until_ready(self, group: Any, specs: list[dict[str, float]]) -> None:
        import ray

        started = time.monotonic()
        interval = self.engine.knobs.pg_log_interval
        ready_ref = group.ready()
        while time.monotonic() - started < self.engine.knobs.pg_wait_timeout:
            ready, _ = ray.wait([ready_ref], timeout=interval)
            if ready:
                return
            interval *= 2  # vLLM backs off exponentially between these lines
            self.log.engine(
                "INFO",
                "ray_utils.py:310",
                "Waiting for creating a placement group of specs for "
                f"{int(time.monotonic() - started)} seconds. specs={specs}. Check `ray status` "
                "and `ray list nodes` to see if you have enough resources, and make sure the IP "
                "addresses used by ray cluster are the same as VLLM_HOST_IP environment variable "
                "specified in each node if you are running on a multi-node.",
            )
        gpus = sum(spec.get("GPU", 0) for spec in specs)
        raise EngineFailed(
            f"ValueError: Cannot provide a placement group requiring {gpus} GPUs "
            f"(placement_group_specs={specs}) within {int(self.engine.knobs.pg_wait_timeout)} "
            "seconds.\nTensor parallel size may exceed available GPUs in your cluster. Check "
            "resources with `ray status` and `ray list nodes`.\nIf running on K8s with limited "
            "GPUs, consider reducing --tensor-parallel-size to match available GPU resources."
        )

    def _verify_bundles(self, group: Any, driver_node: str) -> None:
        from ray.util import placement_group_table

        per_node: dict[str, int] = {}
        for node in placement_group_table(group)["bundles_to_node_id"].values():
            per_node[node] = per_node.get(node, 0) + 1
        if driver_node not in per_node:
            raise EngineFailed(
                f"RuntimeError: driver node id {driver_node} is not included in a placement "
                f"group {group.id}. Node id -> bundles {per_node}. You don't have enough GPUs "
                "available in a current node. Check `ray status` and `ray list nodes` to see if "
                "you have available GPUs in a node `{driver_node_id}` before starting an vLLM "
                "engine."
            )
        tp = self.engine.config.tp
        for node, bundles in per_node.items():
            if bundles < tp:
                self.log.engine(
                    "WARNING",
                    "ray_utils.py:207",
                    f"tensor_parallel_size={tp} is bigger than a reserved number of GPUs "
                    f"({bundles} GPUs) in a node {node}. Tensor parallel workers can be spread "
                    "out to 2+ nodes which can degrade the performance unless you have fast "
                    "interconnect across nodes, like Infiniband. To resolve this issue, make sure "
                    f"you have more than {tp} GPUs available at each node.",
                )

    def _start_ranks(self, group: Any) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        worker = ray.remote(RayWorkerWrapper)
        config = self.engine.config
        actors = [
            worker.options(
                num_cpus=0,
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group,
                    placement_group_capture_child_tasks=True,
                    placement_group_bundle_index=rank,
                ),
            ).remote(rank, config.tp, self.world, config.gpu_util)
            for rank in range(self.world)
        ]
        try:
            ray.get([actor.ping.remote() for actor in actors])
        except ray.exceptions.RayActorError as error:
            raise EngineFailed(str(error)) from error
        if self.world > 1:
            self._init_nccl(actors)
        return actors

    def _init_nccl(self, actors: list[Any]) -> None:
        """Every rank joins one NCCL communicator at once, as vLLM's init_device does."""
        import ray

        copied = env_copied_to_workers(self.log)
        node_ips = ray.get([actor.node_ip.remote() for actor in actors])
        comm_id = uuid.uuid4().int >> 64
        try:
            ray.get([actor.init_device.remote(node_ips, comm_id, copied) for actor in actors])
        except ray.exceptions.RayTaskError as error:
            time.sleep(self.engine.knobs.dead_exit_delay)  # Ray forwards the ranks' last lines
            raise EngineFailed(str(error)) from error

    def watch(self) -> None:
        while not self.engine.dead.is_set() and not self.engine.serving.is_set():
            time.sleep(1.0)
            if self.engine.serving.is_set() or self._alive() is False:
                return

    def step(self) -> None:
        """A model step calls every rank; one that died fails it (and kills the engine). A rank
        whose node Ray has not yet declared dead keeps the step waiting, as the DAG does."""
        deadline = time.monotonic() + STEP_WAIT_S
        while time.monotonic() < deadline and self._alive() is None:
            time.sleep(0.5)

    def _alive(self) -> bool | None:
        """Call every rank once: True when all answer, False when one died (reported), None
        while Ray still decides whether a node is gone."""
        import ray

        try:
            ray.get([actor.ping.remote() for actor in self.engine.actors], timeout=10)
            return True
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return None
        except ray.exceptions.RayActorError as error:
            self._report_death(error)
            return False

    def _report_death(self, error: Exception) -> None:
        self.log.engine(
            "ERROR",
            "core.py:1099",
            "EngineCore encountered a fatal error.\nTraceback (most recent call last):\n"
            '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/ray_executor.py", '
            "line 431, in execute_model\n    return self._execute_dag(scheduler_output)\n"
            f"ray.exceptions.{type(error).__name__}: {error}",
        )
        self.log.api("ERROR", "async_llm.py:526", "AsyncLLM output_handler failed.")
        self.log.api(
            "ERROR",
            "async_llm.py:526",
            f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}",
        )
        self.engine.dead.set()


def _ship_code_by_value() -> None:
    """Ray workers on other nodes may lack this repo: pickle our code instead of importing it."""
    from ray import cloudpickle

    for module in (gpu_state, nccl, rdma, memory, unified_memory):
        cloudpickle.register_pickle_by_value(module)
    if __name__ != "__main__":
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # Ray's driver swaps builtins.print at the first worker log line it relays; code shipped by
    # value that holds print (nccl's default writer) would then fail to pickle, now and then.
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")


# vLLM (vllm/ray/ray_env.py) copies these from the driver to every Ray worker, except the
# worker-specific ones and those listed in VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json.
COPIED_PREFIXES = ("VLLM_", "NCCL_", "UCX_", "HF_", "HUGGING_FACE_", "LMCACHE_")
WORKER_SPECIFIC = frozenset(
    {"VLLM_HOST_IP", "VLLM_HOST_PORT", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"}
)


def env_copied_to_workers(log: Log) -> dict[str, str]:
    """What the workers' NCCL gets from the driver's environment (the stand-in applies it to
    NCCL only)."""
    root = Path(os.environ.get("VLLM_CONFIG_ROOT", "~/.config/vllm")).expanduser()
    try:
        kept_off = set(json.loads((root / "ray_non_carry_over_env_vars.json").read_text()))
        log.engine("INFO", "ray_env.py:44", f"RAY_NON_CARRY_OVER_ENV_VARS from config: {kept_off}")
    except (OSError, ValueError, TypeError):
        kept_off = set()
    copied = {
        name: value
        for name, value in os.environ.items()
        if name.startswith(COPIED_PREFIXES) and name not in WORKER_SPECIFIC | kept_off
    }
    log.engine(
        "INFO",
        "ray_env.py:62",
        f"Copying the following environment variables to workers: {sorted(copied)}",
    )
    return copied


# --------------------------------------------------------------------------- loading


def load_weights(engine: Engine) -> None:
    """Log the loader's bar over what is left of VRD_LOAD_SECONDS (tests/testbed/standins/
    loaders.py); faults strike at half of it."""
    knobs, log = engine.knobs, engine.log
    log.engine(
        "INFO", "gpu_model_runner.py:2602", f"Starting to load model {engine.config.model}..."
    )
    if (refused := loaders.problem(engine.config.load_format, knobs.version)) is not None:
        raise EngineFailed(LOADER_TRACE.format(load_format=engine.config.load_format) + refused)
    weights_gib = WEIGHTS_SHARE * engine.config.gpu_util * knobs.gpu_total_mib / 1024
    bar = loaders.Bar(
        engine.config.load_format, knobs.shards, engine.config.world_size, weights_gib
    )
    started = time.monotonic()
    warmup = unified_memory.WARMUP_S if knobs.unified_memory else 0.0
    remaining = max(knobs.load_seconds - (started - PROCESS_STARTED) - warmup, 0.0)
    steps = bar.steps
    for done in range(steps + 1):
        log.write(bar.line(done, time.monotonic() - started), sys.stderr)
        if done == steps // 2:
            strike_load_fault(engine)
        if done < steps:
            _sleep_unless_dead(engine, remaining / steps)
            for _ in range(knobs.shards // steps + (done < knobs.shards % steps)):
                engine.load_shard(knobs.shards, bar.cached)
    took = time.monotonic() - started
    log.engine("INFO", "default_loader.py:267", f"Loading weights took {took:.2f} seconds")
    log.engine(
        "INFO",
        "gpu_model_runner.py:2653",
        f"Model loading took {weights_gib:.4f} GiB and {took + 0.4:.6f} seconds",
    )
    engine.init_kv_cache()


def compile_model(engine: Engine) -> None:
    """torch.compile after the weights, as vLLM on a GPU with AOT compile (its default from
    torch 2.10): a function saved under VLLM_CACHE_ROOT by an earlier start of the same model
    and settings is loaded; else it compiles (VRD_COMPILE_SECONDS more) and saves one. Nothing
    in eager mode. The cache lives and dies with the container unless VLLM_CACHE_ROOT is
    mounted from the node."""
    c = engine.config
    if c.enforce_eager:
        return
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm")
    key = f"{c.model}|{c.tp}|{c.pp}|{c.max_model_len}|{engine.knobs.version}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    saved = Path(root, "torch_compile_cache", "torch_aot_compile", digest, "rank_0_0", "model")
    started = time.monotonic()
    if saved.is_file():
        engine.log.engine(
            "INFO",
            "decorators.py:320",
            f"[backbone] Directly load AOT compilation from path {saved}",
        )
    else:
        _sleep_unless_dead(engine, float(os.environ.get("VRD_COMPILE_SECONDS", "0")))
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(key)
        took = time.monotonic() - started
        engine.log.engine(
            "INFO",
            "backends.py:398",
            f"[backbone] Compiling a graph for compile range (1, {c.max_model_len}) takes "
            f"{took:.2f} s",
        )
        engine.log.engine(
            "INFO", "decorators.py:743", f"[backbone] saved AOT compiled function to {saved}"
        )
    took = time.monotonic() - started
    engine.log.engine(
        "INFO", "monitor.py:62", f"[backbone] torch.compile took {took:.2f} s in total"
    )


def _sleep_unless_dead(engine: Engine, seconds: float) -> None:
    if engine.dead.wait(seconds):
        engine.log.api(
            "ERROR",
            "core_client.py:564",
            "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
        )
        raise SystemExit(1)


def record_event(event: str) -> None:
    """For benchmarks: append ``{"event", "t"}`` (wall clock) to VRD_EVENT_LOG, if set."""
    path = os.environ.get("VRD_EVENT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time()}) + "\n")


def strike_load_fault(engine: Engine) -> None:
    knobs = engine.knobs
    if knobs.fault("crash_during_load"):
        log_oom(engine)
        record_event("crashed")
        if os.getpid() == 1:
            # PID 1 of a container ignores its own SIGKILL (the kernel's OOM killer, outside the
            # namespace, is not ignored): end as that kill would, status 137.
            os._exit(128 + signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if knobs.fault("exit_during_load"):
        code = int(knobs.fault_value("exit_during_load", "1"))
        engine_failed(
            engine.log,
            "RuntimeError: NCCL error: unhandled system error (run with "
            "NCCL_DEBUG=INFO for details)",
        )
        raise SystemExit(code)
    if knobs.fault("hang"):
        while True:
            _sleep_unless_dead(engine, 3600)


def log_oom(engine: Engine) -> None:
    total_gib = engine.knobs.gpu_total_mib / 1024
    in_use = total_gib - 0.59
    engine.log.engine(
        "ERROR",
        "core.py:866",
        "EngineCore failed to start.\nTraceback (most recent call last):\n"
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/model_loader/'
        'default_loader.py", line 277, in load_weights\n'
        "    loaded_weights = model.load_weights(self.get_all_weights(model_config, model))\n"
        '  File "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/model_loader/'
        'weight_utils.py", line 642, in safetensors_weights_iterator\n'
        "    param = f.get_tensor(name)\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        f"total capacity of {total_gib:.2f} GiB of which 590.00 MiB is free. Including "
        f"non-PyTorch memory, this process has {in_use:.2f} GiB memory in use. Of the allocated "
        f"memory {in_use - 1.21:.2f} GiB is allocated by PyTorch, and 1.21 GiB is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
    )


RAY_RPC_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/executor/ray_executor.py", line 503, '
    "in collective_rpc\n    return ray.get(ray_worker_outputs, timeout=timeout)\n"
)
INIT_DEVICE_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu_worker.py", line 180, '
    "in init_device\n    raise ValueError(\n"
)


# Where vLLM 0.32 fails a fast loader it cannot use (weight_utils.py's iterators).
LOADER_TRACE = (
    "Traceback (most recent call last):\n"
    '  File "/usr/local/lib/python3.12/dist-packages/vllm/model_executor/model_loader/'
    'weight_utils.py", line 1360, in {load_format}_weights_iterator\n'
)


def engine_failed(log: Log, cause: str, procs: str = "{}") -> None:
    log.engine("ERROR", "core.py:866", f"EngineCore failed to start.\n{cause}")
    log.api(
        "ERROR",
        "api_server.py:1920",
        "RuntimeError: Engine core initialization failed. See root cause above. "
        f"Failed core proc(s): {procs}",
    )


# --------------------------------------------------------------------------- HTTP


@dataclass
class Stats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    in_flight: int = 0  # requests in the engine (vllm:num_requests_running)
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self.lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self.lock:
                self.in_flight -= 1

    def record(self, prompt: int, generation: Generation) -> None:
        with self.lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generation.completion_tokens
            self.finished[generation.finish_reason] += 1


@dataclass
class App:
    """What the HTTP handlers need."""

    config: ServeConfig
    knobs: Knobs
    engine: Engine
    log: Log
    started: int = field(default_factory=lambda: int(time.time()))
    stats: Stats = field(default_factory=Stats)

    @property
    def names(self) -> list[str]:
        wrong = self.knobs.faults.get("wrong_name")
        return [wrong] if wrong else self.config.served_names

    @property
    def healthy(self) -> bool:
        return not (self.engine.dead.is_set() or self.knobs.fault("health_503"))


def authorized(keys: Sequence[str], header: str | None) -> bool:
    """vLLM's AuthenticationMiddleware.verify_token: ``Bearer <key>`` (the scheme in any case,
    the key everything after the first space) naming one of the keys."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    return any(hmac.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys)


def guarded(keys: Sequence[str], method: str, path: str) -> bool:
    """Does vLLM ask this request for its key? With keys set, every path under its guarded
    prefixes, whatever the route (unknown ones too), except OPTIONS; /health, /metrics,
    /version, /ping stay open."""
    return bool(keys) and method != "OPTIONS" and path.startswith(GUARDED_PREFIXES)


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, app: App) -> None:
        super().__init__(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.app = app


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ApiServer

    def version_string(self) -> str:
        return "uvicorn"

    @property
    def app(self) -> App:
        return self.server.app

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        phrase = HTTPStatus(int(code)).phrase if str(code).isdigit() else ""
        host, port = self.client_address[:2]
        self.app.log.uvicorn(f'{host}:{port} - "{self.requestline}" {code} {phrase}')

    def log_message(self, format: str, *args: Any) -> None:
        return  # the access log above replaces http.server's stderr lines

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""  # always drained: keep-alive
        path = self.path.split("?", 1)[0]
        keys = self.app.config.api_keys
        if guarded(keys, method, path) and not authorized(keys, self.headers.get("Authorization")):
            # Starlette's JSONResponse, as vLLM's middleware sends it: compact JSON.
            self._send(401, UNAUTHORIZED_BODY, "application/json")
            return
        routes: dict[tuple[str, str], Callable[[], None]] = {
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("GET", "/version"): lambda: self._json(200, {"version": self.app.knobs.version}),
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): lambda: self._chat(body),
        }
        handler = routes.get((method, path))
        if handler is not None:
            handler()
        elif any(known == path for _, known in routes):
            self._json(405, {"detail": "Method Not Allowed"})
        else:
            self._json(404, {"detail": "Not Found"})

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _health(self) -> None:
        self._send(200 if self.app.healthy else 503, b"", "application/json")

    def _models(self) -> None:
        app = self.app
        cards = [
            {
                "id": name,
                "object": "model",
                "created": app.started,
                "owned_by": "vllm",
                "root": app.config.model,
                "parent": None,
                "max_model_len": app.config.max_model_len,
                "permission": [_permission(app.started)],
            }
            for name in app.names
        ]
        self._json(200, {"object": "list", "data": cards})

    def _metrics(self) -> None:
        text = prometheus_text(self.app)
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _chat(self, raw: bytes) -> None:
        request, problem = parse_chat_request(raw)
        if problem is not None:
            self._json(400, error_body(problem, "Bad Request", 400))
            return
        model = request.get("model") or self.app.names[0]
        if model not in self.app.names:
            message = f"The model `{model}` does not exist."
            if loaders.at_least(self.app.knobs.version, (0, 32)):  # as the real 0.32.0 says it
                message += f" Valid aliases: {', '.join(self.app.names)}."
            self._json(404, error_body(message, "NotFoundError", 404, "model"))
            return
        self._answer(request, model)

    def _answer(self, request: dict[str, Any], model: str) -> None:
        app = self.app
        with app.stats.running():
            time.sleep(float(app.knobs.faults.get("slow") or 0))
            app.engine.execute_model()
        if app.engine.dead.is_set() or app.knobs.fault("http_500"):
            self._json(500, error_body(ENGINE_DEAD_MESSAGE, "InternalServerError", 500))
            return
        if app.knobs.fault("html_error"):
            self._send(502, BAD_GATEWAY_PAGE.encode(), "text/html")
            return
        messages = request["messages"]
        generation = run_model(app, request)
        used = prompt_tokens(messages)
        app.stats.record(used, generation)
        response = chat_response(app, model, generation, used)
        if request.get("stream"):
            self._stream(response)
        elif app.knobs.fault("malformed_json"):
            body = json.dumps(response).encode()
            self._send(200, body[: len(body) // 2], "application/json")
        else:
            self._json(200, response)

    def _stream(self, response: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("connection", "close")
        self.end_headers()
        for chunk in stream_chunks(response):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


BAD_GATEWAY_PAGE = (
    "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n"
    "</html>\r\n"
)


def _permission(created: int) -> dict[str, Any]:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def parse_chat_request(raw: bytes) -> tuple[dict[str, Any], str | None]:
    """The request, or vLLM's 400 message (FastAPI validation errors, rephrased)."""
    try:
        request = json.loads(raw or b"")
    except ValueError as error:
        detail = {
            "type": "json_invalid",
            "loc": ("body", 0),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": error.args[0].split(":")[0]},
        }
        return {}, f"1 validation error:\n  {detail}"
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        detail = {
            "type": "missing",
            "loc": ("body", "messages"),
            "msg": "Field required",
            "input": request,
        }
        return {}, f"1 validation error:\n  {detail}"
    return request, None


def run_model(app: App, request: dict[str, Any]) -> Generation:
    if app.knobs.fault("empty"):
        return Generation("", "", "stop", 1)
    limit = request.get("max_completion_tokens") or request.get("max_tokens")
    if app.knobs.fault("garbage"):  # token 0, "!" in most tokenizers, until the budget ends
        tokens = int(limit or 16)
        return Generation("!" * tokens, None, "length", tokens)
    kwargs = request.get("chat_template_kwargs") or {}
    thinking = bool(kwargs.get("enable_thinking", True))
    user = [m for m in request["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    prompt = message_text(user[-1].get("content")) if user else ""
    return generate(prompt, limit, app.config.reasoning_parser, thinking)


def chat_response(app: App, model: str, gen: Generation, prompt: int) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": gen.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
    }
    message.update(reasoning_fields(app.knobs.reasoning_field, gen.reasoning))
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": gen.finish_reason,
        "stop_reason": None,
        "token_ids": None,
    }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + gen.completion_tokens,
            "completion_tokens": gen.completion_tokens,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
    }


def reasoning_fields(mode: str, reasoning: str | None) -> dict[str, str | None]:
    """``reasoning`` today; ``reasoning_content`` before late 2025; both in between."""
    names = {"reasoning": ["reasoning"], "reasoning_content": ["reasoning_content"]}
    return {name: reasoning for name in names.get(mode, ["reasoning", "reasoning_content"])}


def stream_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    message = response["choices"][0]["message"]
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{k: message[k]} for k in ("reasoning", "reasoning_content") if message.get(k)]
    if message.get("content"):
        deltas.append({"content": message["content"]})
    base = {k: response[k] for k in ("id", "created", "model")}
    chunks = [_chunk(base, delta, None) for delta in deltas]
    chunks.append(_chunk(base, {}, response["choices"][0]["finish_reason"]))
    return chunks


def _chunk(base: dict[str, Any], delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**base, "object": "chat.completion.chunk", "choices": [choice]}


def prometheus_text(app: App) -> str:
    labels = f'engine="0",model_name="{app.config.served_names[0]}"'
    stats = app.stats
    lines = [
        *_metric(
            "num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [(labels, float(stats.in_flight))],
        ),
        *_metric(
            "num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            [(labels, 0.0)],
        ),
        *_metric(
            "kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [(labels, 0.0)],
        ),
        *_metric(
            "prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            [(labels, float(stats.prompt_tokens))],
        ),
        *_metric(
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            [(labels, float(stats.generation_tokens))],
        ),
        *_metric(
            "request_success_total",
            "counter",
            "Count of successfully processed requests.",
            [
                (f'{labels},finished_reason="{reason}"', float(count))
                for reason, count in stats.finished.items()
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    full = f"vllm:{name}"
    return [
        f"# HELP {full} {help_text}",
        f"# TYPE {full} {kind}",
        *(f"{full}{{{labels}}} {value}" for labels, value in samples),
    ]


# --------------------------------------------------------------------------- main


def bind_api_socket(config: ServeConfig) -> socket.socket:
    """Bound now, listening only after the load: connections are refused meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    return sock


def log_startup(log: Log, knobs: Knobs, args: argparse.Namespace) -> None:
    for name in filter(None, os.environ.get("VRD_PRINT_ENV", "").split(",")):
        print(f"{name}={os.environ.get(name, '')}", flush=True)  # an entrypoint's `env` dump
    log.api("INFO", "api_server.py:1885", f"vLLM API server version {knobs.version}")
    log.api("INFO", "utils.py:253", f"non-default args: {non_default_args(args)}")


def log_ready(log: Log, config: ServeConfig, knobs: Knobs) -> None:
    kv_gib = 0.3 * config.gpu_util * knobs.gpu_total_mib / 1024
    log.engine("INFO", "gpu_worker.py:298", f"Available KV cache memory: {kv_gib:.2f} GiB")
    log.engine(
        "INFO",
        "core.py:210",
        "init engine (profile, create kv cache, warmup model) took 3.12 seconds",
    )
    log.api("INFO", "api_server.py:1634", "Supported tasks: ['generate']")
    log.api(
        "INFO", "api_server.py:1912", f"Starting vLLM server on http://{config.host}:{config.port}"
    )
    log.api("INFO", "launcher.py:37", "Available routes are:")
    for route, methods in (
        ("/health", "GET"),
        ("/metrics", "GET"),
        ("/version", "GET"),
        ("/v1/models", "GET"),
        ("/v1/chat/completions", "POST"),
    ):
        log.api("INFO", "launcher.py:46", f"Route: {route}, Methods: {methods}")
    log.uvicorn(f"Started server process [{log.pid}]")
    log.uvicorn("Waiting for application startup.")
    log.uvicorn("Application startup complete.")


def log_shutdown(log: Log) -> None:
    log.uvicorn("Shutting down")
    log.uvicorn("Waiting for application shutdown.")
    log.uvicorn("Application shutdown complete.")
    log.uvicorn(f"Finished server process [{log.pid}]")


def give_up_unless_ready(engine: Engine) -> None:
    """vLLM's bound on the engine's start (0.33 on): not serving within
    VLLM_ENGINE_READY_TIMEOUT_S of the engine's start, the API server raises its TimeoutError
    and the process exits 1."""
    seconds = int(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))
    if engine.serving.wait(seconds):
        return
    engine.log.traceback(READY_TIMEOUT_TRACE.format(seconds=seconds), "APIServer")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def exit_after_death(engine: Engine, server: ApiServer) -> None:
    engine.dead.wait()
    time.sleep(engine.knobs.dead_exit_delay)
    server.shutdown()


def run(argv: Sequence[str] | None = None) -> int:
    knobs = Knobs.from_env()
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["serve"] and any(w == "--help" or w.startswith("--help=") for w in words):
        print(loaders.serve_help(knobs.version), end="")  # what the product reads of it
        return 0
    parser = build_parser(knobs.version)
    args = parser.parse_args(argv)
    config = serve_config(args)
    log = Log()
    refused = mp_launcher.refusal(config.launch, config.backend, args.api_server_count)
    if refused is not None and not refused.in_api_server:
        log.traceback(refused.text)
        return 1
    if (needed := os.environ.get("VRD_NEEDS_LIBRARY")) and needed not in os.environ.get(
        "LD_LIBRARY_PATH", ""
    ).split(":"):
        # FlashInfer's JIT on a GB10 whose driver is older than the image's CUDA, without the
        # forward-compatibility libraries NGC's entrypoint puts on the library path.
        log.traceback(PTX_TRACE)
        return 1
    if not model_config_found(config.model, os.environ):
        log.traceback(INVALID_MODEL_TRACE.format(model=config.model))
        return 1
    if config.launch.headless or config.launch.follower:
        return run_headless(config, knobs, log)
    if config.reasoning_parser and config.reasoning_parser not in REASONING_PARSERS:
        log.traceback(UNKNOWN_PARSER_TRACE.format(
            name=config.reasoning_parser, known=", ".join(REASONING_PARSERS)))  # fmt: skip
        return 1
    install_sigterm(log)
    log_startup(log, knobs, args)
    sock = bind_api_socket(config)
    if refused is not None:
        log.traceback(refused.text, "APIServer")
        return 1
    engine = Engine(config, knobs, log)
    if loaders.at_least(knobs.version, READY_TIMEOUT_BOUNDS_START):
        threading.Thread(target=give_up_unless_ready, args=(engine,), daemon=True).start()
    try:
        engine.start()
        engine.watch()
        load_weights(engine)
        compile_model(engine)
    except EngineFailed as error:
        engine_failed(log, str(error), error.procs)
        return 1
    except FreeMemoryError as error:
        engine_failed(log, INIT_DEVICE_TRACE + f"ValueError: {error}")
        return 1
    except Exception:
        engine_failed(log, traceback.format_exc().rstrip())
        return 1
    engine.serving.set()  # from now on nothing watches the ranks: see RayRanks.step
    log_ready(log, config, knobs)
    sock.listen(128)
    record_event("listening")
    server = ApiServer(sock, App(config, knobs, engine, log))
    threading.Thread(target=exit_after_death, args=(engine, server), daemon=True).start()
    server.serve_forever(poll_interval=0.2)
    log_shutdown(log)
    # The real mp leader whose engine died of a lost rank shuts its API server down and exits
    # with 0 (seen on 0.32.0): not a clean stop all the same.
    return 1 if engine.dead.is_set() and not config.launch.multi_node else 0


# --------------------------------------------------------------------------- headless


def run_headless(config: ServeConfig, knobs: Knobs, log: Log) -> int:
    """`vllm serve --headless`: no API server. A follower's workers join the leader's
    rendezvous and work until it goes; node-rank 0 takes vLLM's data-parallel branch.
    (A follower without --headless, which vLLM does not check, is taken for one with it.)"""
    # vLLM turns SIGTERM into SystemExit here: a quiet exit 0.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    launch = config.launch
    if not launch.follower:
        return run_dp_headless(log)
    if launch.headless:
        log.emit(None, "INFO", "serve.py:193", mp_launcher.headless_line(knobs.version, launch))
    engine = Engine(config, knobs, log)
    try:
        engine.start_mp()
    except mp_launcher.ExecutorFailed:
        log.traceback(mp_launcher.HEADLESS_START_TRACE)
        return 1
    assert engine.mp is not None
    follow(engine, engine.mp)
    # As the real engine (vllm#32136, seen on 0.32.0): a follower whose leader is gone says
    # nothing and stays up, holding its GPU; it cannot join a new leader. Only a signal ends it.
    threading.Event().wait()
    return 0


def follow(engine: Engine, mp: mp_launcher.MpNode) -> None:
    """Load this node's part of the weights without a bar (only global rank 0 shows one),
    then work until the leader goes."""
    knobs = engine.knobs
    started = time.monotonic()
    remaining = max(knobs.load_seconds - (started - PROCESS_STARTED), 0.0)
    cached = loaders.Bar(engine.config.load_format, knobs.shards, 1, 0.0).cached
    for _ in range(knobs.shards):
        if mp.lost.wait(remaining / knobs.shards):
            return
        engine.load_shard(knobs.shards, cached)
    weights_gib = WEIGHTS_SHARE * engine.config.gpu_util * knobs.gpu_total_mib / 1024
    took = time.monotonic() - started
    engine.log.emit(
        mp.name(mp.launch.ranks[0]),
        "INFO",
        "gpu_model_runner.py:4820",
        f"Model loading took {weights_gib:.2f} GiB memory and {took:.6f} seconds",
    )
    engine.init_kv_cache()
    mp.lost.wait()


def run_dp_headless(log: Log) -> int:
    """`--headless` on node-rank 0: vLLM launches a data-parallel engine that waits for a
    front-end, none comes, it fails after its handshake timeout, and the process exits 0."""
    log.emit(None, "INFO", "serve.py:208", mp_launcher.dp_headless_line())
    time.sleep(mp_launcher.handshake_timeout(os.environ))
    failed = f"EngineCore failed to start.\n{mp_launcher.HANDSHAKE_TRACE}"
    log.emit("EngineCore_DP0", "ERROR", "core.py:1108", failed)
    log.emit(None, "INFO", "serve.py:235", "Shutting down.")
    return 0


def install_sigterm(log: Log) -> None:
    signal.signal(signal.SIGTERM, lambda *_: _terminate(log))


def _terminate(log: Log) -> None:
    log_shutdown(log)
    os._exit(0)


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def main() -> None:
    try:
        code = run()
    except SystemExit as stop:  # argparse, --version, faults
        code = _exit_code(stop)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip Ray's atexit shutdown: it can block for long when the cluster is already gone.
    os._exit(code)


if __name__ == "__main__":
    main()
