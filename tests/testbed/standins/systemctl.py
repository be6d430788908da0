"""A `systemctl` stand-in for the autostart units of an emulated node.

Units are JSON files in ``VRD_UNITS_DIR``: ``<unit>.json`` with ``container``, ``image``,
``command`` (list) and the state keys ``enabled`` and ``active``. Starting a unit runs its
container on the node's Docker engine (``docker`` with the node's ``DOCKER_HOST``), as the
boot-time units of a previous model's stack do. Messages and exit codes follow systemd's.
Only the standard library is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENV_UNITS = "VRD_UNITS_DIR"
# systemd's exit codes: 3 inactive (is-active), 1 disabled/failure, 5 unit not loaded.
EXIT_INACTIVE = 3
EXIT_NOT_LOADED = 5


def units_dir() -> Path:
    return Path(os.environ[ENV_UNITS])


def _path(unit: str) -> Path:
    return units_dir() / f"{unit}.json"


def load(unit: str) -> dict | None:
    try:
        return json.loads(_path(unit).read_text())
    except FileNotFoundError:
        return None


def save(unit: str, data: dict) -> None:
    path = _path(unit)
    path.write_text(json.dumps(data, indent=1))


def define(
    directory: Path, unit: str, container: str, image: str, command: list[str], enabled: bool = True
) -> None:
    """Create a unit (test-bed side)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "container": container,
        "image": image,
        "command": command,
        "enabled": enabled,
        "active": False,
    }
    (directory / f"{unit}.json").write_text(json.dumps(data, indent=1))


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=False)


def start(unit: str, data: dict) -> int:
    if data["active"] and _container_running(data["container"]):
        return 0
    _docker("rm", "-f", data["container"])
    proc = _docker(
        "run",
        "-d",
        "--name",
        data["container"],
        "--network",
        "host",
        data["image"],
        *data["command"],
    )
    if proc.returncode != 0:
        print(
            f"Job for {unit} failed because the control process exited with error code.",
            file=sys.stderr,
        )
        print(proc.stderr, file=sys.stderr, end="")
        return 1
    data["active"] = True
    save(unit, data)
    return 0


def stop(unit: str, data: dict) -> int:
    _docker("stop", "-t", "1", data["container"])
    _docker("rm", "-f", data["container"])
    data["active"] = False
    save(unit, data)
    return 0


def _container_running(name: str) -> bool:
    proc = _docker("inspect", "-f", "{{.State.Running}}", name)
    return proc.returncode == 0 and proc.stdout.strip() == "true"


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("-")]
    if not args:
        print("systemctl stand-in: a verb is required", file=sys.stderr)
        return 1
    verb, units = args[0], args[1:]
    if verb == "daemon-reload":
        return 0
    rc = 0
    for unit in units:
        if "." not in unit:
            unit += ".service"
        data = load(unit)
        if verb == "is-active":
            active = bool(data and data["active"] and _container_running(data["container"]))
            print("active" if active else "inactive")
            rc = rc or (0 if active else EXIT_INACTIVE)
        elif verb == "is-enabled":
            if data is None:
                print(
                    f"Failed to get unit file state for {unit}: No such file or directory",
                    file=sys.stderr,
                )
                rc = 1
            else:
                print("enabled" if data["enabled"] else "disabled")
                rc = rc or (0 if data["enabled"] else 1)
        elif data is None:
            action = verb.capitalize() if verb in ("start", "stop", "restart") else verb
            print(f"Failed to {action.lower()} {unit}: Unit {unit} not loaded.", file=sys.stderr)
            rc = EXIT_NOT_LOADED
        elif verb in ("start", "restart"):
            rc = start(unit, data) or rc
        elif verb == "stop":
            rc = stop(unit, data) or rc
        elif verb in ("enable", "disable"):
            data["enabled"] = verb == "enable"
            save(unit, data)
            link = f"/etc/systemd/system/multi-user.target.wants/{unit}"
            if verb == "disable":
                print(f'Removed "{link}".', file=sys.stderr)
            else:
                print(f"Created symlink {link} → /etc/systemd/system/{unit}.", file=sys.stderr)
        elif verb == "status":
            state = "active (running)" if data["active"] else "inactive (dead)"
            print(
                f"● {unit}\n     Loaded: loaded (/etc/systemd/system/{unit}; "
                f"{'enabled' if data['enabled'] else 'disabled'})\n     Active: {state}"
            )
            rc = rc or (0 if data["active"] else EXIT_INACTIVE)
        else:
            print(f"Unknown command verb {verb}.", file=sys.stderr)
            return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
