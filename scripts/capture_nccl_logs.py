"""Capture real NCCL INFO logs for the transport parser's fixtures (``tests/fixtures/nccl``).

Run on a machine with two NVIDIA GPUs and PyTorch (NCCL backend)::

    python3 scripts/capture_nccl_logs.py OUTDIR [--timeout 90] [--only a-net-socket,...]

For each scenario in ``SCENARIOS`` it starts two processes of this same script (``--worker``),
one per GPU, that form a ``torch.distributed`` group over NCCL (``MASTER_ADDR=127.0.0.1``)
and run one ``all_reduce``; each rank's stdout and stderr together go to
``OUTDIR/<scenario>.rank<N>.log``. A scenario that does not finish in ``--timeout`` seconds
is killed (its logs keep what was written). ``OUTDIR/commands.txt`` records each scenario's
environment and command line, ``OUTDIR/rc.txt`` each rank's exit status, and
``OUTDIR/facts.txt`` the machine's network, RDMA and GPU facts (``ip``, ``/dev/infiniband``,
``ulimit -l``, ``nvidia-smi -L``, the torch and NCCL versions).

NVLink multicast stays off in every process (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``): the lent machines share
their GPUs' host, and multicast can take those GPUs out of service.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

WORLD_SIZE = 2
# Always set, in every scenario: see the module docstring.
SAFETY_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Variables of the parent environment that must not leak into a scenario.
_CLEARED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
_NET_DEBUG = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
_NO_P2P_SHM = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}

# name -> (what it shows, NCCL variables of its own)
SCENARIOS: dict[str, tuple[str, dict[str, str]]] = {
    "a-net-socket": (
        "P2P and SHM off, so the two GPUs talk over the network path (IB if any HCA, else sockets)",
        {**_NET_DEBUG, **_NO_P2P_SHM},
    ),
    "b-no-socket-interface": (
        "as a, with NCCL_SOCKET_IFNAME naming no interface: bootstrap finds no socket interface",
        {**_NET_DEBUG, **_NO_P2P_SHM, "NCCL_SOCKET_IFNAME": "doesnotexist0"},
    ),
    "c-default-p2p": (
        "full INFO, no subsystem filter, nothing disabled: the normal single-host P2P/NVLink path",
        {"NCCL_DEBUG": "INFO"},
    ),
    "d-ib-hca-absent": (
        "as a, with NCCL_IB_HCA=mlx5_0 asked for (absent on a machine without HCAs)",
        {**_NET_DEBUG, **_NO_P2P_SHM, "NCCL_IB_HCA": "mlx5_0"},
    ),
    "e-net-ib-forced": (
        "as a, with NCCL_NET=IB forced: what NCCL says when the IB network is demanded but absent",
        {**_NET_DEBUG, **_NO_P2P_SHM, "NCCL_NET": "IB"},
    ),
    "f-net-socket-full-info": (
        "as a, with full INFO (no subsystem filter): what a plain NCCL_DEBUG=INFO run logs",
        {"NCCL_DEBUG": "INFO", **_NO_P2P_SHM},
    ),
    "g-ib-disabled": (
        "as a, with NCCL_IB_DISABLE=1, the usual way to force sockets",
        {**_NET_DEBUG, **_NO_P2P_SHM, "NCCL_IB_DISABLE": "1"},
    ),
    "h-socket-ifname-eth0": (
        "as a, with NCCL_SOCKET_IFNAME=eth0 naming the machine's interface",
        {**_NET_DEBUG, **_NO_P2P_SHM, "NCCL_SOCKET_IFNAME": "eth0"},
    ),
}

# Shell commands whose output goes to facts.txt, in order.
FACTS: tuple[str, ...] = (
    "date -u +%Y-%m-%dT%H:%M:%SZ",
    "hostname",
    "uname -a",
    "ls -la /dev/infiniband",
    "ulimit -l",
    "ip -j addr",
    "ip -d -j link",
    "ls /sys/class/infiniband",
    "ls -l /sys/class/net",
    "cat /sys/class/net/eth0/speed",
    "cat /proc/net/fib_trie",
    "python3 -c 'import json, psutil; print(json.dumps(psutil.net_if_addrs(), default=str))'",
    "ibv_devinfo",
    "nvidia-smi -L",
    "nvidia-smi topo -m",
    "python3 -c 'import torch;print(torch.__version__, torch.cuda.nccl.version())'",
    "python3 -m pip show nvidia-nccl-cu13",
    "python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))'",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scenario_env(variables: dict[str, str], rank: int, port: int) -> dict[str, str]:
    """The environment of one rank: the parent's, less its NCCL settings, plus the scenario's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEARED_PREFIXES)}
    env.update(SAFETY_ENV)
    env.update(variables)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD_SIZE),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        PYTHONUNBUFFERED="1",
    )
    return env


def run_scenario(name: str, variables: dict[str, str], outdir: Path, timeout: float) -> list[str]:
    """Start both ranks, wait up to ``timeout`` s, and return one ``rc.txt`` line per rank."""
    port = _free_port()
    command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    with (outdir / "commands.txt").open("a") as out:
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**SAFETY_ENV, **variables}.items())
        out.write(
            f"{name}.rank<N>.log: {shown} MASTER_ADDR=127.0.0.1 MASTER_PORT={port} "
            f"WORLD_SIZE={WORLD_SIZE} RANK=<N> LOCAL_RANK=<N> {shlex.join(command)}\n"
        )
    procs = []
    for rank in range(WORLD_SIZE):
        log = (outdir / f"{name}.rank{rank}.log").open("wb")
        proc = subprocess.Popen(
            command,
            env=scenario_env(variables, rank, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append((rank, proc, log))
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc, log in procs:
        try:
            rc: int | str = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"killed after {timeout:g}s"
        log.close()
        results.append(f"{name}.rank{rank}.log rc={rc}")
    return results


def capture_facts(path: Path) -> None:
    """Each fact command, its exit status, and its stdout and stderr together."""
    with path.open("w") as out:
        for command in FACTS:
            result = subprocess.run(  # noqa: S602 - fixed commands of this script
                command,
                shell=True,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            out.write(f"===== $ {command}  (rc={result.returncode})\n")
            out.write(result.stdout + result.stderr)
            if not (result.stdout + result.stderr).endswith("\n"):
                out.write("\n")


def worker() -> int:
    """One rank: join the NCCL group, all_reduce a tensor of ones, check the sum."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    tensor = torch.ones(1024, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    total = tensor[0].item()
    print(f"capture_nccl_logs: rank {rank} all_reduce sum={total:g} expected={WORLD_SIZE}")
    dist.destroy_process_group()
    return 0 if total == WORLD_SIZE else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", nargs="?", type=Path, help="where the logs are written")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per scenario")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    if args.outdir is None:
        parser.error("OUTDIR is required")
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    outdir: Path = args.outdir
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "commands.txt").write_text("")
    capture_facts(outdir / "facts.txt")
    lines = []
    for name in names:
        about, variables = SCENARIOS[name]
        print(f"capture_nccl_logs: {name}: {about}", flush=True)
        lines += run_scenario(name, variables, outdir, args.timeout)
        print("\n".join(lines[-WORLD_SIZE:]), flush=True)
    (outdir / "rc.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
