"""vLLM's own multi-node launcher for the vLLM stand-in: ``vllm serve MODEL -tp T --nnodes N
--node-rank r --master-addr A --master-port P [--headless]`` (the "mp" executor of vLLM 0.19).

Node-rank 0 is the leader. Its first worker (global rank 0) hosts PyTorch's TCP store on the
master port, on every address: dual-stack IPv6 first, as the store's libuv backend binds it, so
``ss`` on the leader shows IPv4 peers as ``[::ffff:a.b.c.d]``. Every rank, the leader's own
included, is a client of that store. It connects to ``A:P``, retries refused or unanswered
connections until the deadline, as the store's client does, and keeps the connection open for
the life of the process. The store's master waits until world_size ranks have joined.

Clients connect from whatever address the kernel picks, as PyTorch's do (on the bed's loopback,
127.0.0.1 for every node, as the real vLLM shows there), and name their node's ``VLLM_HOST_IP``
in their hello: the store tells the ranks' nodes by what they say, never by a peer address.

On the connections travels the stand-in's own protocol, not PyTorch's wire format: one JSON
line per rank (its hello), then one back to each (the rank-to-node map and NCCL's communicator
id). Afterwards every model step is a collective: the store sends ``step`` to every rank and
waits for each one's ``ack``, so a frozen rank (SIGSTOP, a hung node) blocks the step, as NCCL's
collective does, until ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (vLLM's 300 s), while the API
server goes on answering /health.

After the rendezvous the ranks connect to each other on ports the kernel picks, as Gloo's pairs
and vLLM's ZMQ queues do: the leader listens on an ephemeral port of its VLLM_HOST_IP, named in
the store's answer, and every follower connects to it before NCCL starts, retrying silently.
A firewall that lets only the master port through leaves both nodes there, up and silent, after
their "world_size=... distributed_init_method=..." lines (seen on the real 0.32.0, whose Gloo
waits the same way), while the follower holds its connection to the master port.

Deadline: ``--distributed-timeout-seconds``, else PyTorch's NCCL default of 600 s.
Test-bed knobs: ``VRD_RENDEZVOUS_TIMEOUT`` (seconds) shortens the deadline;
``VRD_HANDSHAKE_TIMEOUT`` (300 s, vLLM's 5 minutes) is how long a headless node-rank 0 waits
for a front-end.

Texts are vLLM 0.19's and PyTorch's, with the file and line of the call in vLLM 0.19.0; the line
numbers of the torch frames in the tracebacks are approximate.

Standard library only: it runs in the bed's image without Ray.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

try:
    from . import nccl
except ImportError:  # run as a plain script
    import nccl  # type: ignore[no-redef]

DEFAULT_TIMEOUT_S = 600.0  # vLLM passes None without the flag: PyTorch's NCCL default
EXECUTE_MODEL_TIMEOUT_S = 300.0  # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS' default
HANDSHAKE_TIMEOUT_S = 300.0  # vLLM's HANDSHAKE_TIMEOUT_MINS
DP_HEAD_ADDRESS = "tcp://127.0.0.1:29550"  # data_parallel_master_ip and _rpc_port defaults
ENGINE_PROCS = "{'EngineCore_DP0': 1}"  # what the API server lists when the engine core exited
PYDANTIC = "2.12"
SITE = "/usr/local/lib/python3.12/dist-packages"
MP_BACKENDS = (None, "mp", "uni", "external_launcher")

WORKERPROC_INIT_FAILED = (
    "WorkerProc initialization failed due to an exception in a background process. "
    "See stack trace for root cause."
)
RECV_ZERO = (
    "Failed to recv, got 0 bytes. Connection was likely closed. "
    "Did the remote server shutdown or crash?"
)
NCCL_REMOTE = "NCCL error: remote process exited or there was a network error"


# --------------------------------------------------------------------------- tracebacks


def _frame(path: str, line: int, func: str, code: str) -> str:
    where = path if path.startswith("/") else f"{SITE}/{path}"
    return f'  File "{where}", line {line}, in {func}\n    {code}'


def traceback_text(frames: Sequence[str], last: str) -> str:
    return "\n".join(["Traceback (most recent call last):", *frames, last])


def _frames(*specs: tuple[str, int, str, str]) -> tuple[str, ...]:
    return tuple(_frame(*spec) for spec in specs)


SERVE, EXECUTOR = "vllm/entrypoints/cli/serve.py", "vllm/v1/executor/multiproc_executor.py"
API, GPU_WORKER = "vllm/entrypoints/openai/api_server.py", "vllm/v1/worker/gpu_worker.py"
CLI = _frames(
    ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
    ("vllm/entrypoints/cli/main.py", 75, "main", "args.dispatch_function(args)"),
)
HEADLESS = (*CLI, _frame(SERVE, 116, "cmd", "run_headless(args)"))
HEADLESS_CONFIG = (
    *HEADLESS,
    _frame(SERVE, 161, "run_headless", "vllm_config = engine_args.create_engine_config("),
)
SERVER_CONFIG = (
    *CLI,
    *_frames(
        (SERVE, 122, "cmd", "uvloop.run(run_server(args))"),
        (API, 670, "run_server",
         "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
        (API, 684, "run_server_worker", "async with build_async_engine_client("),
        (API, 124, "build_async_engine_client_from_engine_args",
         "vllm_config = engine_args.create_engine_config(usage_context=usage_context)"),
    ),
)  # fmt: skip
WAIT_FOR_WORKERS = _frames(
    ("vllm/v1/executor/abstract.py", 103, "__init__", "self._init_executor()"),
    (EXECUTOR, 190, "_init_executor", "self.workers = WorkerProc.wait_for_ready(unready_workers)"),
    (EXECUTOR, 736, "wait_for_ready", "raise e from None"),
)
# What the engine core (leader) or the headless main process (follower) dies of when a worker
# of its node failed to start.
ENGINE_START_TRACE = traceback_text(
    (
        *_frames(
            ("vllm/v1/engine/core.py", 1098, "run_engine_core",
             "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)"),
            ("vllm/v1/engine/core.py", 124, "__init__",
             "self.model_executor = executor_class(vllm_config)"),
        ),
        *WAIT_FOR_WORKERS,
    ),
    f"Exception: {WORKERPROC_INIT_FAILED}",
)  # fmt: skip
HEADLESS_START_TRACE = traceback_text(
    (
        *HEADLESS,
        _frame(
            SERVE,
            200,
            "run_headless",
            "executor = MultiprocExecutor(vllm_config, monitor_workers=False)",
        ),
        *WAIT_FOR_WORKERS,
    ),
    f"Exception: {WORKERPROC_INIT_FAILED}",
)
WORKER_MAIN = _frames(
    (EXECUTOR, 826, "worker_main", "worker = WorkerProc(*args, **kwargs)"),
    (EXECUTOR, 605, "__init__", "self.worker.init_device()"),
    ("vllm/v1/worker/worker_base.py", 312, "init_device", "self.worker.init_device()"),
)
DISTRIBUTED_INIT = _frames(
    (GPU_WORKER, 263, "init_device", "init_worker_distributed_environment("),
    (GPU_WORKER, 1034, "init_worker_distributed_environment", "init_distributed_environment("),
)
RENDEZVOUS = (
    *DISTRIBUTED_INIT,
    *_frames(
        ("vllm/distributed/parallel_state.py", 1422, "init_distributed_environment",
         "torch.distributed.init_process_group("),
        ("torch/distributed/distributed_c10d.py", 1764, "init_process_group",
         "store, rank, world_size = next(rendezvous_iterator)"),
        ("torch/distributed/rendezvous.py", 269, "_tcp_rendezvous_handler",
         "store = _create_c10d_store("),
        ("torch/distributed/rendezvous.py", 189, "_create_c10d_store", "return TCPStore("),
    ),
)  # fmt: skip
NCCL_INIT = (
    *DISTRIBUTED_INIT,
    *_frames(
        ("vllm/distributed/parallel_state.py", 1518, "ensure_model_parallel_initialized",
         "initialize_model_parallel("),
        ("vllm/distributed/device_communicators/pynccl.py", 148, "__init__",
         "self.comm: ncclComm_t = self.nccl.ncclCommInitRank("),
    ),
)  # fmt: skip
MEMORY = _frames(
    (GPU_WORKER, 283, "init_device",
     "self.requested_memory = request_memory(init_snapshot, self.cache_config)"),
    ("vllm/v1/worker/utils.py", 413, "request_memory", "raise ValueError("),
)  # fmt: skip
ALL_REDUCE = _frames(
    ("vllm/distributed/device_communicators/pynccl.py", 177, "all_reduce",
     "self.nccl.ncclAllReduce("),
    ("vllm/distributed/device_communicators/pynccl_wrapper.py", 373, "NCCL_CHECK",
     'raise RuntimeError(f"NCCL error: {error_str}")'),
)  # fmt: skip
BUSY = _frame(EXECUTOR, 944, "worker_busy_loop", "output = func(*args, **kwargs)")
PROFILE_RUN = (
    BUSY,
    _frame(GPU_WORKER, 367, "determine_available_memory", "self.model_runner.profile_run()"),
    *ALL_REDUCE,
)
MODEL_STEP = (
    BUSY,
    _frame(GPU_WORKER, 803, "execute_model", "output = self.model_runner.execute_model("),
    *ALL_REDUCE,
)
# What the engine core logs when a collective of a worker failed.
WORKER_FAILED_TRACE = traceback_text(
    _frames(
        ("vllm/v1/engine/core.py", 247, "_initialize_kv_caches",
         "available_gpu_memory = self.model_executor.determine_available_memory()"),
        (EXECUTOR, 381, "collective_rpc", "raise RuntimeError("),
    ),
    f"RuntimeError: Worker failed with error '{NCCL_REMOTE}', please check the stack trace "
    "above for the root cause",
)  # fmt: skip
# What the engine core logs when a model step of a worker failed.
STEP_FAILED_TRACE = traceback_text(
    _frames(
        ("vllm/v1/engine/core.py", 1142, "run_busy_loop", "self._process_engine_step()"),
        ("vllm/v1/engine/core.py", 1181, "_process_engine_step",
         "outputs, model_executed = self.step_fn()"),
        ("vllm/v1/engine/core.py", 398, "step", "model_output = future.result()"),
        (EXECUTOR, 381, "get_response", "raise RuntimeError("),
    ),
    WORKER_FAILED_TRACE.splitlines()[-1],
)  # fmt: skip
HANDSHAKE_TRACE = traceback_text(
    _frames(
        ("vllm/v1/engine/core.py", 814, "__init__", "with self._perform_handshakes("),
        ("vllm/v1/engine/core.py", 1021, "startup_handshake", "raise RuntimeError("),
    ),
    "RuntimeError: Did not receive response from front-end process within 5 minutes",
)


# --------------------------------------------------------------------------- flags


@dataclass(frozen=True)
class MpLaunch:
    """One node's part of an mp launch, from its flags."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    headless: bool = False
    world_size: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    @property
    def follower(self) -> bool:
        """Workers for the leader's engine (node_rank_within_dp > 0 in vLLM)."""
        return self.multi_node and self.node_rank > 0

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def ranks(self) -> range:
        """The global ranks of this node's workers."""
        first = self.local_world_size * self.node_rank
        return range(first, first + self.local_world_size)

    @property
    def head_address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def rendezvous_timeout(flag: int | None, env: Mapping[str, str]) -> float:
    timeout = DEFAULT_TIMEOUT_S if flag is None else float(flag)
    knob = env.get("VRD_RENDEZVOUS_TIMEOUT")
    return min(timeout, float(knob)) if knob else timeout


