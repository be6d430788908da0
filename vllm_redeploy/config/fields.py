"""The shapes of values every section checks: names, paths, images, patterns, ports, seconds.
Each refuses whitespace and shell characters, so what reaches a node's shell is inert.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from vllm_redeploy.model_source import REPO_ID

ENV_PREFIX = "VLLM_REDEPLOY_"
# Variables of the prefix that are not settings of a cluster: the CLI's default --config, and
# prefect.yaml's cluster and checkout. Every other VLLM_REDEPLOY_ name must be a setting.
CONFIG_VARIABLE = "VLLM_REDEPLOY_CONFIG"
# Where install-controller puts each cluster (<name>.toml and <name>.env): -c NAME finds it there.
CONFIG_DIR_VARIABLE = "VLLM_REDEPLOY_CONFIG_DIR"
INSTALLED_DIR = Path("/etc/vllm-redeploy")
OWN_VARIABLES = frozenset(
    {CONFIG_VARIABLE, CONFIG_DIR_VARIABLE, "VLLM_REDEPLOY_CLUSTER", "VLLM_REDEPLOY_HOME"}
)
DEFAULT_CONFIG = Path("cluster.toml")
# What may appear in values that end up in container names, paths, unit names and flags. The
# code quotes everything it sends to a shell anyway; these rules catch typos and pasted shell.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
HOST_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
PATH_PATTERN = re.compile(r"^/[A-Za-z0-9_./@+=,:-]*$")
SERVED_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./@+:-]*$")
IMAGE_PATTERN = re.compile(r"^[a-z0-9][A-Za-z0-9_./:@-]*$")
GLOB_PATTERN = re.compile(r"^[A-Za-z0-9_.*?\[\]-][A-Za-z0-9_.*?\[\]/-]*$")
UNIT_PATTERN = re.compile(r"^[A-Za-z0-9:_.@\\-]+\.(service|target|socket|timer|scope)$")
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
VOLUME_PATTERN = re.compile(r"^(/[^:\s]*|[A-Za-z0-9][A-Za-z0-9_.-]*):(/[^:\s]*)(:(ro|rw))?$")
SHM_PATTERN = re.compile(r"^[0-9]+[bkmgBKMG]?$")
REMOVED_FLAGS = {"--enable-reasoning": "use reasoning_parser instead (--reasoning-parser)"}


def matches(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid {what} (no whitespace or shell characters)")
        return value

    return AfterValidator(check)


Name = Annotated[str, matches(NAME_PATTERN, "name: letters, digits, '.', '_', '-'")]
Interface = Annotated[str, matches(NAME_PATTERN, "network interface name")]
ModelPath = Annotated[str, matches(PATH_PATTERN, "absolute path")]
MODEL_PATTERN = re.compile(rf"{PATH_PATTERN.pattern}|{REPO_ID.pattern}")
ModelName = Annotated[
    str, matches(MODEL_PATTERN, "model: an absolute directory, or a Hugging Face repo id ORG/NAME")
]
ServedName = Annotated[str, matches(SERVED_NAME_PATTERN, "served model name")]
ContainerPattern = Annotated[str, matches(GLOB_PATTERN, "container name or glob pattern")]
UnitName = Annotated[str, matches(UNIT_PATTERN, "systemd unit name (e.g. glm-server.service)")]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0)]


class Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid")
