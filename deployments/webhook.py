"""The reboot webhook: a node calls it after boot, and it emits one Prefect event for that boot.

Prefect's own webhooks exist only in Prefect Cloud; this small service stands in for them with a
self-hosted server. ``POST /reboot`` takes ``{"node", "boot_id", "uptime_s"}`` signed with the
shared secret (see ``sign``), keeps a ``vllm.node.rebooted`` event in its spool
(``deployments.spool``) and answers 202 at once. It holds no Prefect credential: the cluster's
watcher posts what the spool holds (``deployments.forwarder``), so a flaw in the one service the
network reaches gives at most a reboot of this cluster to report.
Once every node of the cluster has reported (or ``reboot_delay_s`` after the first did), it hands
one ``vllm.cluster.rebooted`` on too (``reboot_rounds``): the after-reboot run starts on that.

A boot already accepted is answered again (202, same event id) but queued once, so a notice
replayed inside the replay window cannot fill the queue. The service serves no documentation
(``create_app(...).openapi()`` gives the schema to developers), and it guards itself against
clients that connect and send slowly or not at all, without the secret: deadlines for a request's
headers and body, a cap on connections sized under the open-file limit, where a newcomer closes
the oldest connection still sending, and a log that says "N more like this suppressed" instead
of repeating one warning (``GuardedH11Protocol``, ``FloodFilter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import resource
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Protocol

import h11
import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from deployments.event_sender import Refusal, reboot_event, reboot_event_id
from deployments.reboot_rounds import RebootRounds
from deployments.spool import Spool, spool_base, spool_problem
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.names import webhook_path
from vllm_redeploy.safe_text import one_line, shown

SIGNATURE_HEADER = "X-Vllm-Redeploy-Signature"
TIMESTAMP_HEADER = "X-Vllm-Redeploy-Timestamp"
SECRET_ENV = "VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET"  # noqa: S105 - a variable name
MIN_SECRET_CHARS = 16
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_SIGNATURE = re.compile(r"^sha256=([0-9a-fA-F]{64})$")
RECENT_BOOTS = 8  # per node: a replayed notice of a boot before the last few is queued again
# Open files kept free besides the connections: the listener, the event loop's, Prefect's
# connections, spool writes, logs.
RESERVED_FILES = 32

log = logging.getLogger("vllm_redeploy.webhook")

NO_SECRET = (
    "The reboot webhook has no shared secret, so it could not tell a node's call from anyone "
    f"else's and refuses to start. Set {SECRET_ENV} in this service's environment (or in .env) "
    'to a long random value, e.g. the output of `python3 -c "import secrets; '
    'print(secrets.token_hex(32))"`, then run `vllm-redeploy install-notifier NODE` for each '
    "node so that its notifier signs with the same secret."
)


class Sender(Protocol):
    """What the app needs from where events go (the ``Spool``, an ``EventSender``, a double)."""

    @property
    def pending(self) -> int: ...

    def offer(self, event: dict[str, Any]) -> Refusal | None: ...


class RebootNotice(BaseModel):
    """What a node's notifier sends after boot."""

    model_config = ConfigDict(strict=True, extra="ignore")

    node: str = Field(
        min_length=1, max_length=253, description="The node's name in the cluster configuration."
    )
    boot_id: uuid.UUID = Field(description="/proc/sys/kernel/random/boot_id of this boot.")
    uptime_s: float = Field(
        ge=0, allow_inf_nan=False, description="Seconds since boot (first field of /proc/uptime)."
    )


class Accepted(BaseModel):
    accepted: bool = True
    event_id: str = Field(description="Id of the Prefect event (the same for every retry).")


class Problem(BaseModel):
    error: str


class Health(BaseModel):
    status: str = "ok"
    pending_events: int = Field(description="Events accepted and not yet posted to Prefect.")


