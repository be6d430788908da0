"""The TOML file's numbers and booleans must be written as such: ``gpus = "1"``,
``port = "30000"`` or ``disable_units = "no"`` are refused, where pydantic would quietly turn them
into 1, 30000 and false.

Environment variables and env files can only hold strings, and pydantic-settings parses them;
so strictness applies to the TOML data alone: it is validated once more, strictly (pydantic's
strict mode), before the merged sources are, and only the type errors of that pass are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from vllm_redeploy.config.cluster import ClusterConfig
from vllm_redeploy.config.errors import data_path
from vllm_redeploy.config.toml_text import toml_value

# The strict errors that mean "this value has the wrong type", and what the key needs.
_NEEDS: dict[str, tuple[type, str]] = {
    "int_type": (int, "a whole number"),
    "float_type": (float, "a number"),
    "bool_type": (bool, "true or false"),
}


@dataclass(frozen=True)
class TypeMistake:
    """A TOML value of the wrong type, where pydantic alone would coerce it."""

    loc: tuple[str | int, ...]
    needs: str
    value: Any
    fix: Any | None  # what the value means, written as it should be; None when unclear

    def explain(self, key: str, showable: bool) -> str:
        """``key`` is the dotted key; ``showable``: the value may be echoed (not a secret)."""
        name = next((str(p) for p in reversed(self.loc) if isinstance(p, str)), key)
        text = f"{key}: {self.needs} is needed, not {_described(self.value, showable)}"
        if self.fix is not None and showable:
            text += f": write {name} = {toml_value(self.fix)}"
        return text


def toml_type_mistakes(data: dict[str, Any]) -> list[TypeMistake]:
    """Each number or boolean of the TOML data that is written as another type."""
    mistakes: list[TypeMistake] = []
    for name, value in data.items():
        if name not in ClusterConfig.model_fields:
            continue  # reported as an unknown key by the full validation
        try:
            _strict_adapter(name).validate_python(value, strict=True)
        except ValidationError as exc:
            mistakes += [_mistake(name, e) for e in exc.errors() if _is_type_mistake(e)]
    return mistakes


@cache
def _strict_adapter(field: str) -> TypeAdapter[Any]:
    return TypeAdapter(ClusterConfig.model_fields[field].annotation)


def _is_type_mistake(error: Any) -> bool:
    """A string for a number or boolean, a boolean for a number, or a number for a boolean:
    not the other strict errors (a path or an address written as a string is right)."""
    kind, value = error["type"], error["input"]
    if kind not in _NEEDS:
        return False
    if isinstance(value, str):
        return True
    if kind == "bool_type":
        return isinstance(value, int | float)
    return isinstance(value, bool)


def _mistake(field: str, error: Any) -> TypeMistake:
    wanted, needs = _NEEDS[error["type"]]
    value = error["input"]
    loc = (field, *data_path(error))
    return TypeMistake(loc, needs, value, _meant(wanted, value))


def _meant(wanted: type, value: Any) -> Any | None:
    """What pydantic would have made of ``value``, when that is surely what was meant."""
    if isinstance(value, bool):
        return None  # `gpus = true` means no number
    try:
        return TypeAdapter(wanted).validate_python(value)
    except ValidationError:
        return None


def _described(value: Any, showable: bool) -> str:
    if isinstance(value, str):
        return f"the string {toml_value(value)}" if showable else "a string"
    return toml_value(value) if showable else f"a {type(value).__name__}"