def handshake_timeout(env: Mapping[str, str]) -> float:
    return float(env.get("VRD_HANDSHAKE_TIMEOUT") or HANDSHAKE_TIMEOUT_S)


@dataclass(frozen=True)
class Refusal:
    """A flag combination vLLM refuses: the traceback it exits 1 with."""

    text: str
    in_api_server: bool  # raised once the API server started (its output has its prefix)


Problem = tuple[tuple[str, ...], str]  # traceback frames, last line


def refusal(launch: MpLaunch, backend: str | None, api_server_count: int | None) -> Refusal | None:
    """What vLLM 0.19 refuses, in its order: the CLI, then EngineArgs' asserts, then
    ParallelConfig."""
    if launch.headless and api_server_count is not None and api_server_count > 0:
        last = (
            f"ValueError: --api-server-count={api_server_count} cannot be used with --headless "
            "(no API servers are started in headless mode)."
        )
        frames = (*CLI, _frame(SERVE, 56, "cmd", "raise ValueError("))
        return Refusal(traceback_text(frames, last), in_api_server=False)
    problem = _engine_args_problem(launch) or _parallel_config_problem(launch, backend)
    if problem is None:
        return None
    frames = HEADLESS_CONFIG if launch.headless else SERVER_CONFIG
    return Refusal(traceback_text((*frames, *problem[0]), problem[1]), not launch.headless)


