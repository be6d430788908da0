"""Configuration errors in words: one line per problem, naming the key (and its environment
variable), never echoing a secret. Where the value came from (the file and line, the variable)
is added by ``loading`` from ``sources``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from pydantic_settings import SettingsError

from vllm_redeploy.config.cluster import ClusterConfig
from vllm_redeploy.config.fields import ENV_PREFIX
from vllm_redeploy.config.sources import ENVIRONMENT, EnvSetting
from vllm_redeploy.safe_text import shown


class ConfigError(Exception):
    """The configuration cannot be used; ``problems`` has one readable line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.source = source
        self.problems = problems

    def __reduce__(self):  # type: ignore[override]
        return (ConfigError, (self.source, self.problems))


def _settings_problem(exc: SettingsError, settings: list[EnvSetting]) -> str:
    """The line for an environment (or env file) value that pydantic-settings could not parse,
    naming the variables that set that key."""
    match = re.search(r'field "([^"]+)"', str(exc))
    field = match.group(1) if match else "(top level)"
    in_files = "DotEnvSettingsSource" in str(exc)
    names = [
        s.describe()
        for s in settings
        if s.path[0] == field.lower() and (s.origin != ENVIRONMENT) == in_files
    ]
    where = ", ".join(names) or ("a variable in an env file" if in_files else "the environment")
    return (
        f"{field}: cannot parse the value of {where}; lists and tables "
        "set there must be JSON, e.g. VLLM_REDEPLOY_VLLM__EXTRA_ARGS='[\"--enforce-eager\"]'"
    )


def data_path(error: Any) -> tuple[str | int, ...]:
    """Where the error's value sits in the data (pydantic's own steps left out):
    ``("nodes", 1, "gpus")``. An unknown key keeps its own name, whatever it is."""
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        return tuple(p for p in loc[:-1] if not _is_step(p)) + loc[-1:]
    return tuple(p for p in loc if not _is_step(p))


def _is_step(part: Any) -> bool:
    """A part of a location that names a step of pydantic's validation, not a key."""
    if isinstance(part, int):
        return False
    text = str(part)
    return text.startswith(("function-", "json-or-python", "lax-or-strict")) or (
        "[" in text or text in ("str", "int", "float", "bool", "none")
    )


def location(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not _is_step(part):
            part = shown(part)
            text += f".{part}" if text else part
    return text or "(top level)"


_SECRET_WORDS = ("secret", "token", "passphrase", "password")


def _explain(error: Any) -> str:
    """Readable line(s) for one pydantic error, naming the key and what to do."""
    loc = error["loc"]
    key = location(loc)
    kind = error["type"]
    if kind == "extra_forbidden":  # name the key itself, whatever it is called
        parent, name = location(loc[:-1]), str(loc[-1])
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
    if kind not in ("value_error", "assertion_error") and showable(loc, error.get("input")):
        message += f" (got {error['input']!r})"
    if not loc:  # cluster-wide rules name their keys themselves
        return message
    return f"{key}: {message}"


def showable(loc: tuple[Any, ...], value: Any) -> bool:
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
