"""Which Prefect API is the controller's: the one a cluster's services (serve, watch, webhook)
keep its standing on (the pause, the crash-loop mark, the lock), so that a command run by hand
reads and writes the same one.

Without an API Prefect starts a temporary one of its own, which no service sees: a pause written
there stops nothing, a run there holds a lock no other run asks. So a command that reads or
writes a cluster's standing looks for the services' API; the command line asks Prefect's own
settings first (PREFECT_API_URL in the environment or a Prefect profile), then, here:

1. the cluster's env file beside its TOML (``spark-pair.toml`` -> ``spark-pair.env``), which the
   services read: its PREFECT_API_URL, with its PREFECT_API_AUTH_STRING;
2. the installed unit ``vllm-redeploy-serve@<cluster>.service`` (or the template
   ``vllm-redeploy-serve@.service`` that `install-controller` writes): its ``Environment=`` and
   ``EnvironmentFile=`` (files win, as in systemd);
3. ``vllm-redeploy-prefect.service``: the host and port its server binds, and its auth string.

Units are looked for in ``$SYSTEMD_UNIT_PATH`` (systemd's own variable; ':'-separated) or else
/etc/systemd/system. Prefect-free: files, and one HTTP request to see that the API answers.
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from dotenv import dotenv_values

from vllm_redeploy.safe_text import one_line, shown

URL_VARIABLE = "PREFECT_API_URL"
AUTH_VARIABLE = "PREFECT_API_AUTH_STRING"
SERVER_AUTH_VARIABLE = "PREFECT_SERVER_API_AUTH_STRING"
DEFAULT_URL = "http://127.0.0.1:4200/api"  # what the units name: the server on this machine
SERVE_UNIT = "vllm-redeploy-serve@{}.service"  # {}: the cluster; "" for the template
PREFECT_UNIT = "vllm-redeploy-prefect.service"
UNIT_DIR = Path("/etc/systemd/system")
UNIT_PATH_VARIABLE = "SYSTEMD_UNIT_PATH"
CHECK_TIMEOUT_S = 5.0
ENVIRONMENT = f"{URL_VARIABLE} in the environment"


@dataclass(frozen=True)
class ControllerApi:
    """A Prefect API, where it was named (in words), and the auth string to send it (never
    shown) with where that came from, when the same place gives one."""

    url: str
    source: str
    auth: str | None = field(default=None, repr=False)
    auth_from: str | None = None

    def environment(self) -> dict[str, str]:
        """What a process sets so that Prefect's client talks to this API."""
        values = {URL_VARIABLE: self.url}
        if self.auth:
            values[AUTH_VARIABLE] = self.auth
        return values

    def is_default(self) -> bool:
        return same_url(self.url, DEFAULT_URL)

    def described(self) -> str:
        return f"the Prefect API at {shown(self.url)} ({self.source})"


@dataclass(frozen=True)
class Lookup:
    """What the services' side names: the API (or None), and each place looked at that could
    not tell (a file this user cannot read), for the message when nothing is found."""

    api: ControllerApi | None
    unread: tuple[str, ...] = ()


def same_url(a: str, b: str) -> bool:
    return a.rstrip("/").lower() == b.rstrip("/").lower()


def unit_dirs(environ: Mapping[str, str]) -> list[Path]:
    """Where installed units are: ``$SYSTEMD_UNIT_PATH`` (a trailing ':' adds the default), or
    /etc/systemd/system, where `install-controller` writes them."""
    raw = environ.get(UNIT_PATH_VARIABLE)
    if not raw:
        return [UNIT_DIR]
    dirs = [Path(p) for p in raw.split(":") if p]
    return [*dirs, UNIT_DIR] if raw.endswith(":") else dirs


def services_api(cluster: str, env_file: Path, dirs: Sequence[Path]) -> Lookup:
    """The API the cluster's services use, from its env file or the installed units."""
    unread: list[str] = []
    own = _env_file(env_file, unread)
    own_auth = own.get(AUTH_VARIABLE)
    own_from = str(env_file.absolute()) if own_auth else None
    if own.get(URL_VARIABLE):
        source = f"{URL_VARIABLE} in {shown(env_file.absolute())}"
        return Lookup(ControllerApi(own[URL_VARIABLE], source, own_auth, own_from), ())
    for api in (_serve_unit_api(cluster, dirs, unread), _server_unit_api(dirs, unread)):
        if api is not None:
            if not api.auth:
                api = replace(api, auth=own_auth, auth_from=own_from)
            return Lookup(api, tuple(unread))
    return Lookup(None, tuple(unread))


