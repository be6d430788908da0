"""The reboot webhook: a node calls it after boot, and it emits one Prefect event for that boot.

Prefect's own webhooks exist only in Prefect Cloud; this small service stands in for them with a
self-hosted server. ``POST /reboot`` takes ``{"node", "boot_id", "uptime_s"}`` signed with the
shared secret (see ``sign``), hands a ``vllm.node.rebooted`` event to an ``EventSender`` and
answers 202 at once: it never waits for Prefect, let alone for the flow run the event triggers.
Once every node of the cluster has reported (or ``reboot_delay_s`` after the first did), it hands
one ``vllm.cluster.rebooted`` on too (``reboot_rounds``): the after-reboot run starts on that.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, Protocol

import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from deployments.event_sender import EventSender, reboot_event
from deployments.reboot_rounds import RebootRounds
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.names import webhook_path
from vllm_redeploy.safe_text import one_line, shown

SIGNATURE_HEADER = "X-Vllm-Redeploy-Signature"
TIMESTAMP_HEADER = "X-Vllm-Redeploy-Timestamp"
SECRET_ENV = "VLLM_REDEPLOY_SECRETS__WEBHOOK_SECRET"  # noqa: S105 - a variable name
MIN_SECRET_CHARS = 16
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_SIGNATURE = re.compile(r"^sha256=([0-9a-fA-F]{64})$")

log = logging.getLogger("vllm_redeploy.webhook")

NO_SECRET = (
    "The reboot webhook has no shared secret, so it could not tell a node's call from anyone "
    f"else's and refuses to start. Set {SECRET_ENV} in this service's environment (or in .env) "
    'to a long random value, e.g. the output of `python3 -c "import secrets; '
    'print(secrets.token_hex(32))"`, then run `vllm-redeploy install-notifier NODE` for each '
    "node so that its notifier signs with the same secret."
)


class Sender(Protocol):
    """What the app needs from an event sender (``EventSender`` or a test double)."""

    @property
    def pending(self) -> int: ...

    def submit(self, event: dict[str, Any]) -> bool: ...


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
    pending_events: int = Field(description="Events accepted and not yet delivered to Prefect.")


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


def create_app(clusters: ClusterConfig | Sequence[ClusterConfig], sender: Sender) -> FastAPI:
    """The webhook app; events go to ``sender``. Each cluster's nodes post to
    ``/clusters/NAME/reboot``, signed with that cluster's secret; with one cluster ``/reboot``
    works too (notifiers installed before several clusters shared a webhook)."""
    configs = [clusters] if isinstance(clusters, ClusterConfig) else list(clusters)
    for config in configs:
        webhook_secret(config)
    names = ", ".join(repr(c.name) for c in configs)
    app = FastAPI(
        title="vllm-redeploy reboot webhook",
        version="1",
        description=f"Nodes of cluster {names} report their boots here.",
    )

    @app.get("/healthz", response_model=Health)
    def healthz() -> Health:
        return Health(pending_events=sender.pending)

    for config in configs:
        rounds = RebootRounds(config, sender.submit)
        _add_reboot_route(app, config, sender, rounds, f"{webhook_path(config.name)}/reboot")
        if len(configs) == 1:
            _add_reboot_route(app, config, sender, rounds, "/reboot")
    return app


def _add_reboot_route(
    app: FastAPI, config: ClusterConfig, sender: Sender, rounds: RebootRounds, path: str
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
            log.warning("refused a call from %s: %d %s", client, status, message)
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
        except ClientDisconnect:  # the caller went away mid-body: nobody to answer, no traceback
            return refuse(400, "the body ended early (the client disconnected)")
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
        event = reboot_event(config.name, notice.node, str(notice.boot_id), notice.uptime_s)
        if not sender.submit(event):
            return refuse(503, "event queue full; retry later", {"Retry-After": "30"})
        log.info(
            "%s rebooted (boot %s, up %.0f s): event %s queued",
            notice.node,
            notice.boot_id,
            notice.uptime_s,
            event["id"],
        )
        rounds.reported(notice.node, str(notice.boot_id))
        return JSONResponse({"accepted": True, "event_id": event["id"]}, status_code=202)


def serve_webhook(
    clusters: ClusterConfig | Sequence[ClusterConfig],
    host: str | None = None,
    port: int | None = None,
    sender: EventSender | None = None,
) -> None:
    """Run the webhook of one or several clusters in the foreground (until Ctrl-C), delivering
    events to PREFECT_API_URL; it binds ``host``/``port``, else the clusters' webhook.host/port.

    Raises ValueError (before binding anything) without a usable secret or PREFECT_API_URL, or
    when the clusters name different binds and no ``host``/``port`` settles it.
    """
    configs = [clusters] if isinstance(clusters, ClusterConfig) else list(clusters)
    for config in configs:
        webhook_secret(config)
    host = host or _one_bind(configs, "host", lambda c: c.webhook.host)
    port = port or int(_one_bind(configs, "port", lambda c: str(c.webhook.port)))
    sender = sender or EventSender()
    # After its graceful shutdown uvicorn raises the signal again with the previous handler in
    # place; for SIGTERM (systemctl stop) the default one ends the process at once, before the
    # `finally` below hands Prefect the events still queued (already answered 202, so no node
    # retries them). A handler that exits normally lets the `finally` run.
    previous = (
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        app = create_app(configs, sender)
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level="info",
            access_log=True,  # method, path and status only: headers are never logged
            server_header=False,
            timeout_graceful_shutdown=5,
        )
    finally:
        sender.close(timeout=10)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _one_bind(
    configs: list[ClusterConfig], what: str, value: Callable[[ClusterConfig], str]
) -> str:
    """The one webhook.host (or port) every cluster names, or ValueError saying how to choose."""
    values = {value(c) for c in configs}
    if len(values) > 1:
        named = ", ".join(f"{c.name}: {value(c)}" for c in configs)
        raise ValueError(
            f"the clusters name different webhook.{what}s ({named}); one webhook binds one: pass "
            f"--{what}, or set the same webhook.{what} in every cluster's configuration"
        )
    return values.pop()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # a requested stop, done gracefully


@contextlib.contextmanager
def running_webhook(
    config: ClusterConfig, sender: Sender, host: str = "127.0.0.1", port: int = 0
) -> Iterator[str]:
    """Serve the webhook from a thread (tests, benches); yields its base URL, e.g.
    ``http://127.0.0.1:40123``. ``port=0`` picks a free port."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config, sender), host=host, port=port, log_level="warning", access_log=False
        )
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