def sign(secret: str, timestamp: int | str, body: bytes) -> str:
    """The signature header value: ``sha256=`` + hex HMAC-SHA256 of ``f"{timestamp}." + body``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def webhook_secret(config: ClusterConfig) -> str:
    """The configured shared secret, or ValueError saying how to set one."""
    secret = config.secrets.webhook_secret
    value = secret.get_secret_value() if secret is not None else ""
    if not value:
        raise ValueError(NO_SECRET)
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(
            f"The reboot webhook's shared secret ({SECRET_ENV}) is shorter than "
            f"{MIN_SECRET_CHARS} characters, which an eavesdropper could guess from one signed "
            'call. Use a long random value, e.g. `python3 -c "import secrets; '
            'print(secrets.token_hex(32))"`, and install it again on each node.'
        )
    return value


def _problem(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_app(
    clusters: ClusterConfig | Sequence[ClusterConfig],
    sender: Sender,
    state_dir: Path | None = None,
) -> FastAPI:
    """The webhook app; events go to ``sender``. Each cluster's nodes post to
    ``/clusters/NAME/reboot``, signed with that cluster's secret; with one cluster ``/reboot``
    works too (notifiers installed before several clusters shared a webhook). With
    ``state_dir``, each cluster's reboot round is kept there and outlives a restart."""
    configs = [clusters] if isinstance(clusters, ClusterConfig) else list(clusters)
    for config in configs:
        webhook_secret(config)
    names = ", ".join(repr(c.name) for c in configs)
    app = FastAPI(
        title="vllm-redeploy reboot webhook",
        version="1",
        description=f"Nodes of cluster {names} report their boots here.",
        docs_url=None,  # nothing for strangers to browse; app.openapi() still gives the schema
        redoc_url=None,
        openapi_url=None,
    )

    @app.get("/healthz", response_model=Health)
    def healthz() -> Health:
        return Health(pending_events=sender.pending)

    for config in configs:
        state = state_dir / f"round-{config.name}.state" if state_dir is not None else None
        rounds = RebootRounds(config, lambda event: sender.offer(event) is None, state)
        boots = RecentBoots()
        route = (app, config, sender, rounds, boots)
        _add_reboot_route(*route, f"{webhook_path(config.name)}/reboot")
        if len(configs) == 1:
            _add_reboot_route(*route, "/reboot")
    return app


class RecentBoots:
    """The last few boots accepted from each node of one cluster."""

    def __init__(self) -> None:
        self._boots: dict[str, deque[str]] = {}

    def __contains__(self, node_boot: tuple[str, str]) -> bool:
        node, boot = node_boot
        return boot in self._boots.get(node, ())

    def add(self, node: str, boot: str) -> None:
        self._boots.setdefault(node, deque(maxlen=RECENT_BOOTS)).append(boot)


