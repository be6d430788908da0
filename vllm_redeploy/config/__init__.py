"""The cluster configuration (see ``loading`` for where values come from): one module per
concern. ``fields`` the value shapes, ``nodes``, ``launch`` and ``runs`` the sections, ``cluster``
the whole and its rules, ``errors`` the wording, ``loading`` the sources."""

from vllm_redeploy.config.cluster import SECRET_KEYS, ClusterConfig, describe, settings_data
from vllm_redeploy.config.errors import ConfigError
from vllm_redeploy.config.fields import (
    CONFIG_VARIABLE,
    DEFAULT_CONFIG,
    ENV_PREFIX,
    REMOVED_FLAGS,
    Seconds,
)
from vllm_redeploy.config.launch import (
    CacheConfig,
    FabricConfig,
    MemoryConfig,
    RayConfig,
    VLLMConfig,
)
from vllm_redeploy.config.loading import (
    cluster_env_file,
    environ_overrides,
    load_clusters,
    load_config,
    resolve_config,
)
from vllm_redeploy.config.nodes import NodeConfig, SSHConfig
from vllm_redeploy.config.runs import (
    AutostartConfig,
    DeadlinesConfig,
    LockConfig,
    ProbeConfig,
    SecretsConfig,
    SyncConfig,
    WatchConfig,
    WebhookConfig,
)

__all__ = [
    "CONFIG_VARIABLE",
    "DEFAULT_CONFIG",
    "ENV_PREFIX",
    "REMOVED_FLAGS",
    "SECRET_KEYS",
    "AutostartConfig",
    "CacheConfig",
    "ClusterConfig",
    "ConfigError",
    "DeadlinesConfig",
    "FabricConfig",
    "LockConfig",
    "MemoryConfig",
    "NodeConfig",
    "ProbeConfig",
    "RayConfig",
    "SSHConfig",
    "Seconds",
    "SecretsConfig",
    "SyncConfig",
    "VLLMConfig",
    "WatchConfig",
    "WebhookConfig",
    "cluster_env_file",
    "describe",
    "environ_overrides",
    "load_clusters",
    "load_config",
    "resolve_config",
    "settings_data",
]
