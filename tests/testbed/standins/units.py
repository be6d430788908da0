"""Unit files as systemd reads them, for the ``systemctl`` stand-in (standard library only).

Unit files come from the node's own search path (``SEARCH_PATH``, inside its mount namespace),
with drop-ins (``NAME.d/*.conf``, a template's ``p@.service.d`` before the instance's) and
template instances (``p@i.service`` from ``p@.service``, specifiers ``%i %I %n %N %p %P %H %%``).
What ``daemon-reload`` saw is kept in ``RUN_DIR/loaded.json``: starts and stops use that, as
systemd uses what it loaded, until the next reload; a unit it never loaded is read from disk
when first named, as systemd 252 does. ``RUN_DIR`` is the node's /run/systemd: the
bed empties it at every boot.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENV_RUN = "VRD_SYSTEMD_RUN"
ETC = "/etc/systemd/system"
SEARCH_PATH = (ETC, "/usr/local/lib/systemd/system", "/usr/lib/systemd/system")
SYSTEM_CONF = "/etc/systemd/system.conf"
# Only root's calls change the manager's files; a user's only ask (systemd loads for them).
PERSISTS = os.geteuid() == 0
# systemd's default PATH for system services (built without split /usr).
EXEC_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"
SUFFIXES = (".service", ".target", ".socket", ".timer", ".mount", ".path", ".slice", ".scope")
TYPES = ("simple", "exec", "oneshot", "forking", "notify", "notify-reload", "dbus", "idle")
RESTARTS = ("no", "on-success", "on-failure", "on-abnormal", "on-watchdog", "on-abort", "always")
TRUE = ("1", "yes", "y", "true", "t", "on")


def run_dir() -> Path:
    return Path(os.environ[ENV_RUN])


def unit_name(arg: str) -> str:
    """What systemctl makes of a name on its command line: ``foo`` is ``foo.service``."""
    return arg if arg.endswith(SUFFIXES) else f"{arg}.service"


def split_template(name: str) -> tuple[str, str | None]:
    """``p@i.service`` -> (``p@.service``, ``i``); other names -> (name, None)."""
    stem, dot, suffix = name.rpartition(".")
    prefix, at, instance = stem.partition("@")
    if not at or not instance:
        return name, None
    return f"{prefix}@{dot}{suffix}", instance


# --- the unit file syntax -----------------------------------------------------------------


def parse_ini(text: str, into: dict[str, dict[str, list[str]]] | None = None) -> dict:
    """systemd's syntax: sections, ``Key=value`` (repeatable; an empty value resets the list),
    ``#``/``;`` comments, lines continued by a trailing backslash."""
    sections = into if into is not None else {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = (pending + " " + raw.strip()) if pending else raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if section is None or not sep:
            continue  # systemd logs and ignores such lines
        key, value = key.strip(), value.strip()
        if value:
            section.setdefault(key, []).append(value)
        else:
            section[key] = []
    return sections


def parse_timespan(text: str, default: float) -> float:
    """``90``, ``90s``, ``1min 30s``, ``100ms``, ``infinity`` -> seconds."""
    text = text.strip()
    if not text:
        return default
    if text == "infinity":
        return float("inf")
    units = {"": 1, "s": 1, "sec": 1, "ms": 0.001, "us": 1e-6, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(number) * units.get(unit, 1)
    return total


def split_words(text: str) -> list[str]:
    """Words as systemd splits a command line or an Environment= value (quotes, escapes)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def expand_variables(words: list[str], env: dict[str, str]) -> list[str]:
    """``$VAR`` as a whole word becomes its value's words; ``${VAR}`` one word, also inline."""
    out: list[str] = []
    for word in words:
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            out += env.get(bare[1], "").split()
            continue
        word = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m[1], ""), word)
        out.append(word.replace("$$", "$"))
    return out


