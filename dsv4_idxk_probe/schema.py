"""A YAML document into msgspec Structs, refusals in the operator's words.

The probe's config sections are msgspec Structs: ``forbid_unknown_fields``, bounds in
``msgspec.Meta(ge=..., le=...)``, choices as ``Literal``. `convert` runs
``msgspec.convert`` on what `safeyaml.load` built; msgspec's refusal
(``Expected `int` >= 1 - at `$.exchange.timeout_ms```) is rewritten to name the file,
the line of the value (when the YAML node is given), the field as the operator wrote it,
what it must be and the rejected value cut short (`safeyaml.shorten`)::

    probe.yaml:3: exchange.timeout_ms must be an integer >= 1, got 'fast'

The words come from the field's type (bool, Literal, int and float bounds, string
lengths, lists); a field may say it in its own words (``Meta(extra={"means": ...})``) or
name a kind (``"kind": "port"``, ``"items": "backends"``), and a Struct's
``__post_init__`` refuses what a type cannot say by raising `Invalid`. Every float field
is a number of seconds. Bounds are compared by msgspec, never converted: ``10**400``
costs nothing.

This module imports nothing of the package but `safeyaml`: it sits at the bottom.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec
import msgspec.inspect as mi

from .safeyaml import shorten

#: A string without NUL (a path or a name the probe hands to the OS or prints).
NO_NUL = "^[^\x00]*$"

_KEY_AT = re.compile(r" - at `key` in `\$([^`]*)`$")
_VALUE_AT = re.compile(r" - at `\$([^`]*)`$")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


class Invalid(ValueError):
    """Raised by a Struct's ``__post_init__``: `field` must be `means`."""

    def __init__(self, field: str, means: str):
        super().__init__(f"{field} must be {means}")
        self.field, self.means = field, means


def integer(low: int, high: int, **extra: str) -> Any:
    """An int in [low, high]."""
    return Annotated[int, msgspec.Meta(ge=low, le=high, extra=extra or None)]


def seconds(high: float, *, low: float | None = None) -> Any:
    """A finite number of seconds in (0, high], or [low, high] when `low` is given."""
    bounds = {"gt": 0} if low is None else {"ge": low}
    return Annotated[float, msgspec.Meta(le=high, **bounds)]


def milliseconds(high: float, *, low: float = 0.0) -> Any:
    """A finite number of milliseconds in [low, high] (its refusal says milliseconds)."""
    return Annotated[float, msgspec.Meta(ge=low, le=high, extra={"unit": "milliseconds"})]


def text(max_chars: int = 4096) -> Any:
    """A string of at most `max_chars` characters, without NUL."""
    return Annotated[str, msgspec.Meta(max_length=max_chars, pattern=NO_NUL)]


def convert(document: Any, cls: type, error: type[Exception], *, source: str | None = None, node: Any = None,
            prefix: tuple[str, ...] = ()) -> Any:
    """``msgspec.convert(document, cls)``, or `error` with `explain`'s message."""
    try:
        return msgspec.convert(document, cls)
    except msgspec.ValidationError as exc:
        try:
            message = explain(exc, document, cls, source=source, node=node, prefix=prefix)
        except Exception:  # a wording this module lacks must not become a traceback: msgspec's own
            message = _head(source, None) + shorten(str(exc), 300)
        raise error(message) from None


def explain(exc: msgspec.ValidationError, document: Any, cls: type, *, source: str | None = None,
            node: Any = None, prefix: tuple[str, ...] = ()) -> str:
    """One line: ``source:line: field must be ..., got value`` (the line when `node`, the
    document's YAML root node, is given; `prefix` is where `document` sits in a bigger one)."""
    message = str(exc)
    key_error = _KEY_AT.search(message)
    found = key_error or _VALUE_AT.search(message)
    path = [int(i) if i else name for name, i in _STEP.findall(found.group(1))] if found else []
    t, value, at, names, extra = mi.type_info(cls), document, node, list(prefix), {}
    line, declared = None, cls
    for step in path:
        t, extra = _bare(t)
        if "means" in extra:  # the field speaks for its whole value
            key_error = None
            break
        if isinstance(t, mi.StructType):
            declared = next((f.type for f in msgspec.structs.fields(t.cls) if f.encode_name == step), None)
        t, value, at = _step(t, value, at, step)
        names.append(step)
    else:
        t, extra = _bare(t)
    cause = exc.__cause__
    if isinstance(cause, Invalid):
        _, value, at = _step(t, value, at, cause.field)
        names.append(cause.field)
        phrase, got = f"must be {cause.means}", shorten(value)
    elif key_error and isinstance(value, Mapping):
        odd = next((k for k in value if not isinstance(k, str)), None)
        line = _key_line(at, odd)
        phrase, got = "keys must be strings", shorten(odd)
    elif message.startswith("Object contains unknown field") and isinstance(value, Mapping) \
            and isinstance(t, mi.StructType):
        known = sorted(f.encode_name for f in t.fields)
        unknown = [k for k in value if k not in known]
        line = _key_line(at, unknown[0] if unknown else None)
        where = f"{_where(names)} has unknown key(s)" if names else "unknown key(s)"
        return _head(source, line) + f"{where} {shorten(sorted(unknown, key=str), 200)}; known: {known}"
    else:
        reason = message[: found.start()] if found else message
        phrase, got = _phrase(t, extra, value, reason, top=not names, declared=declared)
    if line is None and names and at is not None:
        line = _line(at)
    return _head(source, line) + f"{_where(names) or 'the top level'} {phrase}, got {got}"


