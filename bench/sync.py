"""Image and model sync on the bed: our copies beside the plain commands an operator would type,
between the same two nodes, in one run.

    .venv/bin/python -m bench.sync [--model-mib 1024] [--image-mib 512] [--runs 3]

Writes bench/results/sync.md. Each figure is the median of ``--runs`` copies of the same bytes
into a target emptied before each (the image removed from node-2's engine, its model directory
deleted). Both paths are measured: relayed through this machine (paramiko streams; the plain
counterpart is OpenSSH's ``ssh node-1 docker save | ssh node-2 docker load``) and direct (the
source's own ``ssh`` to the target; plain: the same pipe typed on node-1, and ``rsync -a``).
The bed's nodes share this machine's 2 cores and disk: the figures compare, they do not predict
a Spark's link.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import RESULTS
from tests.testbed.bed import TestBed
from vllm_redeploy.config import ClusterConfig, load_config
from vllm_redeploy.nodes import NodeAccess
from vllm_redeploy.sync import plan_sync, route_between, survey, sync_target
from vllm_redeploy.sync.plan import human_bytes

FIRST_IP = 230
IMAGE = "vrd-bed/sync-bench:1"
TARGET_RATIO = 0.9


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def make_image(bed: TestBed, mib: int) -> None:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for i in range(max(mib // 64, 1)):  # layers of files, as an image holds them
            blob = os.urandom(min(64, mib) * 1024 * 1024)
            info = tarfile.TarInfo(f"opt/blob-{i}.bin")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    bed.node("node-1").engine.import_rootfs(data.getvalue(), IMAGE, None)


def make_model(own: Path, mib: int) -> None:
    own.mkdir(parents=True, exist_ok=True)
    (own / "config.json").write_text('{"architectures": ["Qwen3_5MoeForCausalLM"]}\n')
    shards = max(mib // 128, 1)
    for i in range(1, shards + 1):
        with (own / f"model-{i:05d}-of-{shards:05d}.safetensors").open("wb") as f:
            for _ in range(min(128, mib)):
                f.write(os.urandom(1024 * 1024))


def ssh_argv(bed: TestBed, node: str) -> list[str]:
    n = bed.node(node)
    return [
        "ssh", "-i", str(bed.client_key), "-o", f"UserKnownHostsFile={bed.known_hosts}",
        "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-p", str(n.spec.ssh_port),
        f"root@{n.ip}",
    ]  # fmt: skip


def timed(fn: Callable[[], object]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def shell(command: str) -> None:
    subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], check=True, capture_output=True)


def clear_target(bed: TestBed, model: Path) -> None:
    node = bed.node("node-2")
    with contextlib.closing(node.engine.client()) as client, contextlib.suppress(Exception):
        client.images.remove(IMAGE, force=True)
    node.run(["rm", "-rf", "--", str(model)])


def ours(config: ClusterConfig, image: bool) -> tuple[int, float]:
    """One copy by vllm_redeploy.sync (what the flow and `vllm-redeploy sync` run)."""
    chosen = config.sync.model_copy(update={"image": "auto" if image else "off",
                                            "model": "off" if image else "auto"})  # fmt: skip
    config = config.model_copy(update={"sync": chosen})
    with (
        NodeAccess(config.nodes[0], config) as source,
        NodeAccess(config.nodes[1], config) as target,
    ):
        plan = plan_sync(config, [survey(source, config), survey(target, config)])
        (need,) = plan.needs
        image_id = source.docker.image_id(IMAGE)
        route = route_between(source, target, config)
        started = time.monotonic()
        copied = sync_target(source, target, config, need, image_id, route, lambda _: None)
        return sum(c.bytes for c in copied), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mib", type=int, default=1024)
    parser.add_argument("--image-mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vrd-s-", dir="/tmp"))
    bed = TestBed.up(2, "h200", root, first_ip=FIRST_IP, old_stack=False)
    try:
        model = root / "disk" / "model"
        own = {n.name: n.own_dir(model.parent) for n in bed.nodes}
        make_model(own["node-1"] / "model", args.model_mib)
        make_image(bed, args.image_mib)
        say(f"bed up: a {args.image_mib} MiB image and a {args.model_mib} MiB model on node-1")
        rows = measure(bed, model, args.runs)
    finally:
        bed.down()
        shutil.rmtree(root, ignore_errors=True)
    write(args, rows)


def plain_commands(bed: TestBed, model: Path) -> dict[tuple[str, str], str]:
    """What an operator types for the same copies (OpenSSH; ``rsync`` for the model, direct)."""
    n1, n2 = ssh_argv(bed, "node-1"), ssh_argv(bed, "node-2")
    q = shlex.quote
    dest, there = n2[-1], q(str(model))
    options = shlex.join(n2[1:-1])  # the same key, known_hosts and port, without "ssh" and host
    return {
        ("image", "relay"): f"{shlex.join([*n1, 'docker', 'save', IMAGE])} | "
        f"{shlex.join([*n2, 'docker', 'load'])}",
        ("image", "direct"): shlex.join(
            [*n1, f"docker save {IMAGE} | ssh {options} {dest} docker load"]
        ),
        ("model", "relay"): f"{shlex.join([*n1, 'tar', '-C', str(model), '-cf', '-', '.'])} | "
        f"{shlex.join([*n2, f'mkdir -p {there} && tar -C {there} -xf -'])}",
        ("model", "direct"): shlex.join(
            [*n1, f"rsync -a -e {q('ssh ' + options)} {there}/ {dest}:{there}/"]
        ),
    }  # fmt: skip


def measure(
    bed: TestBed, model: Path, runs: int
) -> list[tuple[str, str, list[float], list[float]]]:
    """(what, path, ours' MB/s per copy, plain's MB/s per copy) per figure."""
    plain = plain_commands(bed, model)
    settings = {"vllm": {"model": str(model), "image": IMAGE}}
    direct = {"ssh_key_file": str(bed.client_key), "known_hosts": str(bed.known_hosts)}
    configs = {}
    for path, sync in (("relay", {"direct": "off"}), ("direct", direct)):
        written = bed.write_config(bed.root / f"{path}.toml", sync=sync, **settings)
        configs[path] = load_config(written, env_file=None)
    rows = []
    for what in ("image", "model"):
        for path, config in configs.items():
            mine, theirs = [], []  # MB/s per copy
            for i in range(runs):
                # In turn first and second: neither always finds the other's warm caches. The
                # first run starts with ours, which tells the size (the same every run).
                for who in ("ours", "plain") if i % 2 == 0 else ("plain", "ours"):
                    clear_target(bed, model)
                    if who == "ours":
                        moved, seconds = ours(config, what == "image")
                        mine.append(moved / seconds / 1e6)
                    else:
                        took = timed(lambda key=(what, path): shell(plain[key]))
                        theirs.append(moved / took / 1e6)
                say(f"{what} {path} {i + 1}: ours {mine[-1]:.0f} MB/s, plain {theirs[-1]:.0f} "
                    f"MB/s ({human_bytes(moved)})")  # fmt: skip
            rows.append((what, path, mine, theirs))
    return rows


def write(args: argparse.Namespace, rows: list[tuple[str, str, list[float], list[float]]]) -> None:
    plain_words = {
        ("image", "relay"): "`ssh node-1 docker save \\| ssh node-2 docker load` (here)",
        ("image", "direct"): "`docker save \\| ssh node-2 docker load` on node-1",
        ("model", "relay"): "`ssh node-1 tar -c \\| ssh node-2 tar -x` (here)",
        ("model", "direct"): "`rsync -a -e ssh` from node-1 to node-2",
    }
    lines = [
        "# Image and model sync on the bed",
        "",
        f"`python -m bench.sync --model-mib {args.model_mib} --image-mib {args.image_mib} "
        f"--runs {args.runs}`, {time.strftime('%Y-%m-%d')}: median MB/s of {args.runs} copies "
        "each into an emptied target, ours and plain in turn (each first every other time). "
        "Both nodes share this machine's 2 cores and its disk, so one copy's rate varies by "
        "a third from one to the next: the range says how much.",
        "",
        "| what | path | ours, MB/s (range) | plain, MB/s (range) | plain command "
        "| ours / plain | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for what, path, mine, theirs in rows:
        ratio = statistics.median(mine) / statistics.median(theirs)
        met = "**yes**" if ratio >= TARGET_RATIO else "**no**"
        lines.append(
            f"| {what} | {path} | {_spread(mine)} | {_spread(theirs)} | "
            f"{plain_words[(what, path)]} | {ratio:.2f} | ≥ {TARGET_RATIO} | {met} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sync.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _spread(rates: list[float]) -> str:
    return f"{statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f})"


if __name__ == "__main__":
    main()