def with_services_auth(api: ControllerApi, services: ControllerApi | None) -> ControllerApi:
    """``api`` as Prefect's settings name it; with no auth string of their own, the services'
    one when it is the services' API (never sent to another server)."""
    if api.auth or services is None or not services.auth:
        return api
    if not same_url(api.url, services.url):
        return api
    return replace(api, auth=services.auth, auth_from=services.auth_from)


# --- the installed units ---------------------------------------------------------------------


@dataclass(frozen=True)
class UnitSettings:
    """What systemd would give a unit's process: its environment (variable -> value, origin),
    and its ExecStart= words."""

    path: Path
    environment: dict[str, tuple[str, str]]
    exec_start: tuple[str, ...]

    def value(self, name: str) -> str | None:
        found = self.environment.get(name)
        return found[0] if found else None

    def origin(self, name: str) -> str:
        """The file that sets ``name``: the unit, a drop-in or an EnvironmentFile."""
        return self.environment[name][1] if name in self.environment else str(self.path)

    def source(self, name: str) -> str:
        """Where the unit's ``name`` is set, in words."""
        origin = self.origin(name)
        if Path(origin).suffix in (".service", ".conf"):
            return f"{name} of the installed unit {shown(origin)}"
        return f"{name} in {shown(origin)}, the installed unit {shown(self.path)}'s EnvironmentFile"


def _serve_unit_api(cluster: str, dirs: Sequence[Path], unread: list[str]) -> ControllerApi | None:
    names = [SERVE_UNIT.format(cluster), SERVE_UNIT.format("")]
    unit = read_unit(names, dirs, cluster, unread)
    if unit is None or not unit.value(URL_VARIABLE):
        return None
    auth = unit.value(AUTH_VARIABLE)
    return ControllerApi(
        str(unit.value(URL_VARIABLE)),
        unit.source(URL_VARIABLE),
        auth,
        unit.origin(AUTH_VARIABLE) if auth else None,
    )


def _server_unit_api(dirs: Sequence[Path], unread: list[str]) -> ControllerApi | None:
    unit = read_unit([PREFECT_UNIT], dirs, "", unread)
    if unit is None:
        return None
    host = _flag(unit.exec_start, "--host") or unit.value("PREFECT_SERVER_API_HOST") or "127.0.0.1"
    port = _flag(unit.exec_start, "--port") or unit.value("PREFECT_SERVER_API_PORT") or "4200"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # noqa: S104
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    source = f"the server the installed unit {shown(unit.path)} starts"
    auth = unit.value(SERVER_AUTH_VARIABLE)
    auth_from = unit.origin(SERVER_AUTH_VARIABLE) if auth else None
    return ControllerApi(f"http://{netloc}/api", source, auth, auth_from)


def _flag(argv: Sequence[str], name: str) -> str | None:
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(f"{name}="):
            return word.split("=", 1)[1]
    return None


def read_unit(
    names: Sequence[str], dirs: Sequence[Path], instance: str, unread: list[str]
) -> UnitSettings | None:
    """The first of ``names`` installed in ``dirs`` with its drop-ins (``NAME.d/*.conf`` of
    each of ``names``), ``%i`` as ``instance``; None when none is installed."""
    main = next((d / n for n in names for d in dirs if (d / n).is_file()), None)
    if main is None:
        return None
    files = [main, *(c for n in reversed(names) for d in dirs for c in _drop_ins(d / f"{n}.d"))]
    environment: dict[str, tuple[str, str]] = {}
    env_files: list[str] = []
    exec_start: tuple[str, ...] = ()
    for path in files:
        for key, value in _service_settings(_text(path, unread), instance):
            if key == "Environment":
                _assign(environment, value, str(path))
            elif key == "EnvironmentFile":
                env_files = [*env_files, value] if value else []
            elif key == "ExecStart" and value:
                exec_start = tuple(_words(value.lstrip("@-:+!")))
    for name in env_files:
        path = Path(name.removeprefix("-"))
        for var, val in _env_file(path, unread).items():
            environment[var] = (val, str(path))
    return UnitSettings(main, environment, exec_start)


def _drop_ins(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.glob("*.conf") if p.is_file())
    except OSError:
        return []


