"""What every value of a job must be, whichever field holds it:

  - a float is finite: NaN and +/-inf are refused in every float of the job (every field of every
    node, the mixture's sources, the free-form `kwargs` a `_target_` gets), since NaN passes every
    `x < 0` check and inf turns a limit into none. A field where +inf means something says what
    (`doc(..., inf="no limit")`, which its --help line shows) and takes +inf; NaN no field takes.
  - an override's value converts to its field's type. OmegaConf converts it (as Hydra will), on
    the schema's defaults, so `training.steps=ten` is refused in one line naming the field, the
    value and the type before Hydra composes anything.

Each message reads `field = value: what is wrong; how to fix it`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import math
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf, ValidationError
from omegaconf.errors import OmegaConfBaseException

from titan_exp.config.fields import problem
from titan_exp.config.schema import JobConfig

_NO_DEFAULT = object()


def _shown(value: Any) -> str:
    """A value as an override spells it: true, null, [a,b], 0.0008."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else _NO_DEFAULT


def _nonfinite(where: str, value: float, field: dataclasses.Field | None) -> str | None:
    """The problem with a float that is NaN or +/-inf, None when its field takes it (+inf, `inf`)."""
    inf = field.metadata.get("inf") if field is not None else None
    if value == math.inf and inf is not None:
        return None
    wrong = "not a number" if math.isnan(value) else "must be finite"
    fix = "give a finite number" + (f" or inf ({inf})" if inf else "")
    default = _default(field) if field is not None else _NO_DEFAULT
    if isinstance(default, float):
        fix += f", e.g. {where}={_shown(default)} (the default)"
    elif default is None:
        fix += " or null (the default)"
    elif default is _NO_DEFAULT and ".kwargs." in where:
        fix += " (a _target_ gets its kwargs as they are)"
    return problem(where, value, f"{wrong}; {fix}")


def nonfinite_errors(node: Any, where: str = "", field: dataclasses.Field | None = None) -> list[str]:
    """Every float in `node` (a JobConfig, any node of one, or what `field` holds) that is NaN or
    +/-inf where its field does not take it. `where` names `node` as the user types it."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [e for f in dataclasses.fields(node)
                for e in nonfinite_errors(getattr(node, f.name), f"{where}.{f.name}" if where else f.name, f)]
    if isinstance(node, dict):  # free-form (kwargs): no field says what its entries take
        return [e for k, v in node.items() for e in nonfinite_errors(v, f"{where}.{k}")]
    if isinstance(node, (list, tuple)):
        return [e for i, v in enumerate(node) for e in nonfinite_errors(v, f"{where}[{i}]", field)]
    if isinstance(node, float) and not math.isfinite(node):
        return [p] if (p := _nonfinite(where, node, field)) else []
    return []


@functools.cache
def _schema() -> DictConfig:
    return OmegaConf.structured(JobConfig)


@functools.cache
def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _expected(hint: Any) -> str:
    """What a type hint asks for, in words: 'an integer (int)', 'a number (float) or null', ..."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint) or hint
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        words = "one of " + ", ".join(str(m.value) for m in origin)
    elif dataclasses.is_dataclass(origin):
        words = f"a mapping of {origin.__name__}'s fields"
    else:
        words = {int: "an integer (int)", float: "a number (float)", bool: "true or false (bool)",
                 str: "a string (str)", list: "a list ([a,b])", dict: "a mapping ({k: v})"}.get(
            origin, str(hint))
    return words + (" or null" if optional else "")


def _type_problem(key: str, value: Any, exc: ValidationError) -> str:
    """One line for a value OmegaConf would not convert to its field's type."""
    holder, name = exc.object_type, exc.key
    default = _NO_DEFAULT
    if dataclasses.is_dataclass(holder) and name in _hints(holder):
        hint = _hints(holder)[name]
        default = _default(next(f for f in dataclasses.fields(holder) if f.name == name))
    else:  # an item of a typed list or dict: its element type
        hint = (typing.get_args(exc.ref_type) or (Any,))[-1]
    full = str(exc.full_key or key)
    field = full if full.split(".")[0] == key.split(".")[0] else f"{key} ({full})"
    shown = exc.value if getattr(exc, "value", None) is not None else value
    plain = isinstance(default, (int, float, str)) and not isinstance(default, enum.Enum)
    shows = field == key and (plain or bool(default) and isinstance(default, list))
    example = f", e.g. {field}={_shown(default)}" if shows else ""
    return problem(field, shown, f"must be {_expected(hint)}{example}")


def override_errors(key: str, value: Any) -> list[str]:
    """What is wrong with the value of the override `key=value` (a key the schema has): its type,
    converted by OmegaConf as Hydra will convert it, and the finite rule for its floats. Checked
    on the schema's defaults: what a key that does not exist there means is Hydra's to say."""
    cfg = copy.deepcopy(_schema())
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=True)
    except ValidationError as exc:
        return [_type_problem(key, value, exc)]
    except OmegaConfBaseException:
        return []
    top = key.split(".")[0]
    try:  # the node as the job will hold it (interpolations resolved where they can be here)
        node = OmegaConf.to_object(cfg[top]) if OmegaConf.is_config(cfg[top]) else cfg[top]
    except OmegaConfBaseException:
        return []
    return nonfinite_errors(node, top, next(f for f in dataclasses.fields(JobConfig) if f.name == top))
