"""A node's journal for the systemd stand-ins, and the ``journalctl`` stand-in that reads it.

Entries are JSON lines in ``VRD_JOURNAL/<unit>.jsonl`` (what journald keeps, per unit): the time,
the boot id, who logged (``systemd`` for the manager's own messages, else the process name) and
the message. They outlive reboots, as a persistent journal does.

``journalctl -u UNIT [-u UNIT2] [-n N] [-b] [-o short|cat] [--no-pager] [-x] [-e] [-q]`` prints
them as journalctl's default (short) format does::

    Nov 30 13:16:01 node-2 python3[4242]: vllm-redeploy-notify: 202 accepted
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ENV_JOURNAL = "VRD_JOURNAL"
ENV_HOST = "VRD_NODE_NAME"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
MANAGER_PID = 1


def journal_dir() -> Path:
    return Path(os.environ[ENV_JOURNAL])


def boot_id() -> str:
    try:
        return Path(BOOT_ID).read_text().strip()
    except OSError:
        return ""


def append(unit: str, ident: str, pid: int, message: str, directory: Path | None = None) -> None:
    entry = {"t": time.time(), "boot": boot_id(), "id": ident, "pid": pid, "msg": message}
    directory = directory or journal_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # One write per line, O_APPEND: lines from a unit's processes and the manager never interleave.
    with open(directory / f"{unit}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def manager(unit: str, message: str) -> None:
    """A message of the manager about ``unit`` (what systemd logs as ``systemd[1]``)."""
    append(unit, "systemd", MANAGER_PID, message)


def entries(units: list[str], this_boot: bool = False) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    current = boot_id()
    for unit in units:
        try:
            lines = (journal_dir() / f"{unit}.jsonl").read_text().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if not this_boot or entry["boot"] == current:
                found.append(entry)
    return sorted(found, key=lambda e: e["t"])


def short(entry: dict[str, Any]) -> str:
    host = os.environ.get(ENV_HOST, "localhost")
    stamp = time.strftime("%b %d %H:%M:%S", time.localtime(entry["t"]))
    return f"{stamp} {host} {entry['id']}[{entry['pid']}]: {entry['msg']}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="journalctl", add_help=True)
    parser.add_argument("-u", "--unit", action="append", default=[])
    parser.add_argument("-n", "--lines", type=int, default=None)
    parser.add_argument("-b", "--boot", action="store_true")
    parser.add_argument("-o", "--output", default="short", choices=["short", "cat"])
    parser.add_argument("-e", "--pager-end", action="store_true")
    parser.add_argument("-x", "--catalog", action="store_true")
    parser.add_argument("-q", "--quiet", action="store_true")
    parser.add_argument("--no-pager", action="store_true")
    parser.add_argument("-f", "--follow", action="store_true")
    args = parser.parse_args(argv)
    if args.follow:
        print("journalctl stand-in: --follow is not supported", file=sys.stderr)
        return 1
    if not args.unit:
        print("journalctl stand-in: only -u UNIT is supported", file=sys.stderr)
        return 1
    units = [u if "." in u else f"{u}.service" for u in args.unit]
    found = entries(units, args.boot)
    limit = args.lines if args.lines is not None else (1000 if args.pager_end else None)
    if limit is not None:
        found = found[-limit:] if limit else []
    if not found:
        if not args.quiet:
            print("-- No entries --")
        return 0
    for entry in found:
        print(entry["msg"] if args.output == "cat" else short(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