def _engine_args_problem(launch: MpLaunch) -> Problem | None:
    if not launch.multi_node:
        return None
    path, func = "vllm/engine/arg_utils.py", "create_engine_config"
    if launch.world_size % launch.nnodes:
        return (
            (_frame(path, 1644, func, "assert world_size % self.nnodes == 0, ("),),
            f"AssertionError: world_size={launch.world_size} must be divisible by "
            f"nnodes={launch.nnodes}.",
        )
    if launch.node_rank >= launch.nnodes:
        return (
            (_frame(path, 1647, func, "assert self.node_rank < self.nnodes, ("),),
            f"AssertionError: node_rank={launch.node_rank} must be less than "
            f"nnodes={launch.nnodes}.",
        )
    return None


def _parallel_config_problem(launch: MpLaunch, backend: str | None) -> Problem | None:
    if not launch.multi_node or backend in MP_BACKENDS:
        return None
    frames = _frames(
        ("vllm/engine/arg_utils.py", 1758, "create_engine_config",
         "parallel_config = ParallelConfig("),
        ("pydantic/_internal/_dataclasses.py", 121, "__init__",
         "s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)"),
    )  # fmt: skip
    # ParallelConfig is a pydantic dataclass: its __post_init__'s ValueError comes out wrapped.
    last = (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ParallelConfig\n"
        "  Value error, nnodes > 1 can only be set when distributed executor backend is mp, uni "
        "or external_launcher. [type=value_error, input_value=ArgsKwargs((), {'pipeline..."
        "'_api_process_rank': 0}), input_type=ArgsKwargs]\n"
        f"    For further information visit https://errors.pydantic.dev/{PYDANTIC}/v/value_error"
    )
    return frames, last


