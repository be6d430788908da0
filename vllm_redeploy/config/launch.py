"""What runs on the nodes: ``[vllm]`` (the engine, for both backends), ``[ray]`` (the Ray
backend only), ``[fabric]`` (RDMA for NCCL), ``[memory]`` (unified memory) and ``[cache]`` (what
vLLM compiles, kept between starts).
"""

from __future__ import annotations

import shlex
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from vllm_redeploy import nccl_logging
from vllm_redeploy.config.fields import (
    ENV_NAME_PATTERN,
    HOST_PATTERN,
    IMAGE_PATTERN,
    REMOVED_FLAGS,
    SHM_PATTERN,
    VOLUME_PATTERN,
    ModelName,
    ModelPath,
    Name,
    Port,
    Section,
    ServedName,
    matches,
)
from vllm_redeploy.config.toml_text import toml_value
from vllm_redeploy.model_source import ModelSource, model_source


def check_arguments(args: list[str], program: str) -> None:
    """Each item of ``extra_args`` is one word of ``program``'s command line: no newline or NUL,
    and not a flag with its value (``"--max-num-seqs 16"``), which the program would take for
    one unknown option, and fail on only after the old stack was stopped."""
    for arg in args:
        if "\n" in arg or "\0" in arg:
            raise ValueError(f"{arg!r} contains a newline or NUL byte")
        if (flag := secret_flag(arg)) is not None:
            raise ValueError(FLAG_REFUSED.format(flag=flag, program=program))
    joined = [arg for arg in args if _flag_with_value(arg)]
    if joined:
        fixed = [word for arg in args for word in (_words(arg) if arg in joined else [arg])]
        alternative = _with_equals(joined[0])
        raise ValueError(
            f"{toml_value(joined[0])} is a flag and its value in one item, but each "
            f"item is one word of the command line, so {program} would get one unknown option "
            f"(and fail only after the old stack was stopped): write "
            f"extra_args = {toml_value(fixed)}"
            + (f" (or {toml_value(alternative)})" if alternative else "")
        )


def _flag_with_value(arg: str) -> bool:
    """``--max-num-seqs 16``: an option, then whitespace before any ``=``."""
    return arg.startswith("-") and any(c.isspace() for c in arg.split("=", 1)[0])


def _words(arg: str) -> list[str]:
    try:
        return shlex.split(arg)
    except ValueError:  # an unclosed quote
        return arg.split()


def _with_equals(arg: str) -> str | None:
    """``--max-num-seqs=16`` for ``--max-num-seqs 16``; None for more than a flag and a value."""
    words = _words(arg)
    if len(words) == 2 and words[0].startswith("--") and "=" not in words[0]:
        return f"{words[0]}={words[1]}"
    return None


# A flag named for one of these (a whole word of its name: --hf-token, --api-key, not
# --max-num-batched-tokens or --ssl-keyfile) carries a secret.
SECRET_NAME_WORDS = frozenset({"token", "key", "secret", "password", "passphrase"})
FLAG_REFUSED = (
    "{flag} in extra_args would put a secret on {program}'s command line, which `ps` on the "
    "node, `docker inspect`'s Args, the run's log and the dry run show. Remove it and give the "
    "secret by the environment: the Hugging Face token as the secret "
    "VLLM_REDEPLOY_SECRETS__HF_TOKEN (the engine gets it as HF_TOKEN), vLLM's API key as "
    "VLLM_REDEPLOY_SECRETS__VLLM_API_KEY (the engine gets it as VLLM_API_KEY), both in the "
    "cluster's env file or the environment, never the TOML file"
)


def secret_flag(arg: str) -> str | None:
    """The flag of ``arg`` when its name says it carries a secret, as written, or None."""
    flag = arg.split("=", 1)[0].split()[0] if arg.strip() else ""
    if not flag.startswith("-"):
        return None
    words = flag.lstrip("-").lower().replace("_", "-").split("-")
    return flag if SECRET_NAME_WORDS.intersection(words) else None


# vLLM reads its API key from --api-key, else from this variable (entrypoints/serve/middleware).
API_KEY_VARIABLE = "VLLM_API_KEY"
API_KEY_SECRET = "VLLM_REDEPLOY_SECRETS__VLLM_API_KEY"  # noqa: S105 - its name, not a key
API_KEY_REFUSED = (
    "{where} would put vLLM's API key {shown}. Remove it and set the key as the secret "
    f"{API_KEY_SECRET} (the cluster's env file or the environment, never the TOML file): the "
    f"engine then gets it as {API_KEY_VARIABLE} in its environment, as HF_TOKEN, and the run's "
    "readiness wait and probe, `status` and the watcher send it as Authorization: Bearer"
)
ON_ARGV = (
    "on the engine's command line, which `ps` on the node, `docker inspect`'s Args, the run's "
    "log and the dry run show"
)
IN_FILE = "in the configuration, which check-config and the dry run show"
_API_KEY_OPTION = "api-key"
_SHORTEST_PREFIX = len("api-k")  # argparse takes --api-k for --api-key (--api- is ambiguous)


def api_key_flag(args: list[str]) -> str | None:
    """The item of ``args`` that gives vLLM ``--api-key`` (as vLLM parses flags: underscores
    for dashes, an unambiguous prefix, ``=value`` or the next word), as written, or None."""
    for arg in args:
        words = arg.split("=", 1)[0].split()
        flag = words[0] if words else ""
        name = flag[2:].replace("_", "-") if flag.startswith("--") else ""
        if len(name) >= _SHORTEST_PREFIX and _API_KEY_OPTION.startswith(name):
            return flag
    return None