def _add_reboot_route(
    app: FastAPI,
    config: ClusterConfig,
    sender: Sender,
    rounds: RebootRounds,
    boots: RecentBoots,
    path: str,
) -> None:
    key = webhook_secret(config).encode()
    nodes = {n.name for n in config.nodes}
    window_s = config.webhook.replay_window_s
    limit = config.webhook.max_body_bytes

    @app.post(
        path,
        operation_id=f"reboot{path.replace('/', '_')}",
        status_code=202,
        response_model=Accepted,
        responses={
            400: {"model": Problem, "description": "Malformed body, or a node not configured."},
            401: {"model": Problem, "description": "Missing or bad signature, or stale time."},
            413: {"model": Problem, "description": f"Body over {limit} bytes."},
            503: {"model": Problem, "description": "Event queue full; retry later."},
            507: {"model": Problem, "description": "The spool's disk is full; retry later."},
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": RebootNotice.model_json_schema()}},
            }
        },
    )
    async def reboot(
        request: Request,
        timestamp: Annotated[
            str | None,
            Header(alias=TIMESTAMP_HEADER, description="Unix time of signing, in seconds."),
        ] = None,
        signature: Annotated[
            str | None,
            Header(
                alias=SIGNATURE_HEADER,
                description='"sha256=" + hex HMAC-SHA256 of f"{timestamp}." + body.',
            ),
        ] = None,
    ) -> Any:
        client = request.client.host if request.client else "?"

        def refuse(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
            message = one_line(message)
            flood = {"flood_key": f"refused {status}"}
            log.warning("refused a call from %s: %d %s", client, status, message, extra=flood)
            return _problem(status, message, headers)

        declared = request.headers.get("content-length")
        if declared is not None and not declared.isdigit():
            return refuse(400, "bad Content-Length")
        if declared is not None and int(declared) > limit:
            return refuse(413, f"body over {limit} bytes", {"Connection": "close"})
        if not timestamp or not signature:
            return refuse(401, f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header")
        if not _TIMESTAMP.fullmatch(timestamp):
            return refuse(401, "bad timestamp: unix seconds expected")
        if abs(time.time() - int(timestamp)) > window_s:
            return refuse(401, f"timestamp outside the replay window (±{window_s:g} s)")
        given = _SIGNATURE.fullmatch(signature)
        if given is None:
            return refuse(401, "bad signature")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk[: limit + 1 - len(body)]
                if len(body) > limit:
                    return refuse(413, f"body over {limit} bytes", {"Connection": "close"})
        except ClientDisconnect:  # gone mid-body, or cut off by the deadline: nobody to answer
            return refuse(400, "the body ended early (the client left, or sent too slowly)")
        expected = hmac.new(key, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected.encode(), given.group(1).lower().encode()):
            return refuse(401, "bad signature")
        try:
            notice = RebootNotice.model_validate_json(bytes(body))
        except ValidationError as exc:
            error = exc.errors(include_url=False, include_input=False)[0]
            where = ".".join(shown(part) for part in error["loc"]) or "body"
            return refuse(400, f"invalid body: {where}: {error['msg']}"[:200])
        if notice.node not in nodes:
            return refuse(400, f"node {notice.node[:64]!r} is not in cluster {config.name!r}")
        boot = str(notice.boot_id)
        event_id = reboot_event_id(config.name, notice.node, boot)
        if (notice.node, boot) in boots:  # a retry, or the same notice replayed
            log.info(
                "%s: boot %s already accepted: event %s not queued again",
                notice.node,
                boot,
                event_id,
                extra={"flood_key": "repeated boot"},
            )
            return JSONResponse({"accepted": True, "event_id": event_id}, status_code=202)
        event = reboot_event(config.name, notice.node, boot, notice.uptime_s)
        if (refused := sender.offer(event)) is not None:
            if refused.kind == "disk":
                why = f"the webhook cannot keep the notice: {refused.words}; free space there"
                return refuse(507, f"{why}; retry later", {"Retry-After": "30"})
            if refused.kind == "spool":
                why = f"the webhook cannot keep the notice: {refused.words}"
                return refuse(503, f"{why}; retry later", {"Retry-After": "30"})
            return refuse(503, f"{refused.words}; retry later", {"Retry-After": "30"})
        boots.add(notice.node, boot)  # no await since the check above: no other call between
        log.info(
            "%s rebooted (boot %s, up %.0f s): event %s queued",
            notice.node,
            boot,
            notice.uptime_s,
            event_id,
        )
        rounds.reported(notice.node, boot)
        return JSONResponse({"accepted": True, "event_id": event_id}, status_code=202)


# --- connections: deadlines, and a cap under the open-file limit ------------------------------


@dataclass(frozen=True)
class ConnectionLimits:
    """What one server allows its connections (the [webhook] settings, fitted to the open-file
    limit by ``fit_open_files``)."""

    header_timeout_s: float = 5.0
    body_timeout_s: float = 5.0
    max_connections: int = 512
    backlog: int = 128  # the listen queue, and how many asyncio accepts in one go


def fit_open_files(limits: ConnectionLimits, raise_soft_limit: bool) -> ConnectionLimits:
    """``limits`` with the connection cap and backlog this process's RLIMIT_NOFILE leaves room
    for, after raising the soft limit to the hard one if asked; ValueError when too little."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if raise_soft_limit and (soft == resource.RLIM_INFINITY or soft < ceiling):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
            soft = ceiling
    soft = min(soft if soft != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    spare = soft - _open_files() - RESERVED_FILES
    backlog = max(8, min(128, spare // 8))
    # asyncio accepts up to `backlog` connections per pass before this protocol counts (and
    # closes) any of them, and a closed socket is released a pass later: room for three passes
    # stays free, so accept() never fails with EMFILE.
    cap = min(limits.max_connections, spare - 3 * backlog)
    if cap < 8:
        raise ValueError(
            f"the open-file limit ({soft}) leaves room for {max(cap, 0)} connections to the "
            "webhook: raise it (LimitNOFILE= in the systemd unit, ulimits in compose)"
        )
    return ConnectionLimits(limits.header_timeout_s, limits.body_timeout_s, cap, backlog)


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a busy process
        return 64


class Connections:
    """One server's connections, oldest first. Beyond ``cap``, a newcomer closes the oldest one
    still sending its request (or idle between requests): one that sends slowly, or not at all,
    cannot keep a node's notice out, however many of them there are."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[GuardedH11Protocol, None] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: GuardedH11Protocol) -> bool:
        if len(self._open) >= self.cap:
            oldest = next((c for c in self._open if c.waiting), None)
            if oldest is None:
                log.warning(
                    "%d connections open, every one being answered: refused a new one",
                    len(self._open),
                    extra={"flood_key": "refused connection"},
                )
                return False
            log.warning(
                "%d connections open (the most allowed): closed the oldest still sending",
                len(self._open),
                extra={"flood_key": "evicted connection"},
            )
            self.remove(oldest)
            oldest.transport.close()
        self._open[conn] = None
        return True

    def remove(self, conn: GuardedH11Protocol) -> None:
        self._open.pop(conn, None)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines and a cap. A request's headers must be in within
    ``header_timeout_s`` of the connection (or of the answer to the previous request), its body
    within ``body_timeout_s`` of its headers, however the bytes trickle in; else the connection
    is closed. uvicorn arms no timer before a first request, and its keep-alive timer restarts
    with every byte received, so neither bounds a slow sender."""

    limits: ClassVar[ConnectionLimits]
    table: ClassVar[Connections]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # "headers" or "body": what the deadline waits for
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> bool:
        """Sending a request (or idle), as opposed to being answered."""
        return self._phase is not None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.table.admit(self):
            transport.close()
            return
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()  # the next request's headers are due now (or are in already)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        self.table.remove(self)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Arm the deadline for what the client owes now; keep it while that stays the same."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if self.transport.is_closing():
            phase = None
        if phase != self._phase:
            self._arm(phase)

    def _arm(self, phase: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            limits = self.limits
            timeout = limits.header_timeout_s if phase == "headers" else limits.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expired, phase, timeout)

    def _expired(self, phase: str, timeout: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        log.warning(
            "closed a connection from %s: the request's %s did not arrive within %g s",
            self.client[0] if self.client else "?",
            phase,
            timeout,
            extra={"flood_key": f"slow {phase}"},
        )
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one server: its own limits and connection table."""

    class Guarded(GuardedH11Protocol):
        pass

    Guarded.limits = limits
    Guarded.table = Connections(limits.max_connections)
    return Guarded


# --- a log that cannot flood ----------------------------------------------------------------


@dataclass
class _Spell:
    start: float
    logged: int = 0
    held: int = 0


class FloodFilter(logging.Filter):
    """Lets through at most ``burst`` records of one kind per ``interval_s``; the first one of
    that kind let through afterwards says how many were held back. A kind: a record's
    ``flood_key`` (extra=), a 4xx/5xx access line's status, or a warning's message template."""

    MAX_KINDS = 256

    def __init__(
        self,
        burst: int = 10,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.burst = burst
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._spells: dict[Hashable, _Spell] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = _flood_kind(record)
        if kind is None:
            return True
        now = self._clock()
        with self._lock:
            spell = self._spells.get(kind)
            if spell is None or now - spell.start >= self.interval_s:
                held = spell.held if spell is not None else 0
                spell = self._spells[kind] = _Spell(now)
                self._forget_old(now)
                if held:
                    record.msg = f"{record.msg} ({held} more like this suppressed)"
            if spell.logged < self.burst:
                spell.logged += 1
                return True
            spell.held += 1
            return False

    def _forget_old(self, now: float) -> None:
        if len(self._spells) > self.MAX_KINDS:  # messages that embed changing text
            for kind in [k for k, s in self._spells.items() if now - s.start >= self.interval_s]:
                del self._spells[kind]


def _flood_kind(record: logging.LogRecord) -> Hashable | None:
    key = getattr(record, "flood_key", None)
    if key is not None:
        return (record.name, key)
    if record.name == "uvicorn.access":
        args = record.args if isinstance(record.args, tuple) else ()
        status = args[4] if len(args) > 4 else None
        return (record.name, status) if isinstance(status, int) and status >= 400 else None
    if record.levelno >= logging.WARNING:  # asyncio's (accept() and EMFILE), uvicorn's
        return (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:80])
    return None


FLOOD_FILTER = FloodFilter()
FLOODED_LOGGERS = (
    "asyncio",
    "uvicorn.error",
    "uvicorn.access",
    "vllm_redeploy.webhook",
    "vllm_redeploy.events",
)


def _guard_logs() -> None:
    """Put the flood filter on the loggers a stranger can make talk (after uvicorn configured
    its own: a logger's filters see only the records made on it)."""
    for name in FLOODED_LOGGERS:
        logging.getLogger(name).addFilter(FLOOD_FILTER)


def _uvicorn_config(app: FastAPI, limits: ConnectionLimits, **options: Any) -> uvicorn.Config:
    config = uvicorn.Config(
        app,
        http=guarded_protocol(limits),
        ws="none",  # no WebSocket routes; an upgrade would leave the guarded protocol
        backlog=limits.backlog,
        server_header=False,
        **options,
    )
    _guard_logs()
    return config


def serve_webhook(
    clusters: ClusterConfig | Sequence[ClusterConfig],
    host: str | None = None,
    port: int | None = None,
) -> None:
    """Run the webhook of one or several clusters in the foreground (until Ctrl-C), keeping
    events in their spool; it binds ``host``/``port``, else the clusters' webhook.host/port.

    Raises ValueError (before binding anything) without a usable secret or spool, or when the
    clusters name different binds and no ``host``/``port`` settles it.
    """
    configs = [clusters] if isinstance(clusters, ClusterConfig) else list(clusters)
    for config in configs:
        webhook_secret(config)
    host = host or _one_setting(configs, "host", lambda w: w.host, flag=True)
    port = port or int(_one_setting(configs, "port", lambda w: w.port, flag=True))
    for config in configs:
        if why := config.webhook.unreachable(host):
            log.warning("%s: %s", config.name, why)
    limits = fit_open_files(connection_limits(configs), raise_soft_limit=True)
    base = spool_base(configs)
    if problem := spool_problem(base):
        raise ValueError(problem)
    try:
        spool = Spool(base, [c.name for c in configs])
    except OSError as exc:
        raise ValueError(
            f"cannot keep accepted notices in {base} ({exc.strerror}): set "
            "webhook.spool_dir to a directory this service may write"
        ) from None
    # After its graceful shutdown uvicorn raises the signal again with the previous handler in
    # place; for SIGTERM (systemctl stop) the default one would end the process by the signal.
    # What was answered 202 is on disk already: a handler that exits normally says "stopped".
    previous = (
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        app = create_app(configs, spool, base)
        config = _uvicorn_config(
            app,
            limits,
            host=host,
            port=port,
            log_level="info",
            access_log=True,  # method, path and status only: headers are never logged
            timeout_graceful_shutdown=5,
        )
        log.info(
            "accepted notices are kept in %s; the cluster's watcher (`vllm-redeploy watch`, "
            "with the same webhook.spool_dir) posts them to Prefect",
            base,
        )
        log.info(
            "at most %d connections at once (open-file limit %d); a request's headers due "
            "within %g s, its body within %g s",
            limits.max_connections,
            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            limits.header_timeout_s,
            limits.body_timeout_s,
        )
        uvicorn.Server(config).run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def connection_limits(configs: Sequence[ClusterConfig]) -> ConnectionLimits:
    """The [webhook] limits every served cluster names (ValueError where they differ)."""
    return ConnectionLimits(
        header_timeout_s=_one_setting(configs, "header_timeout_s", lambda w: w.header_timeout_s),
        body_timeout_s=_one_setting(configs, "body_timeout_s", lambda w: w.body_timeout_s),
        max_connections=_one_setting(configs, "max_connections", lambda w: w.max_connections),
    )


def _one_setting(
    configs: Sequence[ClusterConfig], what: str, value: Callable[[Any], Any], flag: bool = False
) -> Any:
    """A [webhook] setting of the one server every cluster shares: the same in each, or
    ValueError saying so (and, for the ones the command line takes, ``flag``, how to choose)."""
    values = {value(c.webhook) for c in configs}
    if len(values) > 1:
        named = ", ".join(f"{c.name}: {value(c.webhook)}" for c in configs)
        choose = f"pass --{what}, or set" if flag else "set"
        raise ValueError(
            f"the clusters name different webhook.{what} ({named}); one webhook has one: "
            f"{choose} the same webhook.{what} in every cluster's configuration"
        )
    return values.pop()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # a requested stop, done gracefully


@contextlib.contextmanager
def running_webhook(
    clusters: ClusterConfig | Sequence[ClusterConfig],
    sender: Sender,
    host: str = "127.0.0.1",
    port: int = 0,
) -> Iterator[str]:
    """Serve the webhook from a thread (tests, benches); yields its base URL, e.g.
    ``http://127.0.0.1:40123``. ``port=0`` picks a free port. Its connection limits are the
    configuration's, fitted to this process's open-file limit (which it leaves as it is)."""
    configs = [clusters] if isinstance(clusters, ClusterConfig) else list(clusters)
    limits = fit_open_files(connection_limits(configs), raise_soft_limit=False)
    app = create_app(configs, sender)
    server = uvicorn.Server(
        _uvicorn_config(app, limits, host=host, port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="webhook", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the webhook did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(10)
