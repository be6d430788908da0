"""The ``rdma`` stand-in (iproute2's RDMA tool) and the node RDMA state it reads.

Run as ``python3 path/to/rdma.py ARGS`` (how the test bed's ``rdma`` wrapper execs it, with
``VRD_RDMA_STATE`` set) or as ``python -m tests.testbed.standins.rdma ARGS``. Standard library
only: the vLLM stand-in imports :func:`read_state` and :func:`port_state` inside containers.

The state file (JSON, one per node, written by ``tests/testbed/fabric.py``)::

    {"kernel": true,
     "hcas": [{"ifindex": 0, "name": "rocep1s0f1", "port": 1, "state": "ACTIVE",
               "netdev": "enp1s0f1np1", "node_guid": "3c6d:6603:00a1:0131",
               "sys_image_guid": "3c6d:6603:00a1:0130", "fw": "28.45.4028"}]}

``kernel`` false: a kernel without RDMA support (``Failed to open NETLINK_RDMA socket``, exit 1,
as on the development machine); no file: RDMA support and no device (``[]``). A RoCE port is
ACTIVE only while its ``state`` says so and its netdev has carrier (``operstate`` ``up``, read
from the real /sys/class/net): unplugging the twin (its veth peer down) makes it DOWN/DISABLED,
as on a real ConnectX. ``netdev_index`` is the real ifindex; a netdev that does not exist is not
shown, as the kernel shows none.

Output follows iproute2 6.1 (``rdma/dev.c``, ``rdma/link.c``, ``lib/json_writer.c``): JSON is one
array on one line (``-p`` indents it), text lines end with a space before the newline. Supported:
``[-j] [-p] [-d] dev|link [show|list] [DEV|DEV/PORT]``, ``-V``, ``help``; object and command
names may be abbreviated as iproute2 allows (``rdma l s``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_STATE = "VRD_RDMA_STATE"
VERSION = "6.1.0"
NO_KERNEL = "Failed to open NETLINK_RDMA socket"
SYS_NET = Path("/sys/class/net")


@dataclass(frozen=True)
class Hca:
    """One port of one RDMA device, as the node's state file describes it."""

    ifindex: int
    name: str
    port: int = 1
    state: str = "ACTIVE"  # what the port would be with carrier
    netdev: str | None = None
    node_guid: str = "0000:0000:0000:0000"
    sys_image_guid: str = "0000:0000:0000:0000"
    fw: str = "28.45.4028"
    link_layer: str = "Ethernet"
    pci: str = ""  # its PCI function, e.g. "0002:01:00.1" (not shown by rdma; NCCL logs it)


@dataclass(frozen=True)
class NodeRdma:
    kernel: bool = True
    hcas: tuple[Hca, ...] = ()


def state_path(env: dict[str, str] | None = None) -> Path | None:
    """This node's state file: VRD_RDMA_STATE, or inside the bed's containers the bed's
    per-node file, found by the node's IP (as the vLLM stand-in finds its GPU state)."""
    env = dict(os.environ) if env is None else env
    if env.get(ENV_STATE):
        return Path(env[ENV_STATE])
    if env.get("VRD_BED_ROOT") and env.get("VLLM_HOST_IP"):
        return Path(env["VRD_BED_ROOT"]) / "rdma" / f"{env['VLLM_HOST_IP']}.json"
    return None


def read_state(path: Path | None) -> NodeRdma:
    if path is None or not path.exists():
        return NodeRdma()
    data = json.loads(path.read_text())
    fields = set(Hca.__dataclass_fields__)
    hcas = tuple(Hca(**{k: v for k, v in h.items() if k in fields}) for h in data["hcas"])
    return NodeRdma(kernel=bool(data.get("kernel", True)), hcas=hcas)


def write_state(path: Path, state: NodeRdma) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    hcas = [h.__dict__ for h in state.hcas]
    path.write_text(json.dumps({"kernel": state.kernel, "hcas": hcas}, indent=1) + "\n")


def netdev_index(name: str | None) -> int | None:
    if not name:
        return None
    try:
        return int((SYS_NET / name / "ifindex").read_text())
    except (OSError, ValueError):
        return None


def port_state(hca: Hca) -> tuple[str, str]:
    """(state, physical_state) as the kernel reports them now."""
    try:
        carrier = (SYS_NET / str(hca.netdev) / "operstate").read_text().strip() == "up"
    except OSError:
        carrier = False
    if hca.state == "ACTIVE" and carrier:
        return "ACTIVE", "LINK_UP"
    return ("DOWN", "DISABLED") if hca.state in ("ACTIVE", "DOWN") else (hca.state, "DISABLED")


# --------------------------------------------------------------------------- the tool


