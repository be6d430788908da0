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

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from vllm_redeploy.config.cluster import ClusterConfig
from vllm_redeploy.config.errors import (
    ConfigError,
    _explain,
    _settings_problem,
    data_path,
    location,
    showable,
)
from vllm_redeploy.config.fields import (
    CONFIG_DIR_VARIABLE,
    CONFIG_VARIABLE,
    DEFAULT_CONFIG,
    ENV_PREFIX,
    INSTALLED_DIR,
)
from vllm_redeploy.config.sources import Sources
from vllm_redeploy.config.strict import TypeMistake, toml_type_mistakes
from vllm_redeploy.safe_text import one_line, shown


def cluster_env_file(path: Path) -> Path:
    """The cluster's own settings and secrets: ``spark-pair.toml`` -> ``spark-pair.env``."""
    return path.with_suffix(".env")


def load_config(
    path: Path | str | None = None, *, env_file: Path | str | None = ".env"
) -> ClusterConfig:
    """Read and validate the configuration, or raise ConfigError naming every problem and
    where its value came from.

    ``env_file``: the shared env file (`.env` in the working directory; None: none); the
    cluster's own (:func:`cluster_env_file`) is always read and wins over it."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    text, data = _read_toml(path)
    # A shared .env in a directory this user may not search (a person's home, for the
    # services' user running a command there) is not this user's: left out, as a missing one.
    shared = [Path(env_file)] if env_file is not None else []
    readable = [f for f in shared if _exists(f) is not None]
    env_files = (*readable, cluster_env_file(path))
    sources = Sources(path, text, data, env_files)
    mistakes = toml_type_mistakes(data)
    problems = sources.unknown_variable_problems()
    problems += [_mistake_problem(m, sources) for m in mistakes]
    config, invalid = _validated(sources, {m.loc for m in mistakes})
    problems += invalid
    if config is None or problems:
        raise ConfigError(str(path), _unique(problems))
    return config


def _validated(
    sources: Sources, typed: set[tuple[str | int, ...]]
) -> tuple[ClusterConfig | None, list[str]]:
    """The merged sources validated: the configuration, or None, and the problems found."""
    try:
        config = ClusterConfig(_env_file=sources.env_files, **sources.toml_data)  # type: ignore[call-arg]
    except ValidationError as exc:
        return None, _validation_problems(exc, sources, typed)
    except SettingsError as exc:  # a list or table from the environment that is not JSON
        return None, [_settings_problem(exc, sources.settings())]
    return config, _file_problems(config)


def _validation_problems(
    exc: ValidationError, sources: Sources, typed: set[tuple[str | int, ...]]
) -> list[str]:
    """A line per error, with where its value came from; none for a value whose wrong type
    the strict pass already named (``port = "abc"``)."""
    problems: list[str] = []
    for error in exc.errors():
        path = data_path(error)
        if path in typed and _is_type_error(error):
            continue
        lines = _explain(error).split("\n")
        origin = None if error["type"] == "missing" else sources.origin_of(path)
        lines[-1] = _with_origin(lines[-1], origin)
        problems += map(one_line, lines)
    return problems


def _is_type_error(error: Any) -> bool:
    kind = str(error["type"])
    return kind.endswith(("_parsing", "_type")) or kind == "int_from_float"


def _mistake_problem(mistake: TypeMistake, sources: Sources) -> str:
    text = mistake.explain(location(mistake.loc), showable(mistake.loc, mistake.value))
    return one_line(_with_origin(text, sources.toml_origin(mistake.loc)))


def _with_origin(line: str, origin: str | None) -> str:
    return f"{line} (from {origin})" if origin else line


def _unique(problems: list[str]) -> list[str]:
    """Each problem once, on one line."""
    return list(dict.fromkeys(map(one_line, problems)))


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


def installed_dir() -> Path:
    """Where the installed clusters' files are (install-controller's /etc/vllm-redeploy)."""
    return Path(os.environ.get(CONFIG_DIR_VARIABLE) or INSTALLED_DIR)


def installed_clusters() -> list[str]:
    """The names of the clusters installed on this machine."""
    try:
        return sorted(p.stem for p in installed_dir().glob("*.toml") if p.is_file())
    except OSError:
        return []


def _exists(path: Path) -> bool | None:
    """Whether ``path`` exists; None when that cannot be told (a directory on the way that this
    user may not search): reading it then says why."""
    try:
        return path.exists()
    except OSError:
        return None


def resolve_config(path: Path) -> Path:
    """What ``--config`` names: a file; else the name of an installed cluster (its
    ``<name>.toml`` there, read with its ``<name>.env``); and, when the default ./cluster.toml is
    not there, the one cluster installed on this machine. A name is looked up there too when
    the working directory cannot be read (a person's home, for the services' user)."""
    if _exists(path):
        return path
    text = str(path)
    if "/" not in text and not text.endswith(".toml"):
        named = installed_dir() / f"{text}.toml"
        if named.is_file():
            return named
    installed = installed_clusters()
    if path == DEFAULT_CONFIG and len(installed) == 1:
        return installed_dir() / f"{installed[0]}.toml"
    return path


def _read_toml(path: Path) -> tuple[str, dict[str, Any]]:
    """The file's text and its data."""
    if _exists(path) is False:
        installed = installed_clusters()
        here = f" (installed here: {', '.join(installed)})" if installed else ""
        raise ConfigError(
            str(path),
            [
                "the configuration file does not exist: pass --config FILE or the name of a "
                f"cluster installed in {installed_dir()}{here} (or set {CONFIG_VARIABLE}), or "
                "write one to start from with `vllm-redeploy init` and describe your nodes"
            ],
        )
    try:
        text = path.read_bytes().decode("utf-8")
        return text, tomllib.loads(text)
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


def environ_overrides() -> dict[str, str]:
    """Environment variables that override the file (names only are meant for display)."""
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
