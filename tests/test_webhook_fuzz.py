"""The reboot webhook under fuzzing: a real uvicorn on loopback, a real EventSender posting to the
session's Prefect server (instrumented to record what the app hands it), and hypothesis choosing
bodies, timestamps, signatures, content types and headers.

The property: 202 exactly for a correctly signed, fresh, well-formed call naming a known node,
with one event (none for a boot among the last few of its node, answered again); anything else
a 4xx with a short JSON error, never a 5xx, and no event. At the end, Prefect holds exactly the
events of the accepted calls (one per distinct boot)."""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deployments.event_sender import (
    EVENT_REBOOTED,
    EventSender,
    Refusal,
    node_resource_id,
    reboot_event_id,
)
from deployments.webhook import (
    RECENT_BOOTS,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    running_webhook,
    sign,
)
from tests.fuzz import fuzz_settings
from tests.test_webhook import NODES, make_config
from vllm_redeploy.config import ClusterConfig

pytestmark = pytest.mark.integration

FUZZ = fuzz_settings(200)
MARGIN_S = 20  # keeps generated timestamps clear of the replay window's edges


class RecordingSender(EventSender):
    """The real sender (queue, thread, POST to Prefect), also keeping the nodes' events the app
    submitted (the cluster's own, once every node reported, are not a call's answer)."""

    def __init__(self, api_url: str) -> None:
        super().__init__(api_url)
        self.submitted: list[dict[str, Any]] = []

    def offer(self, event: dict[str, Any]) -> Refusal | None:
        if event["event"] == EVENT_REBOOTED:
            self.submitted.append(event)
        return super().offer(event)