def _service_settings(text: str, instance: str) -> Iterator[tuple[str, str]]:
    """``(key, value)`` of each setting in the unit's [Service] section, specifiers resolved."""
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line:
            key, _, value = line.partition("=")
            yield key.strip(), _specifiers(value.strip(), instance)


def _specifiers(value: str, instance: str) -> str:
    return value.replace("%%", "\0").replace("%i", instance).replace("\0", "%")


def _assign(environment: dict[str, tuple[str, str]], value: str, origin: str) -> None:
    """One ``Environment=`` line: ``A=1 "B=two words"``; an empty one clears the list."""
    if not value:
        environment.clear()
        return
    for word in _words(value):
        name, sep, val = word.partition("=")
        if sep:
            environment[name] = (val, origin)


def _words(value: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError:  # an unclosed quote: systemd would refuse the line too
        return []


def _text(path: Path, unread: list[str]) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        unread.append(f"{shown(path)} cannot be read ({one_line(exc.strerror or exc)})")
        return ""


def _env_file(path: Path, unread: list[str]) -> dict[str, str]:
    """An env file's values (none when it does not exist); one it cannot read is noted."""
    if not path.exists():
        return {}
    try:
        with path.open(encoding="utf-8", errors="replace") as stream:
            values = dotenv_values(stream=stream)
    except OSError as exc:
        unread.append(f"{shown(path)} cannot be read ({one_line(exc.strerror or exc)})")
        return {}
    return {k: v for k, v in values.items() if v is not None}


# --- does it answer ---------------------------------------------------------------------------


def auth_headers(auth: str | None, api_key: str | None = None) -> dict[str, str]:
    """The Authorization header Prefect's client sends: basic auth (a self-hosted server's
    auth string), else Prefect Cloud's API key."""
    if auth:
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def problem_with(
    api: ControllerApi, api_key: str | None = None, timeout_s: float = CHECK_TIMEOUT_S
) -> str | None:
    """None when ``api`` answers as a Prefect API and takes the auth string; else why not and
    what to do, in a sentence that names it."""
    base = api.url.rstrip("/")
    try:
        health = httpx.get(f"{base}/health", timeout=timeout_s)
        if health.status_code != 200:
            return (
                f"{api.described()} answers HTTP {health.status_code} at /health, not as a "
                "Prefect API does: check the URL (it ends in /api)."
            )
        version = httpx.get(
            f"{base}/admin/version", headers=auth_headers(api.auth, api_key), timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        return (
            f"{api.described()} does not answer ({_why(exc)}): start it (on the controller: "
            f"`systemctl start vllm-redeploy-prefect`), or point {URL_VARIABLE} at the API the "
            "services use."
        )
    if version.status_code in (401, 403):
        sent = f"with the auth string from {shown(api.auth_from or 'the environment')}"
        sent = sent if api.auth else "without an auth string"
        return (
            f"{api.described()} refuses the request (HTTP {version.status_code}, {sent}): set "
            f"{AUTH_VARIABLE} to the one the services send (in the cluster's env file)."
        )
    return None


def _why(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {CHECK_TIMEOUT_S:g} s"
    if isinstance(exc, httpx.ConnectError):
        cause = exc.__cause__ or exc.__context__
        text = str(getattr(cause, "strerror", None) or exc) or "connection failed"
        return one_line(text)[:200]
    return one_line(exc)[:200] or type(exc).__name__


# --- the messages -----------------------------------------------------------------------------


def nothing_found(cluster: str, env_file: Path, dirs: Sequence[Path], unread: Sequence[str]) -> str:
    """Where a command looked for the controller's API and found none (one sentence)."""
    where = ", ".join(str(d) for d in dirs)
    env_file = env_file.absolute()
    own = f"{shown(env_file)} names none" if env_file.exists() else f"there is no {shown(env_file)}"
    tried = (
        f"cluster {shown(cluster)}: no Prefect API found. {URL_VARIABLE} is not set (neither in "
        f"the environment nor in Prefect's settings or profile), {own}, and the controller's "
        f"units are not installed (no {SERVE_UNIT.format('')} or {PREFECT_UNIT} in "
        f"{shown(where)})"
    )
    return tried + (f"; {'; '.join(unread)}" if unread else "") + "."


def how_to_point(env_file: Path) -> str:
    """The fix, in one sentence."""
    return (
        f"Point it at the controller: `export {URL_VARIABLE}=http://CONTROLLER:4200/api` (and "
        f"{AUTH_VARIABLE}, as in the cluster's env file), or put both in "
        f"{shown(env_file.absolute())}"
    )
