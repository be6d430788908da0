"""Where each value of a cluster's configuration came from, for messages that name it: the
environment variable, the env file (the cluster's own, or `.env`), or the TOML file and line.

pydantic-settings merges the sources (environment, then the env files, the later file first,
then the TOML file; the first that sets a key wins, tables merged key by key) and forgets which
gave what. :class:`Sources` asks them again in the same order. It also refuses ``VLLM_REDEPLOY_``
names that set nothing (``VLLM_REDEPLOY_VLMM__PORT``), which pydantic-settings would ignore.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, get_origin

from dotenv import dotenv_values
from pydantic import BaseModel

from vllm_redeploy.config.cluster import ClusterConfig
from vllm_redeploy.config.fields import ENV_PREFIX, OWN_VARIABLES
from vllm_redeploy.config.toml_lines import MISSING, key_line, value_at
from vllm_redeploy.safe_text import shown

KeyPath = tuple[str | int, ...]
NESTING = "__"
ENVIRONMENT = "the environment"


@dataclass(frozen=True)
class EnvSetting:
    """One ``VLLM_REDEPLOY_`` variable, from the environment or an env file."""

    name: str
    value: str
    origin: str  # ENVIRONMENT, or the env file's path

    @property
    def path(self) -> tuple[str, ...]:
        """The key it sets, as pydantic-settings reads the name: ``("vllm", "port")``."""
        return tuple(self.name[len(ENV_PREFIX) :].lower().split(NESTING))

    def describe(self) -> str:
        """The variable and where it is set, for "(from ...)"."""
        if self.origin == ENVIRONMENT:
            return f"environment variable {shown(self.name)}"
        return f"{shown(self.name)} in {shown(self.origin)}"

    def where(self) -> str:
        return "in the environment" if self.origin == ENVIRONMENT else f"in {shown(self.origin)}"

    def sets(self, path: KeyPath) -> bool:
        """Whether this variable gives the value at ``path``: it names that key or one inside
        it, or a table or list above it whose JSON value holds the key."""
        own = self.path
        if own[: len(path)] == path:
            return True
        if path[: len(own)] != own:
            return False
        return _holds(_json(self.value), path[len(own) :])


@dataclass(frozen=True)
class Sources:
    """A cluster's sources: its TOML file (path, text and data) and the env files it reads
    (in the order pydantic-settings reads them: a later one wins)."""

    toml_path: Path
    toml_text: str
    toml_data: dict[str, Any]
    env_files: tuple[Path, ...]

    def settings(self) -> list[EnvSetting]:
        """Every ``VLLM_REDEPLOY_`` variable with a value, the one that wins first."""
        return list(self._settings)

    @cached_property
    def _settings(self) -> tuple[EnvSetting, ...]:
        found = _environment_settings()
        for env_file in reversed(self.env_files):
            found += _file_settings(env_file)
        return tuple(found)

    def origin_of(self, path: KeyPath) -> str | None:
        """Where the value at ``path`` came from, in words; None when no source set it."""
        if not path:
            return None
        setting = next((s for s in self.settings() if s.sets(path)), None)
        if setting is not None:
            return setting.describe()
        return self.toml_origin(path)

    def toml_origin(self, path: KeyPath) -> str | None:
        """The TOML file, and the line where it can tell, when the file sets ``path``."""
        if not path or not _holds(self.toml_data, path):
            return None
        line = key_line(self.toml_text, self.toml_data, path)
        where = shown(str(self.toml_path))
        return f"{where}, line {line}" if line is not None else where

    def unknown_variable_problems(self) -> list[str]:
        """One line per ``VLLM_REDEPLOY_`` name that sets no key of the configuration."""
        return [_unknown_variable(s) for s in self.settings() if not _is_known(s)]


def _environment_settings() -> list[EnvSetting]:
    return [
        EnvSetting(name, value, ENVIRONMENT)
        for name, value in os.environ.items()
        if _prefixed(name) and value
    ]


def _file_settings(env_file: Path) -> list[EnvSetting]:
    try:
        if not env_file.is_file():
            return []
        values = dotenv_values(env_file, encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError):
        return []  # pydantic-settings reads the file the same way and reports it
    return [
        EnvSetting(name, value, str(env_file))
        for name, value in values.items()
        if _prefixed(name) and value
    ]


def _prefixed(name: str) -> bool:
    return name.upper().startswith(ENV_PREFIX) and name.upper() not in OWN_VARIABLES


def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None


def _holds(data: Any, path: KeyPath) -> bool:
    return value_at(data, path) is not MISSING


def _is_known(setting: EnvSetting) -> bool:
    """A top-level key, or a key inside a section or list (``VLLM_REDEPLOY_NAME__X`` is not)."""
    first, nested = setting.path[0], len(setting.path) > 1
    field = ClusterConfig.model_fields.get(first)
    return field is not None and (not nested or _holds_keys(field.annotation))


def _holds_keys(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return get_origin(annotation) in (list, dict)


def _unknown_variable(setting: EnvSetting) -> str:
    fix = "unset it" if setting.origin == ENVIRONMENT else "fix or remove that line"
    guess = suggested_name(setting.path)
    hint = f" (did you mean {guess}?)" if guess else ""
    return (
        f"{shown(setting.name)} ({setting.where()}): sets nothing{hint}; a setting's name is "
        f"{ENV_PREFIX} and a top-level key or section ({_known_names()}), then __KEY for a key "
        f"of a section ({ENV_PREFIX}SSH__USER): {fix}"
    )


def suggested_name(path: tuple[str, ...]) -> str | None:
    """The setting a misspelt name probably meant: ``vlmm__port`` -> VLLM_REDEPLOY_VLLM__PORT,
    ``vllm_port`` (one underscore) -> VLLM_REDEPLOY_VLLM__PORT."""
    first, rest = path[0], list(path[1:])
    for section, model in _sections().items():
        key = first.removeprefix(f"{section}_")
        if key != first and key in model.model_fields:
            return _name([section, key, *rest])
    close = difflib.get_close_matches(first, list(ClusterConfig.model_fields), n=1)
    if not close:
        return None
    if not _holds_keys(ClusterConfig.model_fields[close[0]].annotation):
        rest = []  # VLLM_REDEPLOY_NAME__X: the key itself
    model = _sections().get(close[0])
    if rest and model is not None and rest[0] not in model.model_fields:
        keys = difflib.get_close_matches(rest[0], list(model.model_fields), n=1)
        rest[:1] = keys[:1]
    guess = _name([close[0], *rest])
    return guess if guess != _name(path) else None


def _name(parts: Iterable[str]) -> str:
    return ENV_PREFIX + NESTING.join(parts).upper()


def _sections() -> dict[str, type[BaseModel]]:
    """The top-level keys that are tables: ``vllm`` -> VLLMConfig."""
    found: dict[str, type[BaseModel]] = {}
    for name, field in ClusterConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found[name] = annotation
    return found


def _known_names() -> str:
    return ", ".join(name.upper() for name in ClusterConfig.model_fields)
