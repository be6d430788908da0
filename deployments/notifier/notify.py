#!/usr/bin/python3
"""vllm-redeploy node notifier: tell the controller's reboot webhook that this node has booted.

Run once per boot by vllm-redeploy-notify.service. Standard library only (python3 >= 3.8), so
nothing needs installing on the node. Configuration: /etc/vllm-redeploy/notifier.env, or the
file named by $VRD_NOTIFIER_ENV, with lines KEY=VALUE:

    URL=http://controller:8787          the webhook's base URL (required)
    NODE=spark-a                        this node's name in the cluster configuration (required)
    SECRET_FILE=/etc/.../notifier.secret  file holding the shared secret, mode 0600 (required
                                        unless systemd hands it over as a credential)
    BOOT_ID_FILE=/proc/sys/kernel/random/boot_id   (optional)
    MAX_WAIT_S=3600                     give up after retrying this long (optional)

The secret is read from a file only: never from the command line or the environment. Under
vllm-redeploy-notify.service it runs as an unprivileged user that cannot read SECRET_FILE; systemd
reads it (LoadCredential=) into $CREDENTIALS_DIRECTORY/notifier.secret, which is used first.
Each attempt signs f"{timestamp}." + body with HMAC-SHA256 and POSTs URL/reboot; connection
errors, 5xx, 408, 429 and 401 (a clock not yet synchronised right after boot) are retried with
backoff 1, 2, 4 ... 60 s. Exit codes: 0 accepted (202), 1 gave up after MAX_WAIT_S,
2 refused for good (400, 413, other 4xx), 3 configuration error. One line per attempt on stderr.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import sys
import time
import urllib.error
import urllib.request

DEFAULT_ENV_FILE = "/etc/vllm-redeploy/notifier.env"
DEFAULT_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
UPTIME_FILE = "/proc/uptime"
CREDENTIAL = "notifier.secret"  # LoadCredential= of the unit
DEFAULT_MAX_WAIT_S = 3600.0
MAX_DELAY_S = 60.0
REQUEST_TIMEOUT_S = 10.0
RETRY_STATUSES = frozenset({401, 408, 429})
EXIT_OK, EXIT_GAVE_UP, EXIT_REFUSED, EXIT_CONFIG = 0, 1, 2, 3


class ConfigProblem(Exception):
    pass


def say(message: str) -> None:
    # One journal line per message: an answer's body cannot add lines or escape sequences. (This
    # script runs on the nodes without the package, so it cannot use vllm_redeploy.safe_text.)
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    print(f"vllm-redeploy-notify: {line}", file=sys.stderr, flush=True)


def read_env_file(path: str) -> dict[str, str]:
    values: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ConfigProblem(f"cannot read {path}: {exc.strerror}") from None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ConfigProblem(f"{path}:{number}: KEY=VALUE expected")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def read_first_line(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    except OSError as exc:
        raise ConfigProblem(f"cannot read the {what} from {path}: {exc.strerror}") from None


def read_secret(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigProblem(f"cannot read the secret file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        say(f"warning: {path} is readable by others (mode {mode & 0o777:o}); make it 0600")
    secret = read_first_line(path, "secret")
    if not secret:
        raise ConfigProblem(f"the secret file {path} is empty")
    return secret


def credential_file() -> str | None:
    """The secret as systemd handed it to this service (LoadCredential=), or None."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    path = os.path.join(directory, CREDENTIAL)
    return path if os.path.isfile(path) else None


def load_settings() -> dict[str, object]:
    env_file = os.environ.get("VRD_NOTIFIER_ENV") or DEFAULT_ENV_FILE
    values = read_env_file(env_file)
    credential = credential_file()
    if credential is not None:
        values["SECRET_FILE"] = credential
    missing = [k for k in ("URL", "NODE", "SECRET_FILE") if not values.get(k)]
    if missing:
        raise ConfigProblem(f"{env_file}: missing {', '.join(missing)}")
    url = values["URL"].rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigProblem(f"{env_file}: URL must start with http:// or https://")
    try:
        max_wait_s = float(values.get("MAX_WAIT_S") or DEFAULT_MAX_WAIT_S)
    except ValueError:
        raise ConfigProblem(f"{env_file}: MAX_WAIT_S must be a number of seconds") from None
    boot_id = read_first_line(values.get("BOOT_ID_FILE") or DEFAULT_BOOT_ID_FILE, "boot id")
    if not boot_id:
        raise ConfigProblem("the boot id is empty")
    try:
        uptime_s = float(read_first_line(UPTIME_FILE, "uptime").split()[0])
    except (ValueError, IndexError):
        raise ConfigProblem(f"cannot parse {UPTIME_FILE}") from None
    return {
        "endpoint": url + "/reboot",
        "node": values["NODE"],
        "secret": read_secret(values["SECRET_FILE"]),
        "boot_id": boot_id,
        "uptime_s": uptime_s,
        "max_wait_s": max_wait_s,
    }


def sign(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def post(endpoint: str, secret: str, body: bytes) -> tuple[int | None, str]:
    """One signed attempt: (HTTP status or None when no answer came, a short description)."""
    timestamp = str(int(time.time()))
    # load_settings() allows http:// and https:// URLs only.
    request = urllib.request.Request(  # noqa: S310
        endpoint,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "X-Vllm-Redeploy-Timestamp": timestamp,
            "X-Vllm-Redeploy-Signature": sign(secret, timestamp, body),
            "User-Agent": "vllm-redeploy-notify/1",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:  # noqa: S310
            return response.status, response.read(512).decode("utf-8", "replace").strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(512).decode("utf-8", "replace").strip()
    except urllib.error.URLError as exc:
        return None, str(exc.reason)
    except OSError as exc:  # includes timeouts and resets
        return None, str(exc) or type(exc).__name__


def main() -> int:
    try:
        settings = load_settings()
    except ConfigProblem as exc:
        say(f"configuration error: {exc}")
        return EXIT_CONFIG
    endpoint = str(settings["endpoint"])
    secret = str(settings["secret"])
    body = json.dumps(
        {
            "node": settings["node"],
            "boot_id": settings["boot_id"],
            "uptime_s": settings["uptime_s"],
        },
        separators=(",", ":"),
    ).encode()
    deadline = time.monotonic() + float(settings["max_wait_s"])  # type: ignore[arg-type]
    delay = 1.0
    attempt = 0
    while True:
        attempt += 1
        status, detail = post(endpoint, secret, body)
        outcome = f"HTTP {status}" if status is not None else "no answer"
        if status == 202:
            say(f"attempt {attempt}: POST {endpoint} -> 202 accepted {detail}")
            return EXIT_OK
        if status is not None and 400 <= status < 500 and status not in RETRY_STATUSES:
            say(f"attempt {attempt}: POST {endpoint} -> {outcome} {detail}; giving up")
            return EXIT_REFUSED
        left = deadline - time.monotonic()
        if left <= 0:
            say(f"attempt {attempt}: POST {endpoint} -> {outcome} {detail}; gave up after retries")
            return EXIT_GAVE_UP
        wait = min(delay, left)
        say(f"attempt {attempt}: POST {endpoint} -> {outcome} {detail}; retrying in {wait:g} s")
        time.sleep(wait)
        delay = min(delay * 2, MAX_DELAY_S)


if __name__ == "__main__":
    sys.exit(main())