@dataclass
class Command:
    """One Exec*= line: its argv and the prefixes that change how systemd treats it."""

    argv: list[str]
    ignore_failure: bool = False  # "-": a failure does not fail the unit
    argv0: str | None = None  # "@": the second word is what the process sees as argv[0]
    expand: bool = True  # ":" turns variable expansion off

    @classmethod
    def parse(cls, line: str) -> Command:
        ignore, argv0, expand = False, False, True
        while line and line[0] in "-@:+!":
            ignore |= line[0] == "-"
            argv0 |= line[0] == "@"
            expand &= line[0] != ":"
            line = line[1:]
        words = split_words(line)
        if argv0 and len(words) >= 2:
            return cls([words[0], *words[2:]], ignore, words[1], expand)
        return cls(words, ignore, None, expand)

    def resolved(self, env: dict[str, str]) -> list[str]:
        argv = expand_variables(self.argv, env) if self.expand else list(self.argv)
        if argv and "/" not in argv[0]:
            for directory in EXEC_PATH.split(":"):
                candidate = Path(directory, argv[0])
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    argv[0] = str(candidate)
                    break
        return argv

    def shown(self) -> str:
        return shlex.join(self.argv)


# --- one unit -------------------------------------------------------------------------------


@dataclass
class Unit:
    """The settings of one loaded unit that the stand-in acts on (others are parsed, ignored)."""

    name: str
    fragment: str
    dropins: list[str] = field(default_factory=list)
    description: str = ""
    after: list[str] = field(default_factory=list)
    wants: list[str] = field(default_factory=list)
    type: str = "simple"
    exec_start_pre: list[str] = field(default_factory=list)
    exec_start: list[str] = field(default_factory=list)
    exec_start_post: list[str] = field(default_factory=list)
    exec_stop: list[str] = field(default_factory=list)
    environment: list[str] = field(default_factory=list)
    environment_files: list[str] = field(default_factory=list)
    user: str = ""
    working_directory: str = ""
    restart: str = "no"
    restart_sec: float = 0.1
    remain_after_exit: bool = False
    success_exit_status: list[int] = field(default_factory=list)
    timeout_start_sec: float = 90.0
    timeout_stop_sec: float = 90.0
    start_limit_burst: int = 5
    start_limit_interval_sec: float = 10.0
    wanted_by: list[str] = field(default_factory=list)
    required_by: list[str] = field(default_factory=list)
    has_install: bool = False
    problems: list[str] = field(default_factory=list)  # why systemd would refuse to load it

    @property
    def title(self) -> str:
        """How systemd 252 names a unit in its messages: ``name - Description``."""
        return f"{self.name} - {self.description}" if self.description else self.name

    def commands(self, key: str) -> list[Command]:
        return [Command.parse(line) for line in getattr(self, key)]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Unit:
        return cls(**data)


def specifiers(name: str) -> dict[str, str]:
    _, instance = split_template(name)
    stem = name.rpartition(".")[0]
    prefix = stem.partition("@")[0]
    return {
        "i": instance or "",
        "I": unescape(instance or ""),
        "n": name,
        "N": stem,
        "p": prefix,
        "P": unescape(prefix),
        "H": socket.gethostname(),
        "t": "/run",
        "S": "/var/lib",
        "C": "/var/cache",
        "L": "/var/log",
        "E": "/etc",
        "%": "%",
    }


def unescape(text: str) -> str:
    """systemd-escape's inverse for a name: ``-`` is ``/``, ``\\xNN`` a byte."""
    text = text.replace("-", "/")
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m[1], 16)), text)


def expand_specifiers(value: str, name: str) -> str:
    table = specifiers(name)
    return re.sub(r"%(.)", lambda m: table.get(m[1], m[0]), value)


def build(name: str, fragment: str, text: str, dropins: list[tuple[str, str]]) -> Unit:
    sections: dict[str, dict[str, list[str]]] = {}
    parse_ini(text, sections)
    for _, dropin in dropins:
        parse_ini(dropin, sections)

    def values(section: str, key: str) -> list[str]:
        return [expand_specifiers(v, name) for v in sections.get(section, {}).get(key, [])]

    def last(section: str, key: str, default: str = "") -> str:
        found = values(section, key)
        return found[-1] if found else default

    def words(section: str, key: str) -> list[str]:
        return [w for v in values(section, key) for w in v.split()]

    unit = Unit(name, fragment, [path for path, _ in dropins])
    unit.description = last("Unit", "Description")
    unit.after, unit.wants = words("Unit", "After"), words("Unit", "Wants")
    unit.type = last("Service", "Type", "simple")
    for key in ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecStop"):
        setattr(unit, re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower(), values("Service", key))
    unit.environment = [a for v in values("Service", "Environment") for a in split_words(v)]
    unit.environment_files = values("Service", "EnvironmentFile")
    unit.user = last("Service", "User")
    unit.working_directory = last("Service", "WorkingDirectory")
    unit.restart = last("Service", "Restart", "no")
    unit.restart_sec = parse_timespan(last("Service", "RestartSec"), 0.1)
    unit.remain_after_exit = last("Service", "RemainAfterExit", "no").lower() in TRUE
    unit.success_exit_status = [
        int(w) for w in words("Service", "SuccessExitStatus") if w.isdigit()
    ]
    oneshot_default = float("inf") if unit.type == "oneshot" else 90.0
    unit.timeout_start_sec = parse_timespan(last("Service", "TimeoutStartSec"), oneshot_default)
    unit.timeout_stop_sec = parse_timespan(last("Service", "TimeoutStopSec"), 90.0)
    burst = last("Unit", "StartLimitBurst", "5")
    unit.start_limit_burst = int(burst) if burst.isdigit() else 5
    unit.start_limit_interval_sec = parse_timespan(last("Unit", "StartLimitIntervalSec"), 10.0)
    unit.wanted_by, unit.required_by = words("Install", "WantedBy"), words("Install", "RequiredBy")
    unit.has_install = bool(unit.wanted_by or unit.required_by or words("Install", "Alias"))
    unit.problems = _problems(unit)
    return unit