class ServerErrors(logging.Handler):
    """Errors uvicorn logs (an exception escaping the app is logged here, then answered 500)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


@dataclass
class Service:
    url: str
    config: ClusterConfig
    secret: str
    sender: RecordingSender
    api: str
    client: httpx.Client
    errors: ServerErrors
    accepted_ids: set[str] = field(default_factory=set)
    recent: dict[str, deque[str]] = field(default_factory=dict)  # per node, as the app keeps
    calls: int = 0
    accepted_calls: int = 0

    @property
    def limit(self) -> int:
        return self.config.webhook.max_body_bytes

    @property
    def window(self) -> int:
        return int(self.config.webhook.replay_window_s)


@pytest.fixture(scope="module")
def service(prefect_api: str) -> Iterator[Service]:
    secret = secrets.token_hex(32)
    config = make_config(f"whfz{uuid.uuid4().hex[:8]}", secret)
    sender = RecordingSender(prefect_api)
    try:
        with running_webhook(config, sender) as url, httpx.Client(base_url=url, timeout=15) as c:
            errors = ServerErrors()  # after uvicorn configured its loggers
            logging.getLogger("uvicorn.error").addHandler(errors)
            try:
                yield Service(url, config, secret, sender, prefect_api, c, errors)
            finally:
                logging.getLogger("uvicorn.error").removeHandler(errors)
    finally:
        assert sender.close(timeout=15)


# --- what a request is made of ---------------------------------------------------------------


@dataclass
class Case:
    body: bytes
    stream: bool
    headers: list[tuple[str, str]]
    expect: set[int]  # the statuses the contract allows for this request
    accepted: tuple[str, str] | None = None  # (node, canonical boot id) when it must be accepted
    what: str = ""


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)


def boot_text(boot: uuid.UUID, form: str) -> str:
    return {
        "canonical": str(boot),
        "upper": str(boot).upper(),
        "hex": boot.hex,
        "braces": "{" + str(boot) + "}",
        "urn": boot.urn,
    }[form]


@st.composite
def notices(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[str, str] | None, str]:
    """A notice body as data, (node, boot) when it is well-formed, and what it is."""
    boot = draw(st.uuids())
    body: dict[str, Any] = {
        "node": draw(st.sampled_from(NODES)),
        "boot_id": boot_text(boot, draw(st.sampled_from(["canonical", "upper", "hex", "braces"]))),
        "uptime_s": draw(
            st.floats(min_value=0, max_value=1e9, allow_nan=False) | st.integers(0, 10**9)
        ),
    }
    extra = draw(
        st.dictionaries(
            st.text(max_size=8).filter(lambda k: k not in body), json_values, max_size=2
        )
    )
    body.update(extra)
    defect = draw(
        st.sampled_from(
            ["none"] * 6
            + ["node", "node_type", "boot", "boot_type", "uptime", "uptime_type", "missing"]
        )
    )
    if defect == "none":
        return body, (body["node"], str(boot)), "well-formed"
    if defect == "node":
        body["node"] = draw(st.text(max_size=30).filter(lambda n: n not in NODES))
    elif defect == "node_type":
        body["node"] = draw(st.sampled_from([None, 1, ["node-1"], {"n": "node-1"}, True]))
    elif defect == "boot":
        body["boot_id"] = draw(
            st.sampled_from(
                ["", "not-a-uuid", str(boot)[:-1], str(boot) + "0", "g" * 32, "1234", " " * 36]
            )
        )
    elif defect == "boot_type":
        body["boot_id"] = draw(st.sampled_from([None, 12, [str(boot)], {"id": str(boot)}, True]))
    elif defect == "uptime":
        body["uptime_s"] = draw(st.sampled_from([-1, -0.001, -1e9]))
    elif defect == "uptime_type":
        body["uptime_s"] = draw(st.sampled_from(["42", True, None, [], {}, "NaN"]))
    else:
        del body[draw(st.sampled_from(["node", "boot_id", "uptime_s"]))]
    return body, None, f"defect: {defect}"


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.strip
)
RESERVED = {"content-length", "transfer-encoding", "host", "connection", "expect", "upgrade"}
extra_headers = st.lists(
    st.tuples(
        st.text("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=20).filter(
            lambda n: n.lower() not in RESERVED and not n.lower().startswith("x-vllm-redeploy")
        ),
        header_text,
    ),
    max_size=3,
)
CONTENT_TYPES = [
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=utf-16",
    "",
    None,
]
BAD_TIMESTAMPS = ["", "abc", "-5", "1.5", "0x10", "1e9", "+1", "9" * 13, "0" * 13, "NaN", "now"]


@st.composite
def cases(draw: st.DrawFn, limit: int, window: int, secret: str) -> Case:
    if draw(st.integers(0, 9)) < 3:  # a share of calls that must all be accepted
        return draw(valid_cases(secret))
    kind = draw(
        st.sampled_from(
            ["notice"] * 6 + ["json"] * 2 + ["bytes", "oversized", "deep", "empty", "tiny"]
        )
    )
    accepted: tuple[str, str] | None = None
    what = kind
    if kind == "notice":
        data, accepted, what = draw(notices())
        body = json.dumps(data, indent=draw(st.sampled_from([None, 1]))).encode()
    elif kind == "json":
        body = json.dumps(draw(json_values)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=600))
    elif kind == "oversized":
        data, _, _ = draw(notices())
        raw = json.dumps(data).encode()
        body = raw[:-1] + b" " * (limit - len(raw) + draw(st.integers(1, 6000))) + b"}"
    elif kind == "deep":
        body = b"[" * draw(st.integers(100, min(limit, 4000)))
    elif kind == "empty":
        body = b""
    else:
        body = draw(st.sampled_from([b"{}", b"[]", b"null", b"0", b'"x"', b"{", b"\xff"]))
    if len(body) > limit:
        accepted = None
    stream = draw(st.booleans()) if len(body) > 0 else False

    now = int(time.time())
    ts_kind = draw(
        st.sampled_from(["fresh"] * 5 + ["zero-padded", "stale", "future", "bad", "none"])
    )
    fresh = ts_kind in ("fresh", "zero-padded")
    if ts_kind == "fresh":
        ts: str | None = str(now + draw(st.integers(-(window - MARGIN_S), window - MARGIN_S)))
    elif ts_kind == "zero-padded":
        ts = "0" + str(now)  # 11 digits: still unix seconds
    elif ts_kind == "stale":
        ts = str(now - draw(st.integers(window + MARGIN_S, 10**8)))
    elif ts_kind == "future":
        ts = str(now + draw(st.integers(window + MARGIN_S, 10**8)))
    elif ts_kind == "bad":
        ts = draw(st.sampled_from(BAD_TIMESTAMPS))
    else:
        ts = None

    good = sign(secret, ts or "", body)
    sig_kind = draw(
        st.sampled_from(
            ["good"] * 6
            + ["upper", "wrong-key", "other-body", "other-ts", "prefix-case", "short", "junk"]
            + ["none", "empty"]
        )
    )
    signature: str | None = {
        "good": good,
        "upper": "sha256=" + good.removeprefix("sha256=").upper(),
        "wrong-key": sign(secrets.token_hex(32), ts or "", body),
        "other-body": sign(secret, ts or "", body + b" "),
        "other-ts": sign(secret, str(now - 1), body) if ts != str(now - 1) else sign("x", 1, b""),
        "prefix-case": "SHA256=" + good.removeprefix("sha256="),
        "short": good[:-1],
        "junk": draw(header_text),
        "none": None,
        "empty": "",
    }[sig_kind]
    signed_ok = sig_kind in ("good", "upper") and ts is not None and ts != ""
    headers = [(k, v) for k, v in draw(extra_headers)]
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    if ts is not None:
        headers.append((TIMESTAMP_HEADER, ts))
    if signature is not None:
        headers.append((SIGNATURE_HEADER, signature))

    well_formed_signature = sig_kind in ("good", "upper", "wrong-key", "other-body", "other-ts")
    if len(body) > limit:
        # Declared too large: 413 before anything else. Streamed (no length): the headers are
        # checked first (401), then the body is cut off at the limit, before the signature.
        expect = {413} if not stream or (fresh and ts and well_formed_signature) else {401}
        accepted = None
    elif not (fresh and signed_ok):
        expect = {401}
        accepted = None
    elif accepted is None:
        expect = {400}
    else:
        expect = {202}
    what = f"{what}; ts {ts_kind}; signature {sig_kind}; {'streamed' if stream else 'sized'}"
    return Case(body, stream, headers, expect, accepted, what)


@st.composite
def valid_cases(draw: st.DrawFn, secret: str) -> Case:
    boot = draw(st.uuids())
    node = draw(st.sampled_from(NODES))
    form = draw(st.sampled_from(["canonical", "upper", "hex", "braces", "urn"]))
    uptime = draw(st.floats(min_value=0, max_value=1e7, allow_nan=False) | st.integers(0, 10**7))
    body = json.dumps({"node": node, "boot_id": boot_text(boot, form), "uptime_s": uptime})
    ts = str(int(time.time()) + draw(st.integers(-60, 60)))
    headers = [
        *draw(extra_headers),
        (TIMESTAMP_HEADER, ts),
        (SIGNATURE_HEADER, sign(secret, ts, body.encode())),
    ]
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    stream = draw(st.booleans())
    return Case(body.encode(), stream, headers, {202}, (node, str(boot)), f"valid, {form}")


def send(service: Service, case: Case) -> httpx.Response:
    content: Any = case.body
    if case.stream:
        chunks = [case.body[i : i + 1000] for i in range(0, len(case.body), 1000)]
        content = iter(chunks)
    return service.client.post("/reboot", content=content, headers=case.headers)


def assert_answer(service: Service, case: Case, response: httpx.Response, new: list[Any]) -> None:
    assert response.status_code < 500, (case.what, response.status_code, response.text)
    assert response.status_code in case.expect, (case.what, response.status_code, response.text)
    assert service.secret not in response.text
    if case.accepted is not None:
        node, boot = case.accepted
        event_id = reboot_event_id(service.config.name, node, boot)
        assert response.json() == {"accepted": True, "event_id": event_id}
        recent = service.recent.setdefault(node, deque(maxlen=RECENT_BOOTS))
        if boot in recent:  # one of the node's last boots, accepted before: not queued again
            assert new == [], (case.what, new)
        else:
            assert [e["id"] for e in new] == [event_id]
            assert new[0]["event"] == EVENT_REBOOTED and new[0]["payload"]["boot_id"] == boot
            recent.append(boot)
        service.accepted_ids.add(event_id)
        service.accepted_calls += 1
    else:
        assert 400 <= response.status_code < 500
        assert new == [], (case.what, new)
        body = response.json()
        assert list(body) == ["error"] and len(response.content) < 250, body
        assert "sha256=" not in response.text


def stored_ids(api: str, cluster: str) -> list[str]:
    response = httpx.post(
        f"{api}/events/filter",
        json={
            "filter": {
                "event": {"name": [EVENT_REBOOTED]},
                "resource": {"id_prefix": [node_resource_id(cluster, "")]},
            },
            "limit": 50,
        },
        timeout=15,
    )
    response.raise_for_status()
    page = response.json()
    ids = [e["id"] for e in page["events"]]
    while page.get("next_page"):
        page = httpx.get(page["next_page"], timeout=15).json()
        ids += [e["id"] for e in page["events"]]
    return ids


# --- the properties -------------------------------------------------------------------------------


def test_only_a_signed_fresh_wellformed_call_is_accepted(service: Service) -> None:
    @FUZZ
    @given(data=st.data())
    def one_call(data: Any) -> None:
        case = data.draw(cases(service.limit, service.window, service.secret))
        before, errors = len(service.sender.submitted), len(service.errors.records)
        response = send(service, case)
        service.calls += 1
        assert_answer(service, case, response, service.sender.submitted[before:])
        assert service.errors.records[errors:] == []

    one_call()
    # Prefect ends up with one event per accepted boot, and nothing else of this cluster
    # (whatever this module sent before, too: every event the app ever submitted).
    boots = len(service.accepted_ids)
    print(f"{service.calls} calls, {service.accepted_calls} accepted, {boots} boots")
    assert service.accepted_calls >= 30 and boots >= 10, "too few accepted calls to mean much"
    expected = {e["id"] for e in service.sender.submitted}
    assert service.accepted_ids <= expected
    deadline = time.monotonic() + 30
    ids: list[str] = []
    while time.monotonic() < deadline:
        if service.sender.pending == 0:
            ids = stored_ids(service.api, service.config.name)
            if set(ids) == expected:
                break
        time.sleep(0.5)
    assert service.sender.dropped == 0 and service.sender.last_error is None
    assert set(ids) == expected
    assert len(ids) == len(set(ids))  # one stored event per boot, however often it was sent


@fuzz_settings(60)
@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "POST"]),
    path=st.sampled_from(["/reboot/", "/REBOOT", "/reboot?x=1", "/", "/docs", "/x" * 40, "/%00"]),
    body=st.binary(max_size=200),
)
def test_other_methods_and_paths_never_fail_or_emit(
    service: Service, method: str, path: str, body: bytes
) -> None:
    before, errors = len(service.sender.submitted), len(service.errors.records)
    response = service.client.request(method, path, content=body, follow_redirects=False)
    assert response.status_code < 500, (method, path, response.status_code)
    assert service.sender.submitted[before:] == []
    assert service.errors.records[errors:] == []


def raw_exchange(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


@fuzz_settings(80)
@given(
    length=st.sampled_from(
        ["abc", "-1", "+5", "1e3", " 12", "12 ", "0x10", "²", "١٢", "99999999999999999999", "5, 5"]
    )
    | st.integers(0, 10**7).map(str),
    duplicate=st.booleans(),
    chunked=st.booleans(),
    garbage=st.binary(max_size=80),
    header_bytes=st.binary(max_size=30).filter(lambda b: b"\r" not in b and b"\n" not in b),
)
def test_raw_http_never_gets_a_5xx(
    service: Service,
    length: str,
    duplicate: bool,
    chunked: bool,
    garbage: bytes,
    header_bytes: bytes,
) -> None:
    """Requests httpx would refuse to send: odd Content-Length values, both framings, bytes
    outside ASCII in headers. The server answers 4xx (or closes), never 5xx, emits nothing."""
    before, errors = len(service.sender.submitted), len(service.errors.records)
    ts = str(int(time.time()))
    body = b'{"node": "node-1", "boot_id": "' + str(uuid.uuid4()).encode() + b'", "uptime_s": 1}'
    lines = [
        b"POST /reboot HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Content-Length: " + length.encode(),
        TIMESTAMP_HEADER.encode() + b": " + ts.encode(),
        SIGNATURE_HEADER.encode() + b": " + sign(service.secret, ts, body).encode(),
        b"X-Odd: " + header_bytes,
        b"Connection: close",
    ]
    if duplicate:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    answer = raw_exchange(service.url, b"\r\n".join(lines) + b"\r\n\r\n" + body + garbage)
    if answer:
        status_line = answer.split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1.1 "), answer[:200]
        status = int(status_line.split()[1])
        assert status < 500, answer[:300]
        if status == 202:  # only when the framing left the signed body intact
            assert length == str(len(body)) and not chunked
    assert len(service.sender.submitted) - before <= (1 if length == str(len(body)) else 0)
    assert httpx.get(f"{service.url}/healthz", timeout=5).status_code == 200
    # Nothing escaped the app (uvicorn logs it, then answers 500 if it still can).
    assert service.errors.records[errors:] == []