# --------------------------------------------------------------------------- log lines


def worker_name(rank: int, tp: int, pp: int) -> str:
    """What a worker logs as once its parallel groups exist: Worker[_PPp][_TPt]."""
    name = "Worker"
    if pp > 1:
        name += f"_PP{rank // tp}"
    if tp > 1:
        name += f"_TP{rank % tp}"
    return name


def headless_line(version: str, launch: MpLaunch) -> str:
    return (
        f"Launching vLLM (v{version}) headless multiproc executor, with head node address "
        f"{launch.head_address} for torch.distributed process group."
    )


def leader_line(launch: MpLaunch, env: Mapping[str, str]) -> str:
    return (
        f"DP group leader: node_rank={launch.node_rank}, node_rank_within_dp="
        f"{launch.node_rank}, master_addr={launch.master_addr}, mq_connect_ip={node_ip(env)} "
        f"(local), world_size={launch.world_size}, local_world_size={launch.local_world_size}"
    )


def dp_headless_line() -> str:
    return (
        "Launching 1 data parallel engine(s) in headless mode, with head node address "
        f"{DP_HEAD_ADDRESS}."
    )


def node_ip(env: Mapping[str, str]) -> str:
    """vLLM's get_ip(): VLLM_HOST_IP, else the address of the default route's interface."""
    if env.get("VLLM_HOST_IP"):
        return env["VLLM_HOST_IP"]
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("8.8.8.8", 80))  # vLLM's way: a UDP connect picks a route, sends nothing
        return str(probe.getsockname()[0])
    return "0.0.0.0"