def _problems(unit: Unit) -> list[str]:
    """The settings for which systemd refuses a service ("bad-setting"), as it words them."""
    if not unit.name.endswith(".service"):
        return []
    found = []
    if unit.type not in TYPES:
        found.append(f"Failed to parse service type, ignoring: {unit.type}")
    if unit.restart not in RESTARTS:
        found.append(f"Failed to parse service restart specifier, ignoring: {unit.restart}")
    if not unit.exec_start and not unit.exec_stop:
        found.append("Service has no ExecStart=, ExecStop=, or SuccessAction=. Refusing.")
    elif len(unit.exec_start) > 1 and unit.type != "oneshot":
        found.append(
            "Service has more than one ExecStart= setting, which is only allowed for "
            "Type=oneshot services. Refusing."
        )
    for line in unit.exec_start_pre + unit.exec_start + unit.exec_stop:
        argv = Command.parse(line).argv
        if not argv:
            found.append(f"Empty executable name or zero-length command line: {line}")
    return found


# --- what is on disk, what was loaded -------------------------------------------------------


def _read(path: Path) -> str | None:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return path.read_text()
    return None


def _is_masked(path: Path) -> bool:
    return path.is_symlink() and os.readlink(path) == "/dev/null"


def scan() -> dict[str, Any]:
    """Every service unit file and drop-in on the search path, as systemd loads them."""
    files: dict[str, dict[str, Any]] = {}
    dropins: dict[str, dict[str, tuple[str, str]]] = {}
    for directory in SEARCH_PATH:
        with contextlib.suppress(OSError):
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
            for entry in entries:
                path = Path(entry.path)
                if entry.name.endswith(".service") and entry.name not in files:
                    if _is_masked(path):
                        files[entry.name] = {"fragment": str(path), "text": "", "masked": True}
                    elif (text := _read(path)) is not None:
                        files[entry.name] = {"fragment": str(path), "text": text, "masked": False}
                elif entry.name.endswith(".service.d") and entry.is_dir():
                    mine = dropins.setdefault(entry.name[:-2], {})
                    for conf in sorted(path.glob("*.conf")):
                        if conf.name not in mine and (text := _read(conf)) is not None:
                            mine[conf.name] = (str(conf), text)
    return {
        "files": files,
        "dropins": {
            name: [list(mine[key]) for key in sorted(mine)] for name, mine in dropins.items()
        },
    }


@dataclass
class Found:
    """A unit resolved from a scan: its definition, or why there is none."""

    name: str
    unit: Unit | None
    masked: bool = False
    source: tuple[Any, ...] = ()  # what it was built from, to tell a change on disk

    @property
    def load_state(self) -> str:
        if self.masked:
            return "masked"
        if self.unit is None:
            return "not-found"
        return "bad-setting" if self.unit.problems else "loaded"


def resolve(snapshot: dict[str, Any], name: str) -> Found:
    template, instance = split_template(name)
    files = snapshot["files"]
    entry = files.get(name) or (files.get(template) if instance else None)
    if entry is None:
        return Found(name, None)
    if entry["masked"]:
        return Found(name, None, masked=True)
    dropins = [
        (path, text)
        for base in ([template, name] if instance else [name])
        for path, text in snapshot["dropins"].get(base, [])
    ]
    source = (entry["fragment"], entry["text"], tuple(map(tuple, dropins)))
    return Found(name, build(name, entry["fragment"], entry["text"], dropins), source=source)