class VLLMConfig(Section):
    image: Annotated[str, matches(IMAGE_PATTERN, "Docker image reference")] = Field(
        description="Image with vLLM (and Ray, for the ray backend), identical on every node."
    )
    # Before model: model's check reads it.
    hf_cache: ModelPath | None = Field(
        None,
        description="The Hugging Face cache's hub directory on every node (e.g. "
        "/home/nvidia/.cache/huggingface/hub), where a repo id model is found.",
    )
    model: ModelName = Field(
        description="The model on every node: its directory (mounted at the same path), a "
        "Hugging Face snapshot directory (.../models--ORG--NAME/snapshots/REV), the models--ORG--"
        "NAME directory, or a repo id ORG/NAME held in hf_cache."
    )
    served_model_name: ServedName | None = Field(
        None,
        description="Name clients use in requests; default: the model path verbatim, as vLLM does.",
    )
    port: Port = Field(30000, description="OpenAI-compatible API port on the head node.")
    host: Annotated[str, matches(HOST_PATTERN, "bind address")] = Field(
        "0.0.0.0",  # noqa: S104 - the API serves the network
        description="API bind address.",
    )
    # A name from the launch backends' registry (vllm_redeploy.launch.choose, which this floor
    # does not import): checked against it where the configuration is loaded for use.
    backend: Name = Field(
        "auto",
        description="How the ranks on several nodes find each other: ray (a Ray cluster, the "
        "image must carry Ray), mp (vLLM's own --nnodes launcher, no Ray needed), or auto: mp "
        "when the image's vLLM has --nnodes, ray otherwise (when the image carries Ray).",
    )
    master_port: Port = Field(
        29501, description="mp backend: the rendezvous port on the head (--master-port)."
    )
    load_format: Name = Field(
        "auto",
        description="--load-format: how the engine reads the weights. auto: instanttensor when "
        "the image's vLLM accepts it and its Python imports it, else fastsafetensors, else "
        "vLLM's own default; default: vLLM's own; or any name vLLM accepts. A --load-format in "
        "extra_args wins.",
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
        default_factory=dict,
        description="Extra environment of our containers on every node (Ray and vLLM, or the "
        "mp leader and followers).",
    )
    volumes: list[str] = Field(
        default_factory=list,
        description="Extra mounts HOST:CONTAINER[:ro], "
        "e.g. the HF cache and the ~/.cache/vllm compile cache.",
    )
    shm_size: Annotated[str, matches(SHM_PATTERN, "size like 16g")] = Field(
        "16g", description="Shared memory size of the containers."
    )
    gpu_device_request: bool = Field(
        True,
        description="Ask Docker for the node's GPUs (--gpus); off only for machines without GPUs.",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_removed_flags(cls, args: list[str]) -> list[str]:
        if (flag := api_key_flag(args)) is not None:
            raise ValueError(API_KEY_REFUSED.format(where=f"{flag} in extra_args", shown=ON_ARGV))
        check_arguments(args, "vLLM")
        for arg in args:
            flag = arg.split("=", 1)[0]
            if flag in REMOVED_FLAGS:
                raise ValueError(f"{flag} was removed from vLLM: {REMOVED_FLAGS[flag]}")
        return args

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        if API_KEY_VARIABLE in env:
            where = f"{API_KEY_VARIABLE} in [vllm.env]"
            raise ValueError(API_KEY_REFUSED.format(where=where, shown=IN_FILE))
        for key, value in env.items():
            if not ENV_NAME_PATTERN.fullmatch(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if "\0" in value:
                raise ValueError(f"the value of {key} contains a NUL byte")
        if problem := nccl_logging.file_problem(env):
            raise ValueError(problem)
        return env

    @field_validator("volumes")
    @classmethod
    def _volume_syntax(cls, volumes: list[str]) -> list[str]:
        for volume in volumes:
            if not VOLUME_PATTERN.fullmatch(volume):
                raise ValueError(f"{volume!r} is not HOST:CONTAINER[:ro|rw] with absolute paths")
        return volumes

    @field_validator("model")
    @classmethod
    def _model_found(cls, model: str, info: ValidationInfo) -> str:
        model_source(model, info.data.get("hf_cache"))  # in words: a repo id without a cache
        return model

    @property
    def source(self) -> ModelSource:
        return model_source(self.model, self.hf_cache)

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.source.serve

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class RayConfig(Section):
    port: Port = Field(6379, description="ray backend: the Ray head's (GCS) port.")
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
        description="ray backend: more `ray start` arguments on every node, e.g. --num-cpus=8",
    )

    @field_validator("extra_args")
    @classmethod
    def _one_word_each(cls, args: list[str]) -> list[str]:
        check_arguments(args, "ray start")
        return args


class FabricConfig(Section):
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


class MemoryConfig(Section):
    drop_page_cache: bool | None = Field(
        None,
        description="Drop the page cache on each node right before the launch (through a "
        "one-shot container). vLLM on unified memory (GB10) counts cached pages as used and "
        "refuses to start. Default: on for unified-memory nodes.",
    )


class CacheConfig(Section):
    enabled: bool = Field(
        True,
        description="Keep what vLLM builds at start (torch.compile's graphs, Inductor, Triton, "
        "FlashInfer and CUDA kernels) in a directory on each node, mounted into every container "
        "of the group, so a later start loads it instead of compiling again. false: every start "
        "compiles from nothing (as a container without mounts does).",
    )
    dir: ModelPath | None = Field(
        None,
        description="That directory on every node (created by Docker, as root, when missing); "
        "default /var/cache/vllm-redeploy/<cluster name>. Put it on a fast local disk; it grows "
        "to a few GB per model and build, and nothing removes it.",
    )
