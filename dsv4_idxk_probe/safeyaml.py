"""The one YAML loader for what an operator hands the probe: the probe config,
target tables and fault specs.

`yaml.safe_load` builds no arbitrary objects, but it follows aliases: a
~470-byte "billion laughs" document (nine anchors, each a list of nine
aliases of the one before) loads in microseconds as a graph of 9**9 shared
strings, and the first walk over it (a type check, a ``repr`` in an error
message) then takes a minute and GiBs. None of the probe's files needs an
anchor, so `load` refuses every anchor and alias, and bounds the document
before anything is built:

* the text: at most `MAX_CHARS` characters (callers read files through
  `boundedfile`, which caps the bytes before reading);
* the events, read first without recursion (libyaml's parser when present):
  no anchor or alias, at most `max_nodes` nodes (scalars, lists and mappings,
  keys included), nested at most `max_depth` deep;
* while it is built: a key given twice in one mapping (YAML calls that an
  error; PyYAML keeps the last one silently) and a number scalar longer than
  `MAX_NUMBER_CHARS` characters (``int("1" * 5000)`` raises, a long
  sexagesimal integer costs quadratic time) are refused.

Every refusal is raised as the caller's error type, naming the source and the
line. `shorten` renders any value for a message in at most ~80 characters
without building its whole ``repr`` (a huge integer is never converted).

This module imports nothing of the package: it sits at the bottom, next to
`boundedfile`.
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml

MAX_CHARS = 1 << 20  # the probe's YAML files are a few KiB; boundedfile caps files at 1 MiB too
MAX_NODES = 10_000  # a probe config has ~100 nodes, the shipped target table ~1,000
MAX_DEPTH = 32  # the deepest shipped file nests 5 levels
MAX_NUMBER_CHARS = 100  # an int or float scalar longer than this is out of every range the probe has
SHORT = 80  # characters of a rejected value shown in a message

_Base = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader
_MERGE = "tag:yaml.org,2002:merge"


# %% messages


class _ShortRepr(reprlib.Repr):
    """reprlib with small limits, and integers shown without converting them whole."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 3, 6, 6, 6
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 6
        self.maxstring = self.maxlong = self.maxother = limit

    def repr_int(self, x, level):
        if x.bit_length() > 4 * self.maxlong:  # repr would be long, and past ~4300 digits it raises
            return f"<an integer of about {int(x.bit_length() * 0.30103) + 1:,} digits>"
        return super().repr_int(x, level)


def shorten(value: Any, limit: int = SHORT) -> str:
    """``repr(value)`` cut to `limit` characters with an ellipsis; bounded work
    whatever the value (nested, shared, a huge integer or string)."""
    try:
        text = _ShortRepr(limit).repr(value)
    except Exception:  # a repr that raises must not turn a refusal into a crash
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: max(limit - 3, 1)] + "..."


# %% loading


class _Refused(Exception):
    """Raised inside the loader; `load` turns it into the caller's error type."""

    def __init__(self, line: int | None, message: str):
        super().__init__(message)
        self.line, self.message = line, message


def _line(node_or_event: Any) -> int | None:
    mark = getattr(node_or_event, "start_mark", None)
    return None if mark is None else mark.line + 1


class Loader(_Base):
    """SafeLoader (libyaml's when present) that refuses duplicate keys and overlong
    numbers; subclass it to add to the mappings it builds (`construct_mapping`)."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (_Refused, yaml.YAMLError, RecursionError, MemoryError):
            raise
        except (ValueError, OverflowError, TypeError) as exc:  # a scalar PyYAML cannot convert ("2001-13-45")
            raise _Refused(_line(node), f"cannot read {shorten(getattr(node, 'value', ''))}: {exc}") from None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: the base class names it
                    continue
                if first is not None:
                    raise _Refused(_line(key_node), f"key {shorten(key)} is given twice in one mapping "
                                                    f"(first at line {first})")
                seen[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)

    def _number(self, node, construct):
        if len(node.value) > MAX_NUMBER_CHARS:
            raise _Refused(_line(node), f"a number of {len(node.value):,} characters is out of range "
                                        f"(at most {MAX_NUMBER_CHARS})")
        return construct(self, node)

    def construct_yaml_int(self, node):
        return self._number(node, yaml.constructor.SafeConstructor.construct_yaml_int)

    def construct_yaml_float(self, node):
        return self._number(node, yaml.constructor.SafeConstructor.construct_yaml_float)


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
Loader.add_constructor("tag:yaml.org,2002:float", Loader.construct_yaml_float)


def _scan(text: str, loader: type, max_nodes: int, max_depth: int) -> None:
    """Walk the event stream (no recursion, nothing built): refuse anchors,
    aliases, too many nodes, too deep a nesting."""
    nodes = depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise _Refused(_line(event), f"YAML anchors and aliases are not accepted ({mark}{str(event.anchor)[:40]}): "
                                         "write the value out")
        if isinstance(event, (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            nodes += 1
            if nodes > max_nodes:
                raise _Refused(_line(event), f"the document has more than {max_nodes:,} nodes (keys, values, "
                                             "lists and mappings)")
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > max_depth:
                raise _Refused(None, f"not valid YAML: nested too deeply (over {max_depth} levels, "
                                     f"line {_line(event)})")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


def load(text: str, source: str, error: type[Exception], *, max_nodes: int = MAX_NODES,
         max_depth: int = MAX_DEPTH, loader: type = Loader, with_root: bool = False) -> Any:
    """The document in `text` (None when empty), or `error` naming `source` and the line.

    `with_root`: return ``(document, root node)`` for callers that point at lines
    themselves (the node is None for an empty document).
    """
    if len(text) > MAX_CHARS:
        raise error(f"{source}: YAML text of {len(text):,} characters is over the {MAX_CHARS:,}-character limit")
    try:
        _scan(text, loader, max_nodes, max_depth)
        instance = loader(text)
        try:
            root = instance.get_single_node()
            document = instance.construct_document(root) if root is not None else None
        finally:
            instance.dispose()
    except _Refused as exc:
        raise error(f"{source}:{exc.line}: {exc.message}" if exc.line else f"{source}: {exc.message}") from None
    except yaml.YAMLError as exc:
        if "nesting depth" in str(getattr(exc, "problem", "")):  # libyaml's own cap, met while scanning ahead
            raise error(f"{source}: not valid YAML: nested too deeply (over {max_depth} levels)") from None
        text = str(exc)  # PyYAML's own message; a tag or anchor it quotes can be long
        raise error(f"{source}: not valid YAML: {text if len(text) <= 500 else text[:497] + '...'}") from None
    except (RecursionError, MemoryError):  # not reachable within the bounds above; kept as a last line
        raise error(f"{source}: not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError, TypeError) as exc:  # a conversion outside any one node; never a traceback
        raise error(f"{source}: not valid YAML: {type(exc).__name__}: {shorten(str(exc), 200)}") from None
    return (document, root) if with_root else document
