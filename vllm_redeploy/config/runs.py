"""How runs behave: ``[autostart]`` (what to stop first), ``[schedule]``, ``[deadlines]``,
``[lock]``, ``[watch]``, ``[probe]``, ``[webhook]``, ``[secrets]`` and ``[sync]``.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, SecretStr, field_validator

from vllm_redeploy.config.fields import (
    HOST_PATTERN,
    ContainerPattern,
    ModelPath,
    Name,
    Port,
    Seconds,
    Section,
    UnitName,
    matches,
)


class AutostartConfig(Section):
    containers: list[ContainerPattern] = Field(
        default_factory=list,
        description="Names or glob patterns of containers that start at boot and must go.",
    )
    units: list[UnitName] = Field(
        default_factory=list, description="systemd units to stop before redeploying."
    )
    disable_units: bool = Field(
        False, description="Also disable the units, so they do not start at the next boot."
    )


DEFAULT_NIGHTLY = "0 4 * * *"
CRON_LINE = re.compile(r"^[0-9A-Za-z*,/-]+( [0-9A-Za-z*,/-]+){4}$")


class ScheduleConfig(Section):
    nightly: str = Field(
        DEFAULT_NIGHTLY,
        description='When the nightly full redeploy runs: a cron line of five fields, or "off".',
    )
    timezone: str = Field(
        "UTC", description="The IANA time zone the cron line is read in (e.g. Europe/Berlin)."
    )

    @field_validator("nightly")
    @classmethod
    def _cron(cls, value: str) -> str:
        # Its shape here; whether Prefect takes its values (minute 0-59, ...) is asked where
        # Prefect is (deployments.definitions.schedule_problem, from check-config and serve).
        if value != "off" and not CRON_LINE.fullmatch(value):
            raise ValueError(
                f'{value!r} is not a cron line of five fields (e.g. "0 4 * * *", '
                '"30 2 * * 1-5"), nor "off"'
            )
        return value

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"{value!r} is not an IANA time zone (e.g. UTC, Europe/Berlin, America/New_York)"
            ) from None
        return value


class DeadlinesConfig(Section):
    model_load_s: Seconds = Field(1200, description="How long the weights may take to load.")
    nodes_reachable_s: Seconds = Field(
        300, description="How long to wait for nodes to come back after a reboot."
    )
    gpu_release_s: Seconds = Field(
        30,
        description="How long GPU processes may take to exit and the ports (API, Ray's, the "
        "master port) to be released after the old containers stop.",
    )
    ray_cluster_s: Seconds = Field(
        120, description="ray backend: how long Ray may take to see every node and GPU."
    )
    rendezvous_s: Seconds = Field(
        120,
        description="mp backend: how long every follower may take to connect to the leader's "
        "rendezvous port once it listens (vLLM itself waits 600 s, silently).",
    )


class LockConfig(Section):
    wait_s: Seconds = Field(
        7200,
        description="How long a run waits while another run of this cluster holds it (nightly, "
        "after-reboot and manual runs queue one after another) before it fails saying so.",
    )
    lease_s: float = Field(
        120,
        ge=60,
        le=86400,
        description="The holder of the cluster beats every 10 s; a waiting run takes the "
        "cluster from a holder that has not beaten for this long (its controller died, or "
        "the Prefect server was away longer). Prefect's minimum is 60 s.",
    )


class WatchConfig(Section):
    interval_s: Seconds = Field(
        15, description="How often `vllm-redeploy watch` looks at the engine and every rank."
    )
    failures: int = Field(
        3, ge=1, description="Bad looks in a row before vllm.cluster.unhealthy is emitted."
    )
    max_recoveries: int = Field(
        3,
        ge=1,
        description="Recovery runs allowed per window_s; one more marks the cluster "
        "crash-looping, and nothing automatic touches it until `vllm-redeploy resume`.",
    )
    window_s: Seconds = Field(3600, description="The window max_recoveries counts in.")
    backoff_s: Seconds = Field(
        30,
        description="Wait before the second recovery in the window; each next one waits 4 "
        "times longer (30 s, 2 min, 8 min).",
    )
    generate_every: int = Field(
        4,
        ge=0,
        description="Every this many looks, also send a 1-token generation: a hung group (a "
        "frozen or lost rank) still answers /health with 200, only a generation tells, and the "
        "engine's /metrics tell busy from stuck. 0: never.",
    )
    generate_timeout_s: Seconds = Field(
        30,
        description="How long that generation (and the one `status` sends) may take before the "
        "engine's counters are asked whether it is busy or stuck.",
    )


class AlertsConfig(Section):
    block: str | None = Field(
        None,
        pattern=r"^[a-z0-9][a-z0-9-]*/[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="The Prefect notification block the alerts go through, as TYPE/NAME (e.g. "
        "slack-webhook/ops; `prefect block ls` lists them): its secrets stay in Prefect. "
        "`vllm-redeploy alerts` sets the alerts up; none without it.",
    )
    unhealthy_for_s: Seconds = Field(
        900,
        ge=10,  # Prefect's minimum for a trigger on an event that does not come
        description="Alert when the watcher reported the cluster unhealthy and no run brought "
        "it back (vllm.cluster.ready) within this long.",
    )


class ProbeConfig(Section):
    prompt: str = Field("Say hello in one sentence.", min_length=1, description="Sanity prompt.")
    max_tokens: int = Field(50, ge=1, description="Token budget of the probe.")
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature of the probe.")
    timeout_s: Seconds = Field(60, description="How long the probe request may take.")


class WebhookConfig(Section):
    url: (
        Annotated[
            str,
            matches(
                re.compile(r"^https?://[A-Za-z0-9._:\[\]-]+(/[A-Za-z0-9._/-]*)?$"), "http(s) URL"
            ),
        ]
        | None
    ) = Field(
        None,
        description="Where the nodes' notifier reaches the webhook, e.g. http://controller:8787.",
    )
    host: Annotated[str, matches(HOST_PATTERN, "bind address")] = Field(
        "127.0.0.1", description="Address the webhook service binds (0.0.0.0 for the fabric)."
    )
    port: Port = Field(8787, description="Port of the webhook service.")

    def unreachable(self, host: str | None = None) -> str | None:
        """Why the nodes cannot reach the webhook at ``url`` while it binds ``host`` (default:
        its own): a loopback bind that ``url`` names another address of. None when nothing
        says so (a proxy on this machine may still forward to a loopback bind: then say so)."""
        bind = host or self.host
        if self.url is None or not _loopback(bind):
            return None
        named = urlsplit(self.url).hostname or ""
        if _loopback(named):
            return None
        return (
            f"the webhook binds {bind}:{self.port}, which only this machine reaches, while "
            f"[webhook] url ({self.url}) is how the nodes are to reach it: their reboot notices "
            "would be retried for an hour and dropped. Set [webhook] host to an address the "
            "nodes reach (0.0.0.0 for every address), or leave it if a proxy on this machine "
            "forwards that URL to it"
        )

    replay_window_s: Seconds = Field(
        300, description="Signed calls older or newer than this are refused (replay protection)."
    )
    max_body_bytes: int = Field(4096, ge=256, le=1_048_576, description="Largest accepted body.")
    reboot_debounce_s: Seconds = Field(
        600, description="after-reboot: further reboot events within this window start no run."
    )
    reboot_delay_s: float = Field(
        60,
        ge=0,
        description="after-reboot: the run starts once every node reported its new boot, and "
        "at the latest this long after the first node did (preflight waits for the rest).",
    )
    header_timeout_s: Seconds = Field(
        5,
        description="A connection that has not sent a request's headers this long after it "
        "opened (or after the previous answer) is closed.",
    )
    body_timeout_s: Seconds = Field(
        5, description="A request whose body has not arrived this long after its headers is cut."
    )
    max_connections: int = Field(
        512,
        ge=8,
        le=65536,
        description="Connections served at once (fewer when the open-file limit leaves less "
        "room); a newcomer beyond it closes the oldest one still sending its request.",
    )
    spool_dir: ModelPath | None = Field(
        None,
        description="Where accepted notices wait, one file each in a directory per cluster, "
        "until the cluster's watcher has posted them to Prefect; the webhook and the watcher "
        "must name the same one. Default: $XDG_STATE_HOME/vllm-redeploy/webhook-spool, else "
        "~/.local/state/vllm-redeploy/webhook-spool (install-controller's units name "
        "/var/lib/vllm-redeploy-spool).",
    )


class SecretsConfig(Section):
    hf_token: SecretStr | None = Field(
        None, description="Hugging Face token (HF_TOKEN in the containers)."
    )
    webhook_secret: SecretStr | None = Field(
        None, description="Shared secret of the reboot webhook."
    )
    vllm_api_key: SecretStr | None = Field(
        None,
        description="vLLM's API key: given to the engine as VLLM_API_KEY (its environment, "
        "never its command line); vLLM then refuses /v1 requests without it, and every request "
        "of ours sends it as Authorization: Bearer.",
    )


class SyncConfig(Section):
    image: Literal["auto", "off"] = Field(
        "auto",
        description="auto: a node that lacks the image, or holds another build under its tag, "
        "gets the source's (docker save | docker load, streamed) before the launch. off: such a "
        "node fails preflight, as before.",
    )
    model: Literal["auto", "off"] = Field(
        "auto",
        description="auto: a node that lacks the model directory, or files of it (by size and "
        "modification time), gets them from the source before the launch; files only the node "
        "has are kept. off: a node without the model fails preflight.",
    )
    source: Name | None = Field(
        None, description="The node whose image and model are copied; default the head."
    )
    direct: Literal["auto", "off"] = Field(
        "auto",
        description="auto: copy straight from the source to the target over the fabric when "
        "the source can SSH to the target's fabric IP without a prompt (its own keys and "
        "known_hosts); else, and with off, relay through this machine.",
    )
    ssh_key_file: ModelPath | None = Field(
        None,
        description="direct: the private key the source uses (a path on the source node); "
        "default its user's keys and agent.",
    )
    known_hosts: ModelPath | None = Field(
        None,
        description="direct: the known_hosts file the source checks targets against (a path "
        "on the source node); default its user's. Unknown host keys are never accepted.",
    )
    stall_s: Seconds = Field(
        60, description="A copy that moves no byte for this long fails (a cut link, a hung side)."
    )


def _loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