# %% the walk


def _bare(t: Any) -> tuple[Any, dict]:
    """`t` without its Meta wrappers and an Optional's None, with the wrappers' `extra`."""
    extra: dict = {}
    while True:
        if isinstance(t, mi.Metadata):
            extra = {**(t.extra or {}), **extra}
            t = t.type
        elif isinstance(t, mi.UnionType) and any(isinstance(m, mi.NoneType) for m in t.types):
            rest = [m for m in t.types if not isinstance(m, mi.NoneType)]
            if len(rest) != 1:
                return t, extra
            t = rest[0]
        else:
            return t, extra


def _step(t: Any, value: Any, at: Any, step: str | int) -> tuple[Any, Any, Any]:
    """One step down the type, the value and the YAML node."""
    if isinstance(t, mi.StructType) and isinstance(step, str):
        t = next((f.type for f in t.fields if f.encode_name == step), mi.AnyType())
    elif isinstance(step, int) and hasattr(t, "item_type"):
        t = t.item_type
    else:
        t = mi.AnyType()
    if isinstance(value, Mapping):
        value = value.get(step)
    elif isinstance(value, (list, tuple)) and isinstance(step, int) and step < len(value):
        value = value[step]
    else:
        value = None
    return t, value, _child(at, step)


def _child(node: Any, step: str | int) -> Any:
    if node is None:
        return None
    items = getattr(node, "value", None)
    if not isinstance(items, list):
        return None
    if isinstance(step, int):
        return items[step] if step < len(items) and not isinstance(items[step], tuple) else None
    for pair in items:
        if isinstance(pair, tuple) and getattr(pair[0], "value", None) == step:
            return pair[1]
    return None


def _key_line(node: Any, key: Any) -> int | None:
    """The line of `key` in the mapping `node` (the mapping's own when not found)."""
    for pair in getattr(node, "value", None) or ():
        if isinstance(pair, tuple) and getattr(pair[0], "value", None) == str(key):
            return _line(pair[0])
    return _line(node) if node is not None else None


def _line(node: Any) -> int | None:
    mark = getattr(node, "start_mark", None)
    return None if mark is None else mark.line + 1


def _head(source: str | None, line: int | None) -> str:
    if source is None:
        return ""
    return f"{source}:{line}: " if line else f"{source}: "


def _where(names: list) -> str:
    out = ""
    for name in names:
        out += f"[{name}]" if isinstance(name, int) else (f".{name}" if out else name)
    return out


# %% the words


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _literal(declared: Any) -> tuple | None:
    """The values of the Literal in a declared type, in the order written (msgspec sorts them)."""
    if get_origin(declared) is Literal:
        return get_args(declared)
    for arg in get_args(declared):
        found = _literal(arg)
        if found:
            return found
    return None


def _phrase(t: Any, extra: dict, value: Any, reason: str, top: bool, declared: Any = None) -> tuple[str, str]:
    """(what the value must be, the value as shown) for a refusal at a field of type `t`
    (`declared`: the field's annotation as written)."""
    got = shorten(value)
    if "means" in extra:
        return f"must be {extra['means']}", got
    if isinstance(t, mi.BoolType):
        return "must be true or false", got
    if isinstance(t, mi.LiteralType):
        return f"must be one of {list(_literal(declared) or t.values)}", got
    if isinstance(t, mi.IntType):
        low = t.ge if t.ge is not None else (None if t.gt is None else t.gt + 1)
        if not _is_int(value) or (low is not None and value < low):
            return f"must be an integer >= {low}", got
        if extra.get("kind") == "port":
            return f"must be a port number ({low}-{t.le})", got
        return f"must be an integer <= {t.le:_}", f"{value:_}" if value.bit_length() <= 256 else got
    if isinstance(t, mi.FloatType):
        above_zero = t.gt is not None or (t.ge or 0) > 0
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not (value > 0 if above_zero else value >= 0):
            return f"must be a number {'>' if above_zero else '>='} 0", got
        unit = extra.get("unit", "seconds")
        if t.ge is not None and t.ge > 0:
            return f"must be a number of {unit} in [{t.ge:g}, {t.le:g}]", got
        return f"must be a number of {unit} <= {t.le:g}", got
    if isinstance(t, mi.StrType):
        if t.min_length:
            return f"must be a string of {t.min_length}-{t.max_length} characters", got
        if not isinstance(value, str):
            return "must be a string", got
        return f"must be a string of at most {t.max_length} characters{' without NUL' if t.pattern else ''}", got
    if isinstance(t, (mi.VarTupleType, mi.ListType)):
        if isinstance(value, (list, tuple)) and t.max_length is not None and len(value) > t.max_length:
            return f"must list at most {t.max_length} {extra.get('items', 'items')}", f"{len(value):,}"
        return "must be a non-empty list" if t.min_length else "must be a list", got
    if isinstance(t, (mi.StructType, mi.DictType)):
        return ("must be a mapping of keys" if top else "must be a mapping"), type(value).__name__
    return f"is not valid ({reason})", got