def dev_records(state: NodeRdma) -> list[dict[str, Any]]:
    devices: dict[str, dict[str, Any]] = {}
    for hca in state.hcas:
        devices.setdefault(
            hca.name,
            {
                "ifindex": hca.ifindex,
                "ifname": hca.name,
                "node_type": "ca",
                "fw": hca.fw,
                "node_guid": hca.node_guid,
                "sys_image_guid": hca.sys_image_guid,
            },
        )
    return sorted(devices.values(), key=lambda d: d["ifindex"])


def link_records(state: NodeRdma) -> list[dict[str, Any]]:
    records = []
    for hca in sorted(state.hcas, key=lambda h: (h.ifindex, h.port)):
        record: dict[str, Any] = {"ifindex": hca.ifindex, "ifname": hca.name, "port": hca.port}
        state_now, physical = port_state(hca)
        record.update(state=state_now, physical_state=physical)
        index = netdev_index(hca.netdev)
        if index is not None:
            record.update(netdev=hca.netdev, netdev_index=index)
        records.append(record)
    return records


def dev_text(record: dict[str, Any]) -> str:
    return (
        f"{record['ifindex']}: {record['ifname']}: node_type {record['node_type']} "
        f"fw {record['fw']} node_guid {record['node_guid']} "
        f"sys_image_guid {record['sys_image_guid']} "
    )


def link_text(record: dict[str, Any], details: bool) -> str:
    text = f"link {record['ifname']}/{record['port']} state {record['state']} "
    text += f"physical_state {record['physical_state']} "
    if "netdev" in record:
        text += f"netdev {record['netdev']} "
        if details:
            text += f"netdev_index {record['netdev_index']} "
    return text


def _matches(word: str, command: str) -> bool:
    """iproute2's rd_argv_match: the word may abbreviate the command."""
    return len(word) <= len(command) and command.startswith(word)


def _select(records: list[dict[str, Any]], target: str | None, link: bool) -> list[dict] | None:
    if target is None:
        return records
    name, _, port = target.partition("/")
    chosen = [r for r in records if r["ifname"] == name]
    if link and port:
        chosen = [r for r in chosen if str(r["port"]) == port]
    return chosen or None


def _print(records: list[dict[str, Any]], options: set[str], text: Any) -> None:
    if "j" in options:
        if "p" in options:
            print(json.dumps(records, indent=4))
        else:
            print(json.dumps(records, separators=(",", ":")))
    else:
        for record in records:
            print(text(record))


def _usage(prog: str) -> str:
    return (
        f"Usage: {prog} [ OPTIONS ] OBJECT {{ COMMAND | help }}\n"
        f"       {prog} [ -f[orce] ] -b[atch] filename\n"
        "where  OBJECT := { dev | link | resource | system | statistic | help }\n"
        "       OPTIONS := { -V[ersion] | -d[etails] | -j[son] | -p[retty] -r[aw]}\n"
    )


def run(argv: list[str], state: NodeRdma, prog: str = "rdma") -> int:
    options: set[str] = set()
    words = []
    for arg in argv:
        if arg.startswith("-") and not words:
            long = {"--json": "j", "--pretty": "p", "--details": "d", "--version": "V"}
            flag = long.get(arg, arg[1:2])
            if flag not in ("j", "p", "d", "V", "r", "h"):
                sys.stderr.write("Unknown option.\n" + _usage(prog))
                return 1
            options.add(flag)
        else:
            words.append(arg)
    if "V" in options:
        print(f"{prog} utility, iproute2-{VERSION}")
        return 0
    if "h" in options:
        sys.stdout.write(_usage(prog))
        return 0
    if not state.kernel:
        sys.stderr.write(NO_KERNEL + "\n")
        return 1
    if not words or _matches(words[0], "help"):
        sys.stdout.write(_usage(prog))
        return 0
    objects = {"dev": False, "link": True}
    chosen = next((name for name in objects if _matches(words[0], name)), None)
    if chosen is None:
        sys.stderr.write(f"Unknown object '{words[0]}'.\n")
        return 0  # iproute2 6.1 returns success here
    rest = words[1:]
    if rest and any(_matches(rest[0], c) for c in ("show", "list")):
        rest = rest[1:]
    link = objects[chosen]
    records = link_records(state) if link else dev_records(state)
    selected = _select(records, rest[0] if rest else None, link)
    if selected is None:
        wrong = "Wrong device name\n" if link else f"Wrong device name - {rest[0]}\n"
        sys.stderr.write(wrong)
        if "j" in options:
            print("[]")
        return 1
    details = "d" in options
    _print(selected, options, (lambda r: link_text(r, details)) if link else dev_text)
    return 0


def main() -> None:
    state = read_state(state_path())
    sys.exit(run(sys.argv[1:], state, Path(sys.argv[0]).name.removesuffix(".py")))


if __name__ == "__main__":
    main()
