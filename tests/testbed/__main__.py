"""python -m tests.testbed up [--nodes N] [--gpu h200|gb10] [--real-vllm] | status | reboot NODE |
down"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from tests.testbed import real_vllm
from tests.testbed.bed import DEFAULT_ROOT, TestBed
from tests.testbed.image import BED_IMAGE, NGC_IMAGE
from tests.testbed.procs import alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed", description=__doc__)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="bed directory")
    verbs = parser.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="start N emulated GPU nodes and write cluster.toml")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--gpu", choices=["h200", "gb10"], default="h200")
    up.add_argument("--no-old-stack", action="store_true", help="no autostart containers")
    up.add_argument(
        "--real-vllm",
        action="store_true",
        help="the real vLLM (CPU build, scripts/real-vllm.sh) instead of the stand-in; mp backend",
    )
    up.add_argument(
        "--docker29",
        action="append",
        default=[],
        metavar="NODE",
        help="this node's engine answers as Docker 29 (repeatable): a cluster upgraded in part",
    )
    up.add_argument(
        "--ngc",
        action="store_true",
        help="the cluster runs an image shaped like NGC's (its entrypoint script)",
    )
    up.add_argument(
        "--first-ip",
        type=int,
        default=11,
        help="node-1 at NET.FIRST_IP (VRD_TEST_NET, default 127.0.0)",
    )
    verbs.add_parser("status", help="what runs on each node")
    reboot = verbs.add_parser("reboot", help="power-cycle one node")
    reboot.add_argument("node")
    verbs.add_parser("down", help="stop and remove everything the bed made")
    args = parser.parse_args(argv)
    try:
        if args.verb == "up":
            image = NGC_IMAGE if args.ngc else BED_IMAGE
            if args.real_vllm:
                if (why := real_vllm.missing()) is not None:
                    raise RuntimeError(why)
                image = real_vllm.NGC_IMAGE if args.ngc else real_vllm.IMAGE
            bed = TestBed.up(
                args.nodes,
                args.gpu,
                args.root,
                not args.no_old_stack,
                args.first_ip,
                image,
                docker29=args.docker29,
            )
            print(
                f"bed up: {len(bed.nodes)} nodes ({args.gpu}) in {bed.bring_up_s:.1f} s",
                file=sys.stderr,
            )
            print(bed.config_path)
        elif args.verb == "status":
            status(TestBed.load(args.root))
        elif args.verb == "reboot":
            TestBed.load(args.root).reboot(args.node)
            print(f"{args.node} rebooted", file=sys.stderr)
        elif args.verb == "down":
            with contextlib.suppress(RuntimeError):
                TestBed.load(args.root).down()
            print("bed removed", file=sys.stderr)
    except (RuntimeError, ValueError, KeyError) as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 2
    return 0


def status(bed: TestBed) -> None:
    print(f"bed at {bed.root} ({bed.gpu}); config {bed.config_path}")
    for node in bed.nodes:
        ssh = "up" if alive(node.spec.sshd_pid) else "DOWN"
        engine = "up" if alive(node.spec.dockerd_pid) else "DOWN"
        containers = "-"
        if engine == "up":
            with contextlib.closing(node.engine.client()) as client:
                containers = (
                    ", ".join(f"{c.name}({c.status})" for c in client.containers.list(all=True))
                    or "none"
                )
        where = f"{node.ip}:{node.spec.ssh_port}"
        print(f"{node.name} {where} sshd {ssh}, docker {engine}, containers: {containers}")


if __name__ == "__main__":
    sys.exit(main())
