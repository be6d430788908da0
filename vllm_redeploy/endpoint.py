"""What the vLLM endpoint says: its base URL, the models it lists, its version."""

from __future__ import annotations

import httpx

from vllm_redeploy.answers import fetch
from vllm_redeploy.config import ClusterConfig
from vllm_redeploy.nodes import RemoteError, Runner
from vllm_redeploy.probe import bearer
from vllm_redeploy.safe_text import one_line, shown

UNAUTHORIZED = 401
AUTHORIZATION = "Authorization"


def api_base(config: ClusterConfig) -> str:
    """Where the controller reaches the OpenAI-compatible API on the head."""
    return f"http://{config.head.address}:{config.vllm.port}"


def api_key(config: ClusterConfig) -> str | None:
    """vLLM's API key (``[secrets] vllm_api_key``), or None when the API wants none."""
    key = config.secrets.vllm_api_key
    return key.get_secret_value() if key is not None else None


def auth_headers(key: str | None) -> dict[str, str]:
    """What every request of ours to the engine carries: vLLM's key as a bearer token. vLLM
    checks it on /v1 only (/health, /metrics and /version stay open) and ignores it there."""
    return bearer(key)


def unauthorized(sent_key: bool) -> str:
    """Why vLLM answered 401, in words."""
    if sent_key:
        return (
            f"HTTP {UNAUTHORIZED}: the engine refused our API key ([secrets] vllm_api_key): "
            "it was started with another one"
        )
    return (
        f"HTTP {UNAUTHORIZED}: the engine wants an API key and none is set: it was started "
        "with one (VLLM_API_KEY in the image, or another launcher); set the same as the "
        "secret VLLM_REDEPLOY_SECRETS__VLLM_API_KEY, or redeploy"
    )


def refused_key(why: str | None) -> bool:
    """Is ``why`` (from :func:`list_models`) vLLM refusing our API key, or its absence?"""
    return why is not None and why.startswith(f"HTTP {UNAUTHORIZED}:")


def list_models(client: httpx.Client, base_url: str) -> tuple[list[str] | None, str | None]:
    """The ids /v1/models lists, or (None, why) while it does not answer with a list."""
    try:
        response = fetch(client, "GET", f"{base_url}/v1/models")
    except httpx.HTTPError as exc:
        return None, http_error(exc)
    if response.status_code == UNAUTHORIZED:
        return None, unauthorized(AUTHORIZATION in client.headers)
    try:
        data = response.json()
    except ValueError:
        return None, "the answer is not JSON"
    if response.status_code != 200 or not isinstance(data, dict):
        return None, f"HTTP {response.status_code}"
    return [str(m.get("id")) for m in data.get("data", []) if isinstance(m, dict)], None


def engine_version(client: httpx.Client, base_url: str, engine: Runner | None = None) -> str | None:
    """vLLM's version: GET /version, else ``vllm --version`` in the engine container."""
    try:
        response = fetch(client, "GET", f"{base_url}/version")
        version = response.json().get("version") if response.status_code == 200 else None
        if isinstance(version, str) and version:
            return shown(version)
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    if engine is None:
        return None
    try:
        result = engine.run(["vllm", "--version"], timeout=30, check=False)
    except RemoteError:
        return None
    lines = result.stdout.strip().splitlines()
    return shown(lines[-1].strip()) if result.ok and lines else None


def http_error(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused (loading, or no server)"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    return one_line(exc) or type(exc).__name__
