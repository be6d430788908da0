"""One cluster: its sections, the rules between them, and its description with secrets masked."""

from __future__ import annotations

from typing import Any, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from vllm_redeploy.config.fields import ENV_PREFIX, Name
from vllm_redeploy.config.launch import (
    CacheConfig,
    FabricConfig,
    MemoryConfig,
    RayConfig,
    VLLMConfig,
)
from vllm_redeploy.config.nodes import NodeConfig, SSHConfig
from vllm_redeploy.config.runs import (
    AlertsConfig,
    AutostartConfig,
    DeadlinesConfig,
    LockConfig,
    ProbeConfig,
    ScheduleConfig,
    SecretsConfig,
    SyncConfig,
    WatchConfig,
    WebhookConfig,
)
from vllm_redeploy.masking import MASK


class ClusterConfig(BaseSettings):
    """One cluster: its nodes, the vLLM launch, what to stop first, deadlines, the probe."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        env_file=".env",
        # Env files may hold other programs' variables (PREFECT_API_AUTH_STRING, for a unit's
        # EnvironmentFile): they are read like the environment, only the names of settings. A
        # VLLM_REDEPLOY_ name that sets nothing is an error in both, in the same words
        # (sources.Sources.unknown_variable_problems).
        dotenv_filtering="only_existing",
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
    cache: CacheConfig = Field(default_factory=CacheConfig)
    autostart: AutostartConfig = Field(default_factory=AutostartConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    deadlines: DeadlinesConfig = Field(default_factory=DeadlinesConfig)
    lock: LockConfig = Field(default_factory=LockConfig)
    watch: WatchConfig = Field(default_factory=WatchConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)
    secrets: SecretsConfig = Field(default_factory=SecretsConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)

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
        problems += self._port_collisions()
        if self.sync.source is not None and self.sync.source not in names:
            problems.append(
                f"sync.source {self.sync.source!r} is not a node of this cluster; name one of "
                f"{', '.join(names)} (default: the head)"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _port_collisions(self) -> list[str]:
        """The head's ports the group binds, two on one number (the second bind would fail
        after the old stack was stopped). Ray's matters unless the backend is mp, the
        rendezvous' unless it is ray."""
        backend = self.vllm.backend
        used = [("vllm.port", self.vllm.port)]
        if backend != "mp":
            used.append(("ray.port", self.ray.port))
        if backend != "ray":
            used.append(("vllm.master_port", self.vllm.master_port))
        problems = []
        for i, (key, port) in enumerate(used):
            for other, number in used[i + 1 :]:
                if number == port:
                    problems.append(
                        f"{key} and {other} are both {port}: each needs its own port on the "
                        "head; change one of them"
                    )
        return problems

    @property
    def sync_source(self) -> NodeConfig:
        """The node whose image and model the others get (``[sync] source``, default the head)."""
        return next((n for n in self.nodes if n.name == self.sync.source), self.head)

    @property
    def head(self) -> NodeConfig:
        return next((n for n in self.nodes if n.head), self.nodes[0])

    @property
    def workers(self) -> list[NodeConfig]:
        head = self.head
        return [n for n in self.nodes if n is not head]

    def secret_values(self) -> tuple[str, ...]:
        """Every secret's plain value, for masking in messages."""
        secrets = (getattr(getattr(self, section), key) for section, key in SECRET_KEYS)
        return tuple(
            s.get_secret_value() for s in secrets if s is not None and s.get_secret_value()
        )


# In this order: secret_values() callers rely on it (the HF token first).
SECRET_KEYS: tuple[tuple[str, str], ...] = (
    ("secrets", "hf_token"),
    ("secrets", "webhook_secret"),
    ("ssh", "key_passphrase"),
    ("secrets", "vllm_api_key"),
)


def settings_data(config: ClusterConfig) -> dict[str, Any]:
    """The resolved settings as plain data, in the file's shape (every key of every section,
    defaults included), secrets masked."""
    data = config.model_dump(mode="json")
    for section, key in SECRET_KEYS:
        if data[section].get(key) is not None:
            data[section][key] = MASK
    return data


def describe(config: ClusterConfig) -> dict[str, Any]:
    """The resolved configuration as plain data, secrets masked, with what follows from it:
    the head node and the served model name."""
    data = settings_data(config)
    data["head"] = config.head.name
    data["vllm"]["served_name"] = config.vllm.served_name
    return data
