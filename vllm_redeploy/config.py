"""The cluster configuration: a TOML file, then `.env` in the working directory, then the
cluster's own env file beside its TOML (``spark-pair.toml`` -> ``spark-pair.env``), then
environment variables (later wins).

Environment variables use the prefix ``VLLM_REDEPLOY_`` and ``__`` for nesting, e.g.
``VLLM_REDEPLOY_VLLM__PORT=30001`` or ``VLLM_REDEPLOY_SECRETS__HF_TOKEN=hf_...``. Explicit
environment variables beat the files, as in every twelve-factor tool, so an operator can override
a committed file for one run.

A process that loads several clusters (``serve``, ``watch``, ``webhook``, ``status`` with several
``--config``) reads each cluster's own env file only: the process environment and `.env` would
apply to every cluster at once (one cluster's secrets in another's containers), so such a process
refuses to start while either sets a ``VLLM_REDEPLOY_`` value (:func:`load_clusters`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyAddress,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from vllm_redeploy.safe_text import one_line, shown

ENV_PREFIX = "VLLM_REDEPLOY_"
DEFAULT_CONFIG = Path("cluster.toml")

# What may appear in values that end up in container names, paths, unit names and flags. The
# code quotes everything it sends to a shell anyway; these rules catch typos and pasted shell.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_PATH = re.compile(r"^/[A-Za-z0-9_./@+=,:-]*$")
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./@+:-]*$")
_IMAGE = re.compile(r"^[a-z0-9][A-Za-z0-9_./:@-]*$")
_GLOB = re.compile(r"^[A-Za-z0-9_.*?\[\]-][A-Za-z0-9_.*?\[\]/-]*$")
_UNIT = re.compile(r"^[A-Za-z0-9:_.@\\-]+\.(service|target|socket|timer|scope)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VOLUME = re.compile(r"^(/[^:\s]*|[A-Za-z0-9][A-Za-z0-9_.-]*):(/[^:\s]*)(:(ro|rw))?$")
_SHM = re.compile(r"^[0-9]+[bkmgBKMG]?$")
REMOVED_FLAGS = {"--enable-reasoning": "use reasoning_parser instead (--reasoning-parser)"}


def _matches(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid {what} (no whitespace or shell characters)")
        return value

    return AfterValidator(check)


Name = Annotated[str, _matches(_NAME, "name: letters, digits, '.', '_', '-'")]
Interface = Annotated[str, _matches(_NAME, "network interface name")]
ModelPath = Annotated[str, _matches(_PATH, "absolute model path")]
ContainerPattern = Annotated[str, _matches(_GLOB, "container name or glob pattern")]
UnitName = Annotated[str, _matches(_UNIT, "systemd unit name (e.g. glm-server.service)")]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0)]


class _Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid")


class NodeConfig(_Section):
    name: Name = Field(description="Short name used in messages and task names, e.g. spark-a.")
    address: Annotated[str, _matches(_HOST, "host name or IP address")] = Field(
        description="Where the controller reaches the node (SSH host name or IP)."
    )
    transport: Literal["ssh", "local"] = Field(
        "ssh", description='"ssh", or "local" when the controller is this node (no SSH).'
    )
    ssh_user: Name | None = Field(
        None, description="SSH user; default: ssh.user, then the current user."
    )
    ssh_port: Port = Field(22, description="SSH port.")
    ssh_key_file: Path | None = Field(
        None, description="Private key; default: ssh.key_file, then the SSH agent and ~/.ssh keys."
    )
    fabric_ip: IPvAnyAddress | None = Field(
        None,
        description="IP on the fast fabric that Ray and NCCL must use (ray --node-ip-address, "
        "VLLM_HOST_IP). Default: address, when address is an IP.",
    )
    fabric_interfaces: list[Interface] = Field(
        default_factory=list,
        description="Fabric interface names for NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, "
        "TP_SOCKET_IFNAME and UCX_NET_DEVICES (a Spark has them in pairs). Every node must name "
        "as many (Gloo's rule); default: the one the fabric IP is on (and its twins for NCCL).",
    )
    ib_hcas: list[Interface] = Field(
        default_factory=list, description="NCCL_IB_HCA devices, e.g. rocep1s0f0."
    )
    gpus: int = Field(1, ge=1, le=64, description="GPUs this node gives to the cluster.")
    head: bool = Field(False, description="Run the Ray head here (default: the first node).")
    docker_host: str | None = Field(
        None,
        description="Local transport only: Docker socket URL; "
        "default: DOCKER_HOST or the system socket.",
    )

    @model_validator(mode="after")
    def _fabric_ip_from_address(self) -> Self:
        if self.fabric_ip is None:
            try:
                self.fabric_ip = ipaddress.ip_address(self.address)
            except ValueError:
                raise ValueError(
                    f"fabric_ip is required because address {self.address!r} is a host name: "
                    "set it to the node's IP on the fabric "
                    "(what `ray start --node-ip-address` gets)"
                ) from None
        if self.docker_host and self.transport != "local":
            raise ValueError(
                'docker_host applies to transport = "local" only; remove it for SSH nodes'
            )
        return self

    @property
    def ip(self) -> str:
        return str(self.fabric_ip)


class SSHConfig(_Section):
    user: Name | None = Field(None, description="Default SSH user for all nodes.")
    key_file: Path | None = Field(None, description="Default private key for all nodes.")
    key_passphrase: SecretStr | None = Field(
        None, description="Passphrase of the key file, if any."
    )
    known_hosts: Path = Field(
        Path("~/.ssh/known_hosts"),
        description="known_hosts file the node host keys are checked against.",
    )
    trust_on_first_use: bool = Field(
        False,
        description="Record an unknown host key on first connection "
        "(a changed key is always refused).",
    )
    connect_timeout_s: Seconds = Field(
        10, description="TCP connect, handshake and authentication timeout."
    )
    command_timeout_s: Seconds = Field(
        60, description="Wall-clock timeout of one quick remote command (inspections, checks)."
    )
    keepalive_s: int = Field(
        5, ge=1, description="SSH keepalive interval; a dead link is noticed in about 3x this."
    )


class VLLMConfig(_Section):
    image: Annotated[str, _matches(_IMAGE, "Docker image reference")] = Field(
        description="Image with vLLM and Ray, identical on every node."
    )
    model: ModelPath = Field(
        description="Model directory on every node (mounted at the same path)."
    )
    served_model_name: Annotated[str, _matches(_SERVED_NAME, "served model name")] | None = Field(
        None,
        description="Name clients use in requests; default: the model path verbatim, as vLLM does.",
    )
    port: Port = Field(30000, description="OpenAI-compatible API port on the head node.")
    host: Annotated[str, _matches(_HOST, "bind address")] = Field(
        "0.0.0.0",  # noqa: S104 - the API serves the network
        description="API bind address.",
    )
    backend: Literal["auto", "ray", "mp"] = Field(
        "auto",
        description="How the ranks on several nodes find each other: ray (a Ray cluster, the "
        "image must carry Ray), mp (vLLM's own --nnodes launcher, no Ray needed), or auto: ray "
        "when the image carries Ray, mp otherwise.",
    )
    master_port: Port = Field(
        29501, description="mp backend: the rendezvous port on the head (--master-port)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="--tensor-parallel-size.")
    pipeline_parallel_size: int = Field(1, ge=1, description="--pipeline-parallel-size.")
    reasoning_parser: Name | None = Field(
        None, description='--reasoning-parser: "qwen3", "deepseek_r1"...'
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="--gpu-memory-utilization."
    )
    max_model_len: int | None = Field(None, ge=1, description="--max-model-len.")
    extra_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` arguments, one per item."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment of the Ray/vLLM containers."
    )
    volumes: list[str] = Field(
        default_factory=list,
        description="Extra mounts HOST:CONTAINER[:ro], "
        "e.g. the HF cache and the ~/.cache/vllm compile cache.",
    )
    shm_size: Annotated[str, _matches(_SHM, "size like 16g")] = Field(
        "16g", description="Shared memory size of the containers."
    )
    gpu_device_request: bool = Field(
        True,
        description="Ask Docker for the node's GPUs (--gpus); off only for machines without GPUs.",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_removed_flags(cls, args: list[str]) -> list[str]:
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in REMOVED_FLAGS:
                raise ValueError(f"{flag} was removed from vLLM: {REMOVED_FLAGS[flag]}")
            if "\n" in arg or "\0" in arg:
                raise ValueError(f"{arg!r} contains a newline or NUL byte")
        return args

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key, value in env.items():
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if "\0" in value:
                raise ValueError(f"the value of {key} contains a NUL byte")
        return env

    @field_validator("volumes")
    @classmethod
    def _volume_syntax(cls, volumes: list[str]) -> list[str]:
        for volume in volumes:
            if not _VOLUME.fullmatch(volume):
                raise ValueError(f"{volume!r} is not HOST:CONTAINER[:ro|rw] with absolute paths")
        return volumes

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class RayConfig(_Section):
    port: Port = Field(6379, description="Ray head (GCS) port.")
    memory_monitor: bool = Field(
        False,
        description="Ray's memory monitor, which kills workers at 95% of node memory. Off: on "
        "unified memory (DGX Spark) a node's weight shard alone gets there while loading.",
    )
    object_store_bytes: int | None = Field(
        1 << 30,
        ge=78643200,
        description="Ray's object store per node (--object-store-memory); vLLM barely uses it. "
        "Ray's own default, 30% of memory, takes ~36 GB from a Spark's GPU. None: Ray's default.",
    )
    prestart_workers: bool = Field(
        False,
        description="Let Ray start idle Python workers ahead of time (one per CPU; ~100 MB each).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="More `ray start` arguments on every node, e.g. --num-cpus=8",
    )

    @field_validator("extra_args")
    @classmethod
    def _one_line_each(cls, args: list[str]) -> list[str]:
        for arg in args:
            if "\n" in arg or "\0" in arg:
                raise ValueError(f"{arg!r} contains a newline or NUL byte")
        return args


class AutostartConfig(_Section):
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


class FabricConfig(_Section):
    rdma: Literal["auto", "off"] = Field(
        "auto",
        description="auto: give the containers of every node with active RDMA HCAs their "
        "devices (/dev/infiniband), IPC_LOCK and an unlimited memlock, so NCCL can use RoCE/IB; "
        "off: never (NCCL then uses TCP sockets).",
    )
    require_rdma: bool | None = Field(
        None,
        description="Fail a run whose NCCL did not use RDMA on every rank (it answers, but "
        "slowly). Default: true when any node has RDMA HCAs.",
    )
    privileged: bool = Field(
        False, description="Run the containers privileged (some RDMA setups need it)."
    )
    memlock_bytes: int = Field(
        -1,
        ge=-1,
        description="--ulimit memlock of RDMA nodes' containers; -1: unlimited (NVIDIA's value).",
    )
    stack_bytes: int = Field(
        67108864, ge=-1, description="--ulimit stack of RDMA nodes' containers (NVIDIA's value)."
    )


class MemoryConfig(_Section):
    drop_page_cache: bool | None = Field(
        None,
        description="Drop the page cache on each node right before the launch (through a "
        "one-shot container). vLLM on unified memory (GB10) counts cached pages as used and "
        "refuses to start. Default: on for unified-memory nodes.",
    )


class DeadlinesConfig(_Section):
    model_load_s: Seconds = Field(1200, description="How long the weights may take to load.")
    nodes_reachable_s: Seconds = Field(
        300, description="How long to wait for nodes to come back after a reboot."
    )
    gpu_release_s: Seconds = Field(30, description="Grace period for GPU processes to exit.")
    ray_cluster_s: Seconds = Field(
        120, description="How long Ray may take to see every node and GPU."
    )
    rendezvous_s: Seconds = Field(
        120,
        description="mp backend: how long every follower may take to connect to the leader's "
        "rendezvous port once it listens (vLLM itself waits 600 s, silently).",
    )


class LockConfig(_Section):
    wait_s: Seconds = Field(
        7200,
        description="How long a run waits while another run of this cluster holds it (nightly, "
        "after-reboot and manual runs queue one after another) before it fails saying so.",
    )
    lease_s: float = Field(
        120,
        ge=60,
        le=86400,
        description="A run renews its hold on the cluster every 3/4 of this; one that dies "
        "(its controller killed) frees the cluster this long after its last renewal. "
        "Prefect's minimum is 60 s.",
    )


class WatchConfig(_Section):
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


class ProbeConfig(_Section):
    prompt: str = Field("Say hello in one sentence.", min_length=1, description="Sanity prompt.")
    max_tokens: int = Field(50, ge=1, description="Token budget of the probe.")
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature of the probe.")
    timeout_s: Seconds = Field(60, description="How long the probe request may take.")


class WebhookConfig(_Section):
    url: (
        Annotated[
            str,
            _matches(
                re.compile(r"^https?://[A-Za-z0-9._:\[\]-]+(/[A-Za-z0-9._/-]*)?$"), "http(s) URL"
            ),
        ]
        | None
    ) = Field(
        None,
        description="Where the nodes' notifier reaches the webhook, e.g. http://controller:8787.",
    )
    host: Annotated[str, _matches(_HOST, "bind address")] = Field(
        "127.0.0.1", description="Address the webhook service binds (0.0.0.0 for the fabric)."
    )
    port: Port = Field(8787, description="Port of the webhook service.")
    replay_window_s: Seconds = Field(
        300, description="Signed calls older or newer than this are refused (replay protection)."
    )
    max_body_bytes: int = Field(4096, ge=256, le=1_048_576, description="Largest accepted body.")
    reboot_debounce_s: Seconds = Field(
        600, description="after-reboot: further reboot events within this window start no run."
    )
    reboot_delay_s: float = Field(
        60, ge=0, description="after-reboot: wait this long after the first event before the run."
    )


class SecretsConfig(_Section):
    hf_token: SecretStr | None = Field(
        None, description="Hugging Face token (HF_TOKEN in the containers)."
    )
    webhook_secret: SecretStr | None = Field(
        None, description="Shared secret of the reboot webhook."
    )


class ClusterConfig(BaseSettings):
    """One cluster: its nodes, the vLLM launch, what to stop first, deadlines, the probe."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        env_file=".env",
        # Env files may hold other programs' variables (PREFECT_API_AUTH_STRING, for a unit's
        # EnvironmentFile): only VLLM_REDEPLOY_ ones are ours, and a misspelt one of ours is
        # still an error.
        dotenv_filtering="match_prefix",
        env_ignore_empty=True,
        extra="forbid",
    )

    name: Name = Field("default", description="Cluster name; labels this project's containers.")
    nodes: list[NodeConfig] = Field(
        min_length=1, description="The nodes; the first is the head unless one says head = true."
    )
    ssh: SSHConfig = Field(default_factory=SSHConfig)
    vllm: VLLMConfig
    ray: RayConfig = Field(default_factory=RayConfig)
    fabric: FabricConfig = Field(default_factory=FabricConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    autostart: AutostartConfig = Field(default_factory=AutostartConfig)
    deadlines: DeadlinesConfig = Field(default_factory=DeadlinesConfig)
    lock: LockConfig = Field(default_factory=LockConfig)
    watch: WatchConfig = Field(default_factory=WatchConfig)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)
    secrets: SecretsConfig = Field(default_factory=SecretsConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins: environment, then .env, then the TOML file (passed as init values).
        return (env_settings, dotenv_settings, init_settings)

    @model_validator(mode="after")
    def _cluster_rules(self) -> Self:
        problems: list[str] = []
        names = [n.name for n in self.nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"node names must be unique; repeated: {', '.join(dupes)}")
        ips = [n.ip for n in self.nodes]
        for ip in sorted({ip for ip in ips if ips.count(ip) > 1}):
            sharing = " and ".join(n.name for n in self.nodes if n.ip == ip)
            problems.append(
                f"{sharing} have the same fabric_ip {ip}; each node needs its own (the address "
                "Ray and VLLM_HOST_IP use on that node): fix the fabric_ip of the wrong one"
            )
        heads = [n.name for n in self.nodes if n.head]
        if len(heads) > 1:
            problems.append(f"only one node can be the head; head = true on {', '.join(heads)}")
        gpus = sum(n.gpus for n in self.nodes)
        if self.vllm.world_size > gpus:
            problems.append(
                f"vllm.tensor_parallel_size x vllm.pipeline_parallel_size = {self.vllm.world_size} "
                f"needs more GPUs than the nodes have ({gpus}); "
                "lower the parallel sizes or add nodes"
            )
        gloo = {n.name: len(n.fabric_interfaces) or 1 for n in self.nodes}
        if len(set(gloo.values())) > 1:
            counts = ", ".join(f"{name} {count}" for name, count in gloo.items())
            problems.append(
                f"the nodes name different numbers of fabric_interfaces ({counts}; a node that "
                "names none uses the one its fabric IP is on): Gloo (GLOO_SOCKET_IFNAME) needs "
                "the same number on every node or the ranks wait for each other for ever; name "
                "as many on each node, or leave them out everywhere"
            )
        locals_ = [n.name for n in self.nodes if n.transport == "local"]
        if len(locals_) > 1:
            problems.append(
                f"only the controller's own node can be local; local on {', '.join(locals_)}"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def head(self) -> NodeConfig:
        return next((n for n in self.nodes if n.head), self.nodes[0])

    @property
    def workers(self) -> list[NodeConfig]:
        head = self.head
        return [n for n in self.nodes if n is not head]

    def secret_values(self) -> tuple[str, ...]:
        """Every secret's plain value, for masking in messages."""
        secrets = (self.secrets.hf_token, self.secrets.webhook_secret, self.ssh.key_passphrase)
        return tuple(
            s.get_secret_value() for s in secrets if s is not None and s.get_secret_value()
        )


class ConfigError(Exception):
    """The configuration cannot be used; ``problems`` has one readable line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.source = source
        self.problems = problems

    def __reduce__(self):  # type: ignore[override]
        return (ConfigError, (self.source, self.problems))


def cluster_env_file(path: Path) -> Path:
    """The cluster's own settings and secrets: ``spark-pair.toml`` -> ``spark-pair.env``."""
    return path.with_suffix(".env")


def load_config(
    path: Path | str | None = None, *, env_file: Path | str | None = ".env"
) -> ClusterConfig:
    """Read and validate the configuration, or raise ConfigError naming every problem.

    ``env_file``: the shared env file (`.env` in the working directory; None: none); the
    cluster's own (:func:`cluster_env_file`) is always read and wins over it."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    data = _read_toml(path)
    env_files = tuple(f for f in (env_file, cluster_env_file(path)) if f is not None)
    try:
        config = ClusterConfig(_env_file=env_files, **data)  # type: ignore[call-arg]
    except ValidationError as exc:
        problems: list[str] = []
        for error in exc.errors():
            for line in map(one_line, _explain(error).split("\n")):
                if line not in problems:
                    problems.append(line)
        raise ConfigError(str(path), problems) from None
    except SettingsError as exc:  # a list or table from the environment that is not JSON
        raise ConfigError(str(path), [_settings_problem(exc)]) from None
    problems = _file_problems(config)
    if problems:
        raise ConfigError(str(path), problems)
    return config


def load_clusters(paths: list[Path]) -> list[ClusterConfig]:
    """Several clusters for one process, each from its TOML and its own env file only; or
    ConfigError when a shared source would apply to all of them, or two name the same cluster."""
    if len(paths) == 1:
        return [load_config(paths[0])]
    shared = sorted(k for k in os.environ if _is_setting(k))
    dotenv = Path(".env")
    in_dotenv = _prefixed_keys(dotenv)
    example = cluster_env_file(paths[0])
    problems = [
        f"{where} sets {', '.join(map(shown, keys))}, which would apply to each of the "
        f"{len(paths)} clusters this process loads (one cluster's secrets and settings in "
        f"another's): move each value to the env file of its cluster, beside its configuration "
        f"(e.g. {shown(str(example))}), and {fix}"
        for where, keys, fix in (
            ("the environment", shared, "unset it here"),
            (f"{dotenv.resolve()}", in_dotenv, "remove it from that file"),
        )
        if keys
    ]
    if problems:
        raise ConfigError("the controller's environment", problems)
    configs = [load_config(path, env_file=None) for path in paths]
    names = [c.name for c in configs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(
            ", ".join(map(str, paths)),
            [f"two configurations name the same cluster ({', '.join(repeated)}); name each apart"],
        )
    return configs


def _prefixed_keys(path: Path) -> list[str]:
    """The cluster settings an env file sets (none when there is no such file)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    keys = (line.split("=", 1)[0].strip().removeprefix("export ").strip() for line in lines)
    return sorted({k for k in keys if _is_setting(k)})


def _is_setting(key: str) -> bool:
    """A variable that sets a cluster's value (``VLLM_REDEPLOY_VLLM__PORT``); others of the
    prefix (``VLLM_REDEPLOY_CONFIG``, prefect.yaml's) are not the configuration's."""
    upper = key.upper()
    field = upper.removeprefix(ENV_PREFIX).split("__", 1)[0].lower()
    return upper.startswith(ENV_PREFIX) and field in ClusterConfig.model_fields


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(
            str(path),
            [
                "the configuration file does not exist: pass --config FILE, or copy "
                "cluster.example.toml to cluster.toml and describe your nodes"
            ],
        )
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), [f"not valid TOML: {one_line(exc)}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            str(path), [f"not valid TOML: the file is not UTF-8 text (byte {exc.start})"]
        ) from None
    except RecursionError:
        raise ConfigError(
            str(path), ["not valid TOML: arrays or tables nested too deeply"]
        ) from None
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the file: {one_line(exc.strerror)}"]) from None


def _file_problems(config: ClusterConfig) -> list[str]:
    """Checks of the controller's own files (keys), done after the model is valid."""
    problems = []
    for key_file, key in [(config.ssh.key_file, "ssh.key_file")] + [
        (n.ssh_key_file, f"nodes[{i}].ssh_key_file") for i, n in enumerate(config.nodes)
    ]:
        if key_file is not None and not _is_file(key_file):
            problems.append(
                f"{key}: the key file {shown(key_file)} does not exist; "
                "fix the path or remove the key"
            )
    try:
        config.ssh.known_hosts.expanduser()
    except RuntimeError:  # ~user of a user this machine does not have
        problems.append(
            f"ssh.known_hosts: cannot expand {shown(config.ssh.known_hosts)} (no such user's home)"
        )
    return problems


def _is_file(path: Path) -> bool:
    try:
        return path.expanduser().is_file()
    except (OSError, RuntimeError, ValueError):  # ~nosuchuser, a name too long, a NUL byte
        return False


def _settings_problem(exc: SettingsError) -> str:
    """The line for an environment (or .env) value that pydantic-settings could not parse."""
    match = re.search(r'field "([^"]+)"', str(exc))
    field = match.group(1) if match else "(top level)"
    names = sorted(k for k in os.environ if k.upper().startswith(f"{ENV_PREFIX}{field.upper()}"))
    where = ", ".join(map(shown, names)) or "a variable in .env"
    return (
        f"{field}: cannot parse the value set in the environment ({where}); lists and tables "
        "set there must be JSON, e.g. VLLM_REDEPLOY_VLLM__EXTRA_ARGS='[\"--enforce-eager\"]'"
    )


def _location(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not str(part).startswith(("function-", "json-or-python", "lax-or-strict")) and not (
            isinstance(part, str)
            and ("[" in part or part in ("str", "int", "float", "bool", "none"))
        ):
            part = shown(part)
            text += f".{part}" if text else part
    return text or "(top level)"


_SECRET_WORDS = ("secret", "token", "passphrase", "password")


def _explain(error: Any) -> str:
    """Readable line(s) for one pydantic error, naming the key and what to do."""
    loc = error["loc"]
    key = _location(loc)
    kind = error["type"]
    if kind == "extra_forbidden":  # name the key itself, whatever it is called
        parent, name = _location(loc[:-1]), str(loc[-1])
        name = name if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name) else repr(name[:64])
        key = name if parent == "(top level)" else f"{parent}.{name}"
        return f"{key}: unknown key{_did_you_mean(loc)}; check the spelling or remove it"
    if kind == "missing":
        where = "add it to the file"
        if not any(isinstance(p, int) for p in loc):
            where += f" or set {_env_name(loc)}"
        return f"{key}: required but not set; {where}"
    if kind == "too_short" and loc == ("nodes",):
        return (
            "nodes: no nodes are configured; add a [[nodes]] table with name and address per node"
        )
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind in ("ip_v4_address", "ip_v6_address", "ip_any_address"):
        message = "not a valid IP address"
    if kind not in ("value_error", "assertion_error") and _showable(loc, error.get("input")):
        message += f" (got {error['input']!r})"
    if not loc:  # cluster-wide rules name their keys themselves
        return message
    return f"{key}: {message}"


def _showable(loc: tuple[Any, ...], value: Any) -> bool:
    """Echo the offending value only when it is a short scalar and cannot be a secret."""
    if any(word in str(part).lower() for part in loc for word in _SECRET_WORDS):
        return False
    return isinstance(value, str | int | float | bool) and len(repr(value)) <= 80


def _env_name(loc: tuple[Any, ...]) -> str:
    return ENV_PREFIX + "__".join(str(p).upper() for p in loc if not isinstance(p, int))


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    import difflib

    model: Any = ClusterConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return ""
        annotation = field.annotation
        args = getattr(annotation, "__args__", ())
        model = next(
            (a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)),
            None,
        )
        if model is None:
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def describe(config: ClusterConfig) -> dict[str, Any]:
    """The resolved configuration as plain data, secrets masked."""
    data = config.model_dump(mode="json")
    for section, fields in (
        ("secrets", ("hf_token", "webhook_secret")),
        ("ssh", ("key_passphrase",)),
    ):
        for field in fields:
            if data[section].get(field) is not None:
                data[section][field] = "*****"
    data["head"] = config.head.name
    data["vllm"]["served_name"] = config.vllm.served_name
    return data


def environ_overrides() -> dict[str, str]:
    """Environment variables that override the file (names only are meant for display)."""
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