def on_disk(name: str) -> Found:
    """The unit as its files are now (a scan limited to this unit's files)."""
    return resolve(scan_unit(name), name)


def scan_unit(name: str) -> dict[str, Any]:
    """What :func:`scan` would find for ``name`` and its template alone."""
    template, _ = split_template(name)
    names = {name, template}
    files: dict[str, dict[str, Any]] = {}
    dropins: dict[str, list[list[str]]] = {}
    for directory in SEARCH_PATH:
        for candidate in names:
            path = Path(directory, candidate)
            if candidate not in files and (path.exists() or path.is_symlink()):
                masked = _is_masked(path)
                text = "" if masked else (_read(path) or "")
                files[candidate] = {"fragment": str(path), "text": text, "masked": masked}
    for candidate in names:
        seen: dict[str, tuple[str, str]] = {}
        for directory in SEARCH_PATH:
            for conf in sorted(Path(directory, f"{candidate}.d").glob("*.conf")):
                if conf.name not in seen and (text := _read(conf)) is not None:
                    seen[conf.name] = (str(conf), text)
        dropins[candidate] = [list(seen[key]) for key in sorted(seen)]
    return {"files": files, "dropins": dropins}


# --- the manager's own settings -------------------------------------------------------------


def parse_env_file(text: str) -> dict[str, str]:
    """An EnvironmentFile=: ``KEY=VALUE`` lines, ``#``/``;`` comments, quoted values."""
    values: dict[str, str] = {}
    for raw in text.replace("\\\n", "").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            quote, value = value[0], value[1:-1]
            if quote == '"':
                value = re.sub(r'\\(["\\$`])', r"\1", value)
        values[key.strip()] = value
    return values


def default_environment() -> dict[str, str]:
    """``[Manager] DefaultEnvironment=`` of system.conf and system.conf.d/*.conf."""
    sections: dict[str, dict[str, list[str]]] = {}
    paths = [Path(SYSTEM_CONF), *sorted(Path(f"{SYSTEM_CONF}.d").glob("*.conf"))]
    for path in paths:
        if (text := _read(path)) is not None:
            parse_ini(text, sections)
    env: dict[str, str] = {}
    for value in sections.get("Manager", {}).get("DefaultEnvironment", []):
        for assignment in split_words(value):
            key, sep, val = assignment.partition("=")
            if sep:
                env[key] = val
    return env


# --- runtime state --------------------------------------------------------------------------


class Runtime:
    """The stand-in manager's state: what was loaded, and each unit's state (``units/*.json``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "units").mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if not PERSISTS:
            yield
            return
        with open(self.root / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @property
    def snapshot_file(self) -> Path:
        return self.root / "loaded.json"

    def snapshot(self) -> dict[str, Any]:
        """What the last daemon-reload loaded (at boot: everything on disk)."""
        try:
            return json.loads(self.snapshot_file.read_text())
        except FileNotFoundError:
            return self.reload()

    def reload(self) -> dict[str, Any]:
        data = scan()
        if PERSISTS:
            write_json(self.snapshot_file, data)
        return data

    def load_on_demand(self, name: str) -> dict[str, Any]:
        """systemd (since 246) loads a unit it never loaded, or did not find, from the files on
        disk now, without a daemon-reload (units it loaded keep what they were loaded with)."""
        with self.locked():
            data = self.snapshot()
            fresh = scan_unit(name)
            for unit, entry in fresh["files"].items():
                if unit not in data["files"]:
                    data["files"][unit] = entry
                    data["dropins"][unit] = fresh["dropins"].get(unit, [])
            if PERSISTS:
                write_json(self.snapshot_file, data)
            return data

    def state_file(self, name: str) -> Path:
        return self.root / "units" / f"{name}.json"

    def state(self, name: str) -> dict[str, Any] | None:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads(self.state_file(name).read_text())
        return None

    def set_state(self, name: str, data: dict[str, Any]) -> None:
        write_json(self.state_file(name), data)

    def stop_file(self, name: str) -> Path:
        return self.root / "units" / f"{name}.stop"


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None when there is none or
    only its zombie: with the pid, it names one process (a pid alone can be reused)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
