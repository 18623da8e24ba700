"""Building a spec dataclass from the mapping a user wrote: spec_field (what the builder reads of a
field), in_range (a number field's check), coerce (a value to its field's type, as YAML 1.1 reads
what users write) and build_spec. Generic: the run spec's classes (schema.py), a sweep's and a
comparison's are all read here, so a mistake is one SpecError naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field

from harness.errors import SpecError, shown


def spec_field(
    default=dataclasses.MISSING, *, factory=dataclasses.MISSING, check=None, required=None, choices=None, applies=None
):
    """A field of a spec the builder reads (build_spec): `check(value, name)` reads the given value in place
    of its type (refusing in its own words), `required` is why a missing one is refused, `choices` are
    the values it takes, `applies` = (other field, its value) where the field means something (a token
    file's path with kind: file), refused when given otherwise. A spec class with `NULL_IS_DEFAULT = True`
    reads `key:` (no value) as not given."""
    metadata = {
        k: v
        for k, v in (("check", check), ("required", required), ("choices", choices), ("applies", applies))
        if v is not None
    }
    return field(default=default, default_factory=factory, metadata=metadata)


def in_range(tp, low=None, high=None, *, above=False, says=None, why=""):
    """A spec_field check: a number of type `tp` read as users write it (_number: finite, an int whole),
    `low` or more (more than `low` with above=True) and `high` or less. `says` replaces the words for
    the range; `why` follows them."""

    def check(value, name):
        number = coerce(value, tp, name)
        if low is not None and (number <= low if above else number < low):
            words = (
                "be positive"
                if (low == 0 and above) or (low == 1 and tp is int)
                else "not be negative"
                if low == 0
                else f"be at least {low}"
            )
        elif high is not None and number > high:
            words = f"be at most {high:,}"
        else:
            return number
        raise SpecError(name, f"must {'be ' + says if says else words}{why}, got {shown(value)}")

    return check


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", dict: "mappings"}


def coerce(value, tp, name: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # `X | None`
        return (
            None if value is None else coerce(value, next(a for a in typing.get_args(tp) if a is not type(None)), name)
        )
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SpecError(name, "must be a mapping")
        return build_spec(tp, value, name)
    if tp is list or origin is list:  # elements checked by type, not converted
        item = (typing.get_args(tp) or (object,))[0]
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise SpecError(name, "must be a list" + (f" of {_PLURALS[item]}" if item in _PLURALS else ""))
        return value
    if origin is dict:
        tp = dict
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise SpecError(name, f"must be a list of {len(args)} numbers")
        return tuple(coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if tp in (int, float) and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return _number(value, tp, name)
    if tp in (int, float) and isinstance(value, bool):
        raise SpecError(name, f"must be {_TYPE_NAMES[tp]}, got {value!r}")
    if not isinstance(value, tp):
        raise SpecError(name, f"must be {_TYPE_NAMES.get(tp, tp.__name__)}, got {shown(value)}")
    return value


def _number(value, tp, name: str):
    """An int or float field's value: a number, or a numeric string, as YAML 1.1 reads what users
    write (`lr: 1e-4` and `seq_len: 1e12` are strings to it); an int must be whole, every number finite."""
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise SpecError(name, f"must be {_TYPE_NAMES[tp]}, got {shown(value)}") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise SpecError(name, f"must be a finite number, got {shown(value)}")
    if tp is int and not float(number).is_integer():
        raise SpecError(name, f"must be {_TYPE_NAMES[tp]}, got {shown(value)}")
    return int(number) if tp is int else float(number)


def build_spec(cls, raw: dict, prefix: str):
    """A spec dataclass from its mapping: every key known, every value of its field's type (or
    through its spec_field check), every required field given; a SpecError names the field."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in known:
            raise SpecError(f"{prefix}.{key}" if prefix else str(key), f"unknown key; allowed: {', '.join(known)}")
    given = {k: v for k, v in raw.items() if not (v is None and getattr(cls, "NULL_IS_DEFAULT", False))}
    for key, f in known.items():
        if key not in given and "required" in f.metadata:
            raise SpecError(f"{prefix}.{key}" if prefix else key, f.metadata["required"])
    values = {}
    for key, value in given.items():
        name = f"{prefix}.{key}" if prefix else key
        check = known[key].metadata.get("check")
        value = check(value, name) if check else coerce(value, hints[key], name)
        choices = known[key].metadata.get("choices")
        if choices and value not in choices:
            raise SpecError(name, f"{shown(value)} is not one of {', '.join(map(str, choices))}")
        values[key] = value
    for key in values:  # a field that means something only beside another's value is not ignored
        other, wanted = known[key].metadata.get("applies", (None, None))
        have = values.get(other, known[other].default) if other else wanted
        if have != wanted and values[key] != known[key].default:  # (to_dict() writes the defaults back)
            raise SpecError(
                f"{prefix}.{key}" if prefix else key,
                f"applies only with {other}: {wanted}, and {other} is {have}"
                + ("" if other in values else " (the default)")
                + f": set {other}: {wanted}",
            )
    return cls(**values)