# --------------------------------------------------------------------------- failures


class Emit(Protocol):
    """One log line of a vLLM process (``proc`` None: output vLLM leaves undecorated)."""

    def __call__(self, proc: str | None, level: str, where: str, message: str) -> None: ...


class StoreError(Exception):
    """What PyTorch's TCP store raises; the message is its traceback's last line."""


class ExecutorFailed(Exception):
    """A worker of this node failed to start (its lines are logged): the executor gives up."""


class PeerLost(Exception):
    """A collective failed because another node's ranks are gone (the worker's lines are
    logged)."""


class StepTimedOut(Exception):
    """A rank did not take part in a model step within VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS."""


# --------------------------------------------------------------------------- the TCP store


def _listen(port: int) -> socket.socket:
    """Listen on every address, IPv6 dual-stack first (libuv's order)."""
    try:
        server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address: tuple[str, int] = ("::", port)
    except OSError:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("0.0.0.0", port)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(address)
        server.listen(128)
    except OSError as error:
        server.close()
        code = error.errno or errno.EINVAL
        raise StoreError(
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
            f"local network address. port: {port}, useIpv6: false, code: -{code}, "
            f"name: {errno.errorcode.get(code, 'UNKNOWN')}, message: {os.strerror(code).lower()}"
        ) from None
    return server


def _peer_ip(conn: socket.socket) -> str:
    return str(conn.getpeername()[0]).removeprefix("::ffff:")


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


@dataclass
class StoreServer:
    """Global rank 0's store: counts the ranks that join, then tells each the rank-to-node map;
    afterwards, ``on_lost`` hears of every rank whose connection ends."""

    port: int
    world_size: int
    on_lost: Callable[[int, str], None]
    own: frozenset[str] = frozenset()  # this node's addresses; empty: any
    started: float = field(default_factory=time.monotonic)
    joined: dict[int, tuple[str, socket.socket]] = field(default_factory=dict)
    changed: threading.Condition = field(default_factory=threading.Condition)
    acks: dict[int, int] = field(default_factory=dict)  # per rank: the steps it took part in
    steps: int = 0
    stepping: threading.Lock = field(default_factory=threading.Lock)
    complete: bool = False
    closing: bool = False
    pairs: str = ""  # "ip:port" where the leader's node takes its peers' connections

    def __post_init__(self) -> None:
        self.listener = _listen(self.port)
        threading.Thread(target=self._accept, name="tcpstore", daemon=True).start()

    def _accept(self) -> None:
        while not self.closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.own and str(conn.getsockname()[0]).removeprefix("::ffff:") not in self.own:
                # The bed's nodes share one network namespace: this connection went to another
                # node's address, which on separate hosts would never reach this one.
                _reset(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            hello = json.loads(reader.readline())
            rank = int(hello["rank"])
            conn.sendall(b"{}\n")
            with self.changed:
                self.joined[rank] = (str(hello.get("ip") or _peer_ip(conn)), conn)
                self.changed.notify_all()
            while line := reader.readline():  # EOF when the rank goes
                if line.strip() == b"ack":
                    with self.changed:
                        self.acks[rank] = self.acks.get(rank, 0) + 1
                        self.changed.notify_all()
            if self.complete and not self.closing:
                self.on_lost(rank, self.joined[rank][0])

    def wait_for_workers(self, timeout_s: float) -> None:
        """TCPStore's waitForWorkers: it gives up once the whole seconds elapsed exceed the
        timeout, and says so in those seconds."""
        give_up = int(timeout_s) + 1
        with self.changed:
            while len(self.joined) < self.world_size:
                left = self.started + give_up - time.monotonic()
                if left <= 0:
                    raise StoreError(
                        f"torch.distributed.DistStoreError: Timed out after {give_up} seconds "
                        f"waiting for clients. {len(self.joined)}/{self.world_size} clients joined."
                    )
                self.changed.wait(left)
            self.complete = True
            node_ips = [self.joined[rank][0] for rank in range(self.world_size)]
        message = {"node_ips": node_ips, "comm_id": random.getrandbits(64), "pairs": self.pairs}
        for _, conn in self.joined.values():
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(message).encode() + b"\n")

    def step(self, timeout_s: float) -> None:
        """One collective of every rank: each must answer before the deadline; raises
        StepTimedOut naming the first that did not."""
        with self.stepping:
            self.steps += 1
            for _, conn in self.joined.values():
                with contextlib.suppress(OSError):  # a rank that is gone is noticed by EOF
                    conn.sendall(b"step\n")
            deadline = time.monotonic() + timeout_s
            with self.changed:
                while late := [r for r in self.joined if self.acks.get(r, 0) < self.steps]:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StepTimedOut(late[0])
                    self.changed.wait(min(left, 1.0))

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.listener.close()


