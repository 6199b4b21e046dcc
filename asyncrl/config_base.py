"""The one mechanism behind every config class.

A config is a frozen pydantic dataclass: each field is ``Annotated[type, Field(<check>, description=...)]``,
so its check, its error and its documentation are one declaration. Rules that involve several fields are
``model_validator(mode="after")`` methods calling ``require``. Whatever fails, construction raises
``ConfigError`` naming ``Class.field`` (pydantic's ``ValidationError`` is translated once, here). Positional
and keyword construction, ``dataclasses.replace`` (which validates again) and ``dataclasses.fields`` work as
for any dataclass. Nothing here reads the disk or the environment: a config only holds values.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from typing import Annotated, Any, TypeVar, dataclass_transform

import pydantic
from pydantic import BeforeValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as _pydantic_dataclass

from asyncrl.errors import ConfigError

__all__ = ["Flag", "NonNegativeFloat", "NonNegativeInt", "PathStr", "PositiveFloat", "PositiveInt", "Seconds", "config",
           "config_classes", "describe", "require"]

# Numbers are strict: ``True`` is not 1 and ``2.0`` is not an integer count; floats accept ints.
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
PositiveFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
Seconds = PositiveFloat  # a finite duration > 0
Flag = Annotated[bool, Field(strict=True)]
# A filesystem path kept as a string (a ``Path`` is accepted); only its form is checked, never the disk.
PathStr = Annotated[str, BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v),
                    Field(min_length=1)]

_SETTINGS = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
_CLASSES: list[type] = []  # every config class, for the test that checks each field is documented
C = TypeVar("C", bound=type)


@dataclass_transform(frozen_default=True, field_specifiers=(Field, dataclasses.field))
def config(cls: C) -> C:
    """Make ``cls`` a validated, frozen, slotted config dataclass whose errors are ``ConfigError``."""
    made: Any = _pydantic_dataclass(cls, frozen=True, slots=True, config=_SETTINGS)
    validate = made.__init__

    @functools.wraps(validate)
    def __init__(self: object, *args: Any, **kwargs: Any) -> None:
        try:
            validate(self, *args, **kwargs)
        except pydantic.ValidationError as exc:
            raise _config_error(made, exc) from None

    made.__init__ = __init__
    _CLASSES.append(made)
    return made  # type: ignore[no-any-return]


def _config_error(cls: type, exc: pydantic.ValidationError) -> ConfigError:
    error = exc.errors(include_url=False)[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # raised by ``require`` in a validator: it names its field already
        return cause
    loc = list(error["loc"])
    if loc and isinstance(loc[0], int):  # a positional argument: name its field
        names = [f.name for f in dataclasses.fields(cls)]
        loc[0] = names[loc[0]] if loc[0] < len(names) else f"argument {loc[0]}"
    where = ".".join(str(part) for part in loc)
    name = f"{cls.__name__}.{where}" if where else cls.__name__
    message = str(cause) if cause is not None else error["msg"]
    if error["type"] == "unexpected_keyword_argument":
        return ConfigError(name, f"is not a {cls.__name__} field")
    if "input" in error and not error["type"].startswith("value_error") and error["type"] != "missing":
        message += f", got {error['input']!r}"
    return ConfigError(name, message)


def require(ok: bool, owner: object, name: str, message: str) -> None:
    """A cross-field rule in a validator: unless ``ok``, ``ConfigError`` naming ``<owner's class>.name``."""
    if not ok:
        raise ConfigError(f"{type(owner).__name__}.{name}", message)


def config_classes() -> tuple[type, ...]:
    """Every class made with ``config`` so far (in import order)."""
    return tuple(_CLASSES)


def describe(obj: object) -> dict[str, object]:
    """A JSON-friendly dict of a config tree, for logs and result files."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[f.name] = describe(value)
        elif isinstance(value, enum.Enum):
            out[f.name] = value.value
        else:
            out[f.name] = value
    return out
