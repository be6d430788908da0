"""A ``systemctl`` stand-in that runs a node's real unit files (standard library only).

The bed's ``systemctl`` wrapper runs it inside the node's mount namespace (from the node's sshd,
or the bed's boot), with ``VRD_SYSTEMD_RUN`` (the node's /run/systemd: loaded units, their
state) and ``VRD_JOURNAL`` (its journal, see journal.py). Unit files are read from the node's
/etc/systemd/system, /usr/local/lib/systemd/system and /usr/lib/systemd/system (units.py).

As systemd 252: starts and stops use what the last ``daemon-reload`` (or the boot) loaded: a
changed unit file runs its old definition, with a warning, until then; a unit never loaded (a new
file) is loaded from disk when first named. ``enable``
and ``disable`` work on the files (``[Install] WantedBy=`` links in /etc/systemd/system) and
reload unless ``--no-reload``; ``--now`` also starts or stops. A started unit's processes run
detached (supervisor.py); one that exits non-zero leaves the unit "failed".

As a user that is not root, only what asks is allowed: what changes units fails as systemd's
polkit check fails over SSH ("Interactive authentication required.", exit 1).

Verbs: start, stop, restart, try-restart, is-active, is-failed, is-enabled, enable, disable,
status, show (-p, --value), cat, daemon-reload, reset-failed. Messages and exit codes follow
systemd 252: 0; 1 failure; 3 not active (is-active, status); 4 no such unit (status); 5 not
loaded (start, stop).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    from . import journal, units
except ImportError:  # run as a plain script, as the bed's wrapper does
    import journal  # type: ignore[no-redef]
    import units  # type: ignore[no-redef]

SUPERVISOR = Path(__file__).resolve().with_name("supervisor.py")
EXIT_FAILURE, EXIT_INACTIVE, EXIT_NO_UNIT, EXIT_NOT_LOADED = 1, 3, 4, 5
FLAGS = {"--now", "--no-reload", "--quiet", "-q", "--no-pager", "--value", "--no-block",
         "--system", "--full", "-l", "--plain", "--no-legend", "--no-ask-password"}  # fmt: skip
WITH_VALUE = {"-p": "property", "--property": "property", "-n": "lines", "--lines": "lines"}
JOB_FAILED = {
    "exit-code": "the control process exited with error code",
    "resources": "of unavailable resources or another system error",
    "start-limit-hit": "start of the service was attempted too often",
    "timeout": "a timeout was exceeded",
    "signal": "a fatal signal was delivered to the control process",
}
ICONS = {"active": "●", "activating": "●", "deactivating": "●", "failed": "×", "inactive": "○"}


@dataclass
class Options:
    verb: str = ""
    names: list[str] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)
    properties: list[str] = field(default_factory=list)
    lines: int = 10


def parse_args(argv: list[str]) -> Options:
    options = Options()
    args = iter(argv)
    for arg in args:
        key, _, inline = arg.partition("=")
        if arg in FLAGS:
            options.flags.add({"-q": "--quiet", "-l": "--full"}.get(arg, arg))
        elif key in WITH_VALUE or (arg[:2] in ("-p", "-n") and len(arg) > 2):
            name = WITH_VALUE.get(key) or WITH_VALUE[arg[:2]]
            value = inline if key in WITH_VALUE and inline else None
            if value is None:
                value = arg[2:] if key not in WITH_VALUE else next(args, "")
            if name == "property":
                options.properties += [p for p in value.split(",") if p]
            else:
                options.lines = int(value)
        elif arg.startswith("-"):
            raise SystemExit(f"systemctl: unrecognized option '{arg}'")
        elif not options.verb:
            options.verb = arg
        else:
            options.names.append(arg)
    return options


def say(message: str) -> None:
    print(message, file=sys.stderr)


# What systemd hands to polkit for a user that is not root: over SSH there is no agent to ask
# for a password, so each fails at once (with or without --no-ask-password), exit 1.
MANAGING = {"start", "stop", "restart", "try-restart", "enable", "disable", "daemon-reload",
            "reset-failed"}  # fmt: skip
DENIED = "Interactive authentication required."


def refuse_unprivileged(verb: str, names: list[str]) -> int:
    if verb in ("enable", "disable"):
        say(f"Failed to {verb} unit: {DENIED}")
    elif verb == "daemon-reload":
        say(f"Failed to reload daemon: {DENIED}")
    elif verb == "reset-failed":
        for name in names:
            say(f"Failed to reset failed state of unit {name}: {DENIED}")
    else:
        verb = "restart" if verb == "try-restart" else verb
        for name in names:
            say(f"Failed to {verb} {name}: {DENIED}")
            say(f"See system logs and 'systemctl status {name}' for details.")
    return EXIT_FAILURE


class Manager:
    """One systemctl invocation against the node's stand-in manager."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.runtime = units.Runtime(units.run_dir())
        self._snapshot: dict | None = None

    @property
    def snapshot(self) -> dict:
        if self._snapshot is None:
            self._snapshot = self.runtime.snapshot()
        return self._snapshot

    def loaded(self, name: str) -> units.Found:
        found = units.resolve(self.snapshot, name)
        if found.unit is None and not found.masked:
            fresh = units.on_disk(name)
            if fresh.unit is not None or fresh.masked:
                self._snapshot = self.runtime.load_on_demand(name)
                found = units.resolve(self._snapshot, name)
        return found

    def needs_reload(self, name: str) -> bool:
        loaded, now = self.loaded(name), units.on_disk(name)
        return loaded.unit is not None and loaded.source != now.source

    def warn_if_changed(self, name: str) -> None:
        if self.needs_reload(name):
            say(
                f"Warning: The unit file, source configuration file or drop-ins of {name} changed "
                "on disk. Run 'systemctl daemon-reload' to reload units."
            )

    def state(self, name: str) -> dict:
        """The unit's state; one whose supervisor is gone (a kill, a power cut) failed."""
        state = self.runtime.state(name) or {}
        active = state.get("active", "inactive")
        if active in ("active", "activating", "deactivating") and not self._alive(state):
            state.update(active="failed", sub="failed", result="signal", main_pid=0)
        return state

    def _alive(self, state: dict) -> bool:
        """The supervisor that started the unit still runs: the same pid, started at the same
        time (its command line is no proof: it is empty for a moment while it is exec'd)."""
        started = state.get("supervisor_start")
        return started is not None and units.process_start(state.get("supervisor", 0)) == started

    def active_state(self, name: str) -> str:
        return self.state(name).get("active", "inactive")

    # --- start and stop ---------------------------------------------------------------------

    def start(self, names: list[str]) -> int:
        rc = 0
        for name in self._with_wants(names):
            found = self.loaded(name)
            if found.unit is None or found.unit.problems:
                rc = self._cannot(name, found, "start")
                continue
            self.warn_if_changed(name)
            if self.active_state(name) in ("active", "activating", "reloading"):
                continue
            rc = self._start_one(found.unit) or rc
        return rc

    def _cannot(self, name: str, found: units.Found, verb: str) -> int:
        if found.masked:
            say(f"Failed to {verb} {name}: Unit {name} is masked.")
            return EXIT_FAILURE
        if found.unit is not None:
            say(f"Failed to {verb} {name}: Unit {name} has a bad unit file setting.")
            say(f"See system logs and 'systemctl status {name}' for details.")
            return EXIT_FAILURE
        say(f"Failed to {verb} {name}: Unit {name} not found.")
        return EXIT_NOT_LOADED

    def _with_wants(self, names: list[str]) -> list[str]:
        """The units to start and the services they want, each after what it is After=."""
        wanted: list[str] = []
        todo = list(names)
        while todo:
            name = todo.pop(0)
            if name in wanted:
                continue
            wanted.append(name)
            found = self.loaded(name)
            if found.unit is not None:
                todo += [w for w in found.unit.wants if w.endswith(".service") and w != name]
        wanted = [w for w in wanted if w in names or self.loaded(w).unit is not None]
        ordered: list[str] = []

        def visit(name: str, seen: tuple[str, ...] = ()) -> None:
            if name in ordered or name in seen:
                return
            unit = self.loaded(name).unit
            for before in unit.after if unit else []:
                if before in wanted:
                    visit(before, (*seen, name))
            ordered.append(name)

        for name in wanted:
            visit(name)
        return ordered

    def _start_one(self, unit: units.Unit) -> int:
        name = unit.name
        with self.runtime.locked():
            previous = self.runtime.state(name) or {}
            self.runtime.stop_file(name).unlink(missing_ok=True)
            state = {"active": "activating", "sub": "start-pre", "since": time.time(),
                     "unit": unit.to_json(), "starts": previous.get("starts", [])}  # fmt: skip
            self.runtime.set_state(name, state)
            with open(self.runtime.root / "supervisor.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, str(SUPERVISOR), str(self.runtime.root), name],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env={k: v for k, v in os.environ.items() if k.startswith("VRD_")},
                    start_new_session=True,
                )
            state["supervisor"] = proc.pid
            state["supervisor_start"] = units.process_start(proc.pid)
            self.runtime.set_state(name, state)
        if "--no-block" in self.options.flags:
            return 0
        deadline = time.monotonic() + min(unit.timeout_start_sec, 600) + 5
        while time.monotonic() < deadline:
            state = self.state(name)
            if state.get("forked") and unit.type == "simple":
                return 0
            if state["active"] in ("active", "inactive") or (
                state["active"] == "failed" or state.get("sub") == "auto-restart"
            ):
                break
            proc.poll()
            time.sleep(0.02)
        else:
            state = {"active": "failed", "result": "timeout"}
        if state["active"] in ("active", "inactive"):
            return 0
        reason = JOB_FAILED.get(state.get("result", ""), JOB_FAILED["exit-code"])
        say(f"Job for {name} failed because {reason}.")
        say(f'See "systemctl status {name}" and "journalctl -xeu {name}" for details.')
        return EXIT_FAILURE

    def stop(self, names: list[str]) -> int:
        rc = 0
        for name in names:
            state = self.state(name)
            found = self.loaded(name)
            if found.unit is None and not state:
                say(f"Failed to stop {name}: Unit {name} not loaded.")
                rc = EXIT_NOT_LOADED
                continue
            if found.unit is not None:
                self.warn_if_changed(name)
            if state.get("active") not in ("active", "activating", "deactivating"):
                continue
            self.runtime.stop_file(name).touch()
            timeout = units.Unit.from_json(state["unit"]).timeout_stop_sec
            deadline = time.monotonic() + min(timeout, 600) * 2 + 5
            while time.monotonic() < deadline and self.active_state(name) in (
                "active",
                "activating",
                "deactivating",
            ):
                time.sleep(0.02)
            self.runtime.stop_file(name).unlink(missing_ok=True)
        return rc

    def restart(self, names: list[str], only_active: bool = False) -> int:
        rc = 0
        for name in names:
            found = self.loaded(name)
            if found.unit is None or found.unit.problems:
                rc = self._cannot(name, found, "restart") if not only_active else rc
                continue
            if only_active and self.active_state(name) != "active":
                continue
            self.stop([name])
            rc = self.start([name]) or rc
        return rc

    # --- unit files ---------------------------------------------------------------------------

    def links(self, name: str) -> list[Path]:
        root = Path(units.ETC)
        return [
            p for p in [*root.glob(f"*.wants/{name}"), *root.glob(f"*.requires/{name}")]
            if p.is_symlink() or p.exists()
        ]  # fmt: skip

    def file_state(self, name: str) -> tuple[str, units.Found]:
        found = units.on_disk(name)
        if found.masked:
            return "masked", found
        if found.unit is None:
            return "", found
        if self.links(name):
            return "enabled", found
        return ("disabled" if found.unit.has_install else "static"), found

    def enable(self, names: list[str], enable: bool) -> int:
        changed = False
        for name in names:
            found = units.on_disk(name)
            if found.unit is None and enable:
                say(f"Failed to enable unit: Unit file {name} does not exist.")
                return EXIT_FAILURE
            if not enable:
                for link in self.links(name):
                    link.unlink()
                    say(f'Removed "{link}".')
                    changed = True
                continue
            assert found.unit is not None
            _, instance = units.split_template(name)
            if not found.unit.has_install or (name.endswith("@.service") and instance is None):
                say(NO_INSTALL)
                continue
            fragment = found.unit.fragment
            installs = [("wants", t) for t in found.unit.wanted_by]
            installs += [("requires", t) for t in found.unit.required_by]
            for kind, target in installs:
                link = Path(units.ETC, f"{target}.{kind}", name)
                if link.is_symlink() and os.readlink(link) == fragment:
                    continue
                link.parent.mkdir(parents=True, exist_ok=True)
                link.unlink(missing_ok=True)
                link.symlink_to(fragment)
                say(f"Created symlink {link} → {fragment}.")
                changed = True
        if changed and "--no-reload" not in self.options.flags:
            self.runtime.reload()
            self._snapshot = None
        if "--now" in self.options.flags:
            return self.start(names) if enable else self.stop(names)
        return 0

    # --- queries ------------------------------------------------------------------------------

    def properties(self, name: str) -> dict[str, str]:
        found = self.loaded(name)
        state = self.state(name)
        unit = found.unit
        file_state, _ = self.file_state(name)
        code = state.get("exit_status")
        return {
            "Id": name,
            "Names": name,
            "Description": unit.description if unit else "",
            "LoadState": found.load_state,
            "ActiveState": state.get("active", "inactive"),
            "SubState": state.get("sub", "dead"),
            "Result": state.get("result", "success"),
            "MainPID": str(state.get("main_pid") or 0),
            "ExecMainStatus": str(code if isinstance(code, int) and code >= 0 else 0),
            "UnitFileState": file_state,
            "FragmentPath": unit.fragment if unit else "",
            "DropInPaths": " ".join(unit.dropins) if unit else "",
            "NeedDaemonReload": "yes" if self.needs_reload(name) else "no",
            "Type": unit.type if unit else "",
            "Restart": unit.restart if unit else "",
            "User": unit.user if unit else "",
        }

    def show(self, names: list[str]) -> int:
        blocks = []
        for name in names:
            props = self.properties(name)
            wanted = self.options.properties or list(props)
            lines = []
            for key in wanted:
                value = props.get(key, "")
                lines.append(value if "--value" in self.options.flags else f"{key}={value}")
            blocks.append("\n".join(lines))
        print("\n\n".join(blocks))
        return 0

    def status(self, names: list[str]) -> int:
        rc = 0
        for index, name in enumerate(names):
            found, state = self.loaded(name), self.state(name)
            if found.unit is None and not found.masked:
                say(f"Unit {name} could not be found.")
                rc = EXIT_NO_UNIT
                continue
            self.warn_if_changed(name)
            if index:
                print()
            print(self._status_text(name, found, state))
            if state.get("active", "inactive") not in ("active", "reloading"):
                rc = rc or EXIT_INACTIVE
        return rc

    def _status_text(self, name: str, found: units.Found, state: dict) -> str:
        unit = found.unit
        active, sub = state.get("active", "inactive"), state.get("sub", "dead")
        file_state, _ = self.file_state(name)
        head = f"{ICONS.get(active, '○')} {unit.title if unit else name}"
        where = unit.fragment if unit else "/dev/null"
        preset = "; preset: enabled" if file_state in ("enabled", "disabled") else ""
        loaded = f"{found.load_state} ({where}; {file_state or 'static'}{preset})"
        lines = [head, f"     Loaded: {loaded}"]
        if unit and unit.dropins:
            lines.append(f"    Drop-In: {', '.join(unit.dropins)}")
        since = state.get("since")
        when = ""
        if since:
            stamp = time.strftime("%a %Y-%m-%d %H:%M:%S %Z", time.localtime(since))
            when = f" since {stamp}; {int(time.time() - since)}s ago"
        result = state.get("result", "success")
        detail = f"{active} (Result: {result})" if active == "failed" else f"{active} ({sub})"
        lines.append(f"     Active: {detail}{when}")
        if state.get("main_pid"):
            lines.append(f"   Main PID: {state['main_pid']}")
        tail = journal.entries([name], this_boot=True)[-self.options.lines :]
        if tail:
            lines.append("")
            lines += [journal.short(e) for e in tail]
        return "\n".join(lines)

    def cat(self, names: list[str]) -> int:
        for name in names:
            found = units.on_disk(name)
            if found.unit is None:
                say(f"No files found for {name}.")
                return EXIT_FAILURE
            print(f"# {found.unit.fragment}\n{found.source[1]}", end="")
            for path, text in found.source[2]:
                print(f"\n# {path}\n{text}", end="")
        return 0