class StoreClient:
    """One rank's connection to the store, from this node's address. ``own`` are the addresses
    of this node when the store runs on another one."""

    def __init__(
        self, rank: int, node_ip: str | None, own: frozenset[str], firewalled: bool = False
    ) -> None:
        self.rank = rank
        self.source_ip = node_ip  # said in the hello, not bound: the kernel picks the source
        self.own = own
        self.firewalled = firewalled  # a firewall drops this node's packets to the others
        self.reader: Any = None
        self.sock: socket.socket | None = None

    def connect(self, host: str, port: int, timeout_s: float) -> None:
        """Retry refused and unanswered connections until the deadline, as the store does."""
        deadline = time.monotonic() + timeout_s
        delay = 0.1
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.reader = self._join(host, port, min(left, 2.0))
                return
            except OSError:
                time.sleep(max(min(delay, deadline - time.monotonic()), 0))
                delay = min(delay * 2, 1.0)
        raise StoreError(
            "torch.distributed.DistNetworkError: The client socket has timed out after "
            f"{int(timeout_s * 1000)}ms while trying to connect to ({host}, {port})."
        )

    def _join(self, host: str, port: int, timeout: float) -> Any:
        """Say hello; the store answers each one."""
        sock = self._dial(host, port, timeout)
        try:
            hello = {"rank": self.rank, "ip": self.source_ip}
            sock.sendall(json.dumps(hello).encode() + b"\n")
            reader = sock.makefile("rb")
            if not reader.readline():
                raise ConnectionResetError(errno.ECONNRESET, os.strerror(errno.ECONNRESET))
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        self.sock = sock
        return reader

    def _dial(self, host: str, port: int, timeout: float) -> socket.socket:
        if self.firewalled:  # the SYN is dropped: no answer, no refusal, until the timeout
            time.sleep(timeout)
            raise TimeoutError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT))
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        if address[0] in self.own:
            # The bed's nodes share one network namespace, where the leader's store (on every
            # address) would answer; on separate hosts nothing listens on this node's own.
            raise ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except OSError:
            sock.close()
            raise
        return sock

    def wait_for_rendezvous(self) -> tuple[list[str], int, str]:
        """The rank-to-node map, NCCL's id and where the leader's node takes its peers'
        connections, once every rank joined."""
        line = b""
        with contextlib.suppress(OSError):
            line = self.reader.readline()
        if not line:
            raise StoreError(f"torch.distributed.DistNetworkError: {RECV_ZERO}")
        message = json.loads(line)
        return list(message["node_ips"]), int(message["comm_id"]), str(message["pairs"])

    def watch(self, on_gone: Callable[[], None]) -> None:
        """Take part in every model step; call ``on_gone`` when the store's server goes away
        (its connection ends)."""

        def read() -> None:
            with contextlib.suppress(OSError, ValueError):
                while line := self.reader.readline():
                    if line.strip() == b"step" and self.sock is not None:
                        self.sock.sendall(b"ack\n")
            on_gone()

        threading.Thread(target=read, name=f"store-client-{self.rank}", daemon=True).start()