NO_INSTALL = """\
The unit files have no installation config (WantedBy=, RequiredBy=, UpheldBy=,
Also=, or Alias= settings in the [Install] section, and DefaultInstance= for
template units). This means they are not meant to be enabled or disabled using systemctl."""


def main(argv: list[str]) -> int:
    try:
        options = parse_args(argv)
    except SystemExit as exc:
        say(str(exc))
        return EXIT_FAILURE
    if not options.verb:
        say("systemctl stand-in: a verb is required")
        return EXIT_FAILURE
    manager = Manager(options)
    names = [units.unit_name(n) for n in options.names]
    quiet = "--quiet" in options.flags
    verb = options.verb
    if verb in MANAGING and os.geteuid() != 0:
        return refuse_unprivileged(verb, names)
    if verb == "daemon-reload":
        manager.runtime.reload()
        return 0
    if verb in ("start", "stop", "restart", "try-restart", "enable", "disable") and not names:
        say("Too few arguments.")
        return EXIT_FAILURE
    if verb == "start":
        return manager.start(names)
    if verb == "stop":
        return manager.stop(names)
    if verb in ("restart", "try-restart"):
        return manager.restart(names, only_active=verb == "try-restart")
    if verb in ("enable", "disable"):
        return manager.enable(names, verb == "enable")
    if verb in ("is-active", "is-failed"):
        states = [manager.active_state(n) for n in names]
        if not quiet:
            print("\n".join(states))
        want = "active" if verb == "is-active" else "failed"
        return 0 if want in states else (EXIT_INACTIVE if verb == "is-active" else EXIT_FAILURE)
    if verb == "is-enabled":
        rc = EXIT_FAILURE
        for name in names:
            value, _ = manager.file_state(name)
            if not value:
                say(f"Failed to get unit file state for {name}: No such file or directory")
                continue
            if not quiet:
                print(value)
            if value in ("enabled", "static", "indirect", "alias", "generated"):
                rc = 0
        return rc
    if verb == "status":
        return manager.status(names)
    if verb == "show":
        return manager.show(names)
    if verb == "cat":
        return manager.cat(names)
    if verb == "reset-failed":
        for name in names or [p.stem for p in (manager.runtime.root / "units").glob("*.json")]:
            state = manager.runtime.state(name)
            if not state:
                continue
            state["starts"] = []  # as systemd, it resets the start rate limit of any unit
            if state.get("active") == "failed":
                state.update(active="inactive", sub="dead", result="success")
            manager.runtime.set_state(name, state)
        return 0
    say(f"Unknown command verb {verb}.")
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