class PairListener:
    """The leader node's ephemeral port for its peers (Gloo's pairs, vLLM's queues): it keeps
    the connection each other node makes."""

    def __init__(self, host_ip: str | None, advertised: str) -> None:
        self.server = socket.socket()
        self.server.bind((host_ip or "0.0.0.0", 0))  # without VLLM_HOST_IP: every address
        self.server.listen(64)
        self.address = f"{host_ip or advertised}:{self.server.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._accept, name="pairs", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with self.changed:
                self.conns.append(conn)
                self.changed.notify_all()

    def wait_for(self, peers: int) -> None:
        """Until ``peers`` nodes connected: no deadline, as the real engine waits."""
        with self.changed:
            while len(self.conns) < peers:
                self.changed.wait(1.0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.close()


def connect_pairs(address: str) -> socket.socket:
    """A follower's connection to the leader's node, retried silently until it is made (a SYN
    a firewall drops is retried as the kernel and Gloo retry it)."""
    host, port = address.rsplit(":", 1)
    while True:
        sock = socket.socket()
        sock.settimeout(2.0)
        try:
            sock.connect((host, int(port)))
            sock.settimeout(None)
            return sock
        except OSError:
            sock.close()
            time.sleep(0.5)


# --------------------------------------------------------------------------- this node's ranks


@dataclass
class MpNode:
    """This node's workers in an mp launch: they log, join the rendezvous, initialize NCCL
    and notice when the other nodes' ranks go."""

    launch: MpLaunch
    tp: int
    pp: int
    emit: Emit
    write: Callable[[str], None]
    env: Mapping[str, str]
    server: StoreServer | None = None
    pairs: PairListener | None = None  # the leader's
    pair_link: socket.socket | None = None  # a follower's
    clients: list[StoreClient] = field(default_factory=list)
    lost: threading.Event = field(default_factory=threading.Event)
    lost_peers: list[tuple[int, str]] = field(default_factory=list)
    initialized: bool = False

    def name(self, rank: int) -> str:
        return worker_name(rank, self.tp, self.pp) if self.initialized else "Worker"

    def start(self) -> None:
        """vLLM's init_device up to its memory check: the rendezvous, then NCCL. Raises
        ExecutorFailed after logging the failed worker's lines."""
        launch = self.launch
        for local, rank in enumerate(launch.ranks):
            self.emit(
                "Worker",
                "INFO",
                "parallel_state.py:1400",
                f"world_size={launch.world_size} rank={rank} local_rank={local} "
                f"distributed_init_method={launch.init_method} backend=nccl",
            )
        node_ips, comm_id, pairs = self._rendezvous()
        self._meet_peers(pairs)
        self._init_nccl(node_ips, comm_id)
        for client in self.clients:
            client.watch(self.lost.set)

    def devices_ready(self) -> None:
        """init_device is done: the workers log under their parallel ranks from now on."""
        self.initialized = True

    def _meet_peers(self, pairs: str) -> None:
        """The connections on ports the kernel picks, between the leader's node and each
        other node; silent while a firewall drops them."""
        if self.pairs is not None:
            self.pairs.wait_for(self.launch.nnodes - 1)
        elif pairs:
            self.pair_link = connect_pairs(pairs)

    def _rendezvous(self) -> tuple[list[str], int, str]:
        launch = self.launch
        rank = launch.ranks[0]
        try:
            if launch.leader:
                self.server = self._host_store()
            for rank in launch.ranks:
                self._join(rank)
            rank = launch.ranks[0]
            if self.server is not None:
                self.server.wait_for_workers(launch.timeout_s)
            answers = [client.wait_for_rendezvous() for client in self.clients]
            return answers[0]
        except StoreError as error:
            raise self.worker_failed(rank, RENDEZVOUS, str(error)) from None

    def _host_store(self) -> StoreServer:
        # Without VLLM_HOST_IP the node's address is unknown: take any.
        host_ip = self.env.get("VLLM_HOST_IP")
        own = self._own_addresses() if host_ip else frozenset()
        self.pairs = PairListener(host_ip, self.launch.master_addr)
        return StoreServer(
            self.launch.master_port,
            self.launch.world_size,
            self._peer_lost,
            own,
            pairs=self.pairs.address,
        )

    def _own_addresses(self) -> frozenset[str]:
        """This node's addresses, as far as the bed knows them."""
        host_ip = self.env.get("VLLM_HOST_IP")
        return frozenset({"127.0.0.1", "::1", *([host_ip] if host_ip else [])})

    def _join(self, rank: int) -> None:
        own = frozenset() if self.launch.leader else self._own_addresses()
        host_ip = self.env.get("VLLM_HOST_IP")
        # VRD_FAULT firewall:<node ip>: that node cannot reach the others (packets dropped).
        blocked = f"firewall:{host_ip}" in self.env.get("VRD_FAULT", "").split(",")
        client = StoreClient(rank, host_ip, own, firewalled=blocked and not self.launch.leader)
        self.clients.append(client)
        client.connect(self.launch.master_addr, self.launch.master_port, self.launch.timeout_s)

    def _init_nccl(self, node_ips: list[str], comm_id: int) -> None:
        for local, rank in enumerate(self.launch.ranks):
            comm = nccl.Comm(rank, node_ips, comm_id, dev=local)
            try:
                nccl.init_rank(comm, self.env, self.write)
            except nccl.NcclError as error:
                raise self.worker_failed(rank, NCCL_INIT, f"RuntimeError: {error}") from None

    def _peer_lost(self, rank: int, ip: str) -> None:
        if rank not in self.launch.ranks:
            self.lost_peers.append((rank, ip))
            self.lost.set()

    def worker_failed(self, rank: int, frames: Sequence[str], last: str) -> ExecutorFailed:
        """Log what a worker that failed in vLLM's WorkerProc.__init__ logs."""
        self.emit(
            self.name(rank),
            "ERROR",
            "multiproc_executor.py:857",
            "WorkerProc failed to start.\n" + traceback_text((*WORKER_MAIN, *frames), last),
        )
        return ExecutorFailed(rank)

    def memory_failed(self, rank: int, message: str) -> ExecutorFailed:
        return self.worker_failed(rank, MEMORY, f"ValueError: {message}")

    def model_step(self) -> None:
        """One model step on the leader: every rank takes part, so a frozen one blocks it until
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (then StepTimedOut), and a lost one fails it."""
        if not self.lost_peers and self.server is not None:
            timeout = float(self.env.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "") or 0)
            self.server.step(timeout or EXECUTE_MODEL_TIMEOUT_S)
        self.all_reduce()

    def all_reduce(self, frames: Sequence[str] = MODEL_STEP) -> None:
        """A collective of every rank (the profile run, each model step): it fails once the
        ranks of another node are gone, as NCCL does."""
        if not self.lost_peers:
            return
        self.emit(
            self.name(self.launch.ranks[0]),
            "ERROR",
            "multiproc_executor.py:949",
            "WorkerProc hit an exception.\n"
            + traceback_text(frames, f"RuntimeError: {NCCL_REMOTE}"),
        )
        raise PeerLost(self.lost_peers[0])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.pairs is not None:
            self.pairs.close()
