"""Fault specs: which rooms, when, where and what to corrupt (docs/faults.md).

A spec is YAML, read from the file named by ``DSV4_IDXK_PROBE_FAULTS``. Every
field is checked before anything runs; an error names the file, the line and
the field (``faults.yaml:7: faults[1].when: ...``), so a typo never turns into
a run that silently injected nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from ... import safeyaml
from ...digest.layout import RowLayout
from .plan import RoomPlan

KINDS = ("bitflip", "byte_set", "zero_page", "swap_pages", "stale_page", "partial_write", "drop_page")
WHENS = ("before_send", "in_flight", "after_recv", "after_step", "in_host_pool")
# in prefill's HiCache host pool, between a page's backup and its load back to the device
# (SGLang rig with prefill HiCache only): the kinds that change a row in place
HOST_POOL_KINDS = ("bitflip", "byte_set", "zero_page")
BYTE_KINDS = ("bitflip", "byte_set")  # aim at bytes inside one segment
TRANSFER_KINDS = ("partial_write", "drop_page")  # happen to the WRITE itself
RANDOM = "random"

_TOP_KEYS = {"version", "faults"}
_FAULT_KEYS = {"name", "room", "when", "where", "kind", "bit", "value", "keep_bytes", "with_room"}
_WHERE_KEYS = {"layer", "page", "segment", "offset", "range"}
_KIND_ONLY = {"bit": ("bitflip",), "value": ("byte_set",), "keep_bytes": ("partial_write",), "with_room": ("swap_pages",)}


MAX_FAULTS = 10_000
MAX_INTEGER = 1 << 40  # rooms, steps, layers, pages and byte offsets: far past any run
MAX_NODES = MAX_FAULTS * 32  # a fault is 5-25 nodes; the 1 MiB cap on the file bounds them too


def _short(value: Any) -> str:
    return safeyaml.shorten(value, 60)  # bounded work whatever the value (a huge int or list included)


class FaultSpecError(ValueError):
    """A fault spec that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True)
class Fault:
    """One validated fault; `random` fields are resolved per room when it is applied."""

    index: int
    name: str
    room_ids: tuple[int, ...] | None  # explicit rooms, or
    room_fraction: float | None  # a seeded fraction of all rooms
    when: str  # one of WHENS
    after_step: int  # decode step after which it applies; 0 for after_recv
    kind: str
    layer: int | str = RANDOM  # global layer id, "all" or "random"
    page: int | str = RANDOM  # logical page among the transferred pages, "last" or "random"
    segment: str | None = None
    offset: int | str | None = None  # byte inside the segment, "random" (frozen) or "unfrozen"
    byte_range: tuple[int, int] | None = None  # [start, end) inside the segment
    bit: int | str | None = None
    value: int | str | None = None
    keep_bytes: int | str | None = None
    with_room: int | None = None

    @property
    def side(self) -> str:
        """The process that applies it: prefill for its source pages and its writes, else decode."""
        return "prefill" if self.when in ("before_send", "in_host_pool") or self.kind in TRANSFER_KINDS else "decode"

    @property
    def label(self) -> str:
        when = f"after_step {self.after_step}" if self.when == "after_step" else self.when
        return f"#{self.index} {self.name} ({self.kind} @ {when})"


@dataclass(frozen=True)
class FaultSpec:
    faults: tuple[Fault, ...]
    source: str = "<faults>"

    def rooms_for(self, fault: Fault, plan: Sequence[RoomPlan], seed: int) -> list[int]:
        """The rooms a fault hits; a fraction is drawn from `seed`, the same in every process."""
        ids = [p.room for p in plan]
        if fault.room_ids is not None:
            return [r for r in fault.room_ids if r in set(ids)]
        n = max(1, int(round(fault.room_fraction * len(ids))))
        rng = np.random.default_rng([seed, 0xFA017, fault.index])
        return sorted(int(r) for r in rng.choice(ids, size=min(n, len(ids)), replace=False))

    def by_room(self, plan: Sequence[RoomPlan], seed: int, side: str | None = None) -> dict[int, list[Fault]]:
        """room -> the faults that hit it (optionally only those `side` applies)."""
        out: dict[int, list[Fault]] = {}
        for fault in self.faults:
            if side is not None and fault.side != side:
                continue
            for room in self.rooms_for(fault, plan, seed):
                out.setdefault(room, []).append(fault)
        return out


# %% loading


def load_fault_spec(path: str | Path) -> FaultSpec:
    """Read and check a spec file; FaultSpecError names the file, line and field."""
    from ...config import ConfigError, read_small_text

    path = Path(path)
    try:
        text = read_small_text(path, "fault spec")
    except ConfigError as exc:  # not a regular file, too big, not UTF-8: named, never a traceback
        raise FaultSpecError(str(exc)) from None
    return parse_fault_spec(text, str(path))


def parse_fault_spec(text: str, source: str = "<faults>") -> FaultSpec:
    # safeyaml: no anchors or aliases (a 470-byte alias bomb), bounded nodes and depth, no duplicate keys
    document, root = safeyaml.load(text, source, FaultSpecError, max_nodes=MAX_NODES, with_root=True)
    return _Parser(source, root).spec(document)


class _Parser:
    def __init__(self, source: str, root: Any):
        self.source = source
        self.root = root

    def fail(self, path: list, message: str) -> FaultSpecError:
        line = _line_of(self.root, path)
        where = f"{self.source}:{line}" if line else self.source
        field = _dotted(path)
        return FaultSpecError(f"{where}: {field}: {message}" if field else f"{where}: {message}")

    def spec(self, doc: Any) -> FaultSpec:
        if not isinstance(doc, dict):
            raise self.fail([], "top level must be a mapping with a 'faults' list")
        if isinstance(doc.get("faults"), list) and len(doc["faults"]) > MAX_FAULTS:
            raise self.fail(["faults"], f"at most {MAX_FAULTS} faults, got {len(doc['faults'])}")
        self.unknown(doc, _TOP_KEYS, [])
        if doc.get("version", 1) != 1:
            raise self.fail(["version"], f"only version 1 is understood, got {_short(doc.get('version'))}")
        faults = doc.get("faults")
        if not isinstance(faults, list):
            raise self.fail(["faults"], "must be a list of faults")
        return FaultSpec(tuple(self.fault(i, f) for i, f in enumerate(faults)), self.source)

    def unknown(self, mapping: dict, known: set, path: list) -> None:
        extra = sorted(str(k) for k in mapping if not isinstance(k, str) or k not in known)
        if extra:
            raise self.fail(path + [extra[0]], f"unknown field; known: {', '.join(sorted(known))}")

    def fault(self, i: int, raw: Any) -> Fault:
        at = ["faults", i]
        if not isinstance(raw, dict):
            raise self.fail(at, "each fault must be a mapping")
        self.unknown(raw, _FAULT_KEYS, at)
        for field in ("room", "when", "kind"):
            if field not in raw:
                raise self.fail(at + [field], "is missing")
        kind = raw["kind"]
        if kind not in KINDS:
            raise self.fail(at + ["kind"], f"{_short(kind)} is not one of {', '.join(KINDS)}")
        when, after_step = self.when(raw["when"], at + ["when"])
        self.check_timing(kind, when, at)
        room_ids, fraction = self.rooms(raw["room"], at + ["room"])
        for field, kinds in _KIND_ONLY.items():
            if field in raw and kind not in kinds:
                raise self.fail(at + [field], f"only used by {', '.join(kinds)}, not {kind}")
        where = self.where(raw.get("where", {}), kind, at + ["where"])
        name = raw.get("name", f"fault-{i}")
        if not isinstance(name, str) or not name:
            raise self.fail(at + ["name"], "must be a non-empty string")
        return Fault(
            index=i, name=name, room_ids=room_ids, room_fraction=fraction, when=when, after_step=after_step, kind=kind,
            **where,
            bit=self.choice(raw, "bit", 0, 7, at) if kind == "bitflip" else None,
            value=self.choice(raw, "value", 0, 255, at) if kind == "byte_set" else None,
            keep_bytes=self.choice(raw, "keep_bytes", 1, None, at) if kind == "partial_write" else None,
            with_room=self.integer(raw["with_room"], at + ["with_room"], 0) if "with_room" in raw else None,
        )

    def when(self, raw: Any, at: list) -> tuple[str, int]:
        if raw in ("before_send", "in_flight", "after_recv", "in_host_pool"):
            return raw, 0
        if isinstance(raw, dict) and set(raw) == {"after_step"}:
            return "after_step", self.integer(raw["after_step"], at + ["after_step"], 1)
        raise self.fail(at, f"{_short(raw)} is not one of before_send, in_flight, after_recv, {{after_step: N}}, "
                            "in_host_pool")

    def check_timing(self, kind: str, when: str, at: list) -> None:
        if when == "in_host_pool" and kind not in HOST_POOL_KINDS:
            raise self.fail(
                at + ["kind"], f"in_host_pool changes a host-pool row in place: only {', '.join(HOST_POOL_KINDS)} apply, "
                f"not {kind}")
        if kind in TRANSFER_KINDS and when != "in_flight":
            raise self.fail(at + ["when"], f"{kind} happens to the WRITE itself, so only in_flight applies, not {when}")
        if kind == "swap_pages" and when == "before_send":
            raise self.fail(
                at + ["when"], "swap_pages needs a partner room whose decode copy is settled; use in_flight or later"
            )

    def rooms(self, raw: Any, at: list) -> tuple[tuple[int, ...] | None, float | None]:
        if isinstance(raw, float):
            if not 0.0 < raw <= 1.0:
                raise self.fail(at, f"a fraction of rooms must be in (0, 1], got {raw}")
            return None, raw
        if isinstance(raw, list):
            if not raw:
                raise self.fail(at, "a list of rooms must not be empty")
            rooms = tuple(self.integer(r, at + [j], 0) for j, r in enumerate(raw))
            for j, room in enumerate(rooms):
                if room in rooms[:j]:  # a room hit twice would be expected twice: a false "MISSED"
                    raise self.fail(at + [j], f"room {room} is listed more than once")
            return rooms, None
        return (self.integer(raw, at, 0),), None

    def where(self, raw: Any, kind: str, at: list) -> dict[str, Any]:
        if raw == RANDOM:
            raw = {}
        if not isinstance(raw, dict):
            raise self.fail(at, "must be a mapping (layer, page, segment, offset, range) or 'random'")
        self.unknown(raw, _WHERE_KEYS, at)
        if kind not in BYTE_KINDS:
            for field in ("segment", "offset", "range"):
                if field in raw:
                    raise self.fail(at + [field], f"not used by {kind}: it acts on whole (layer, page) rows")
        layer = raw.get("layer", RANDOM)
        if layer not in (RANDOM, "all"):
            layer = self.integer(layer, at + ["layer"], 0)
        page = raw.get("page", RANDOM)
        if page not in (RANDOM, "last"):
            page = self.integer(page, at + ["page"], 0)
        out: dict[str, Any] = {"layer": layer, "page": page}
        if kind in BYTE_KINDS:
            segment = raw.get("segment", RANDOM)
            if not isinstance(segment, str) or not segment:
                raise self.fail(at + ["segment"], "must be a segment name of the layout or 'random'")
            out["segment"] = segment
            if "offset" in raw and "range" in raw:
                raise self.fail(at + ["range"], "give offset or range, not both")
            if "range" in raw:
                out["byte_range"] = self.byte_range(raw["range"], at + ["range"])
            else:
                offset = raw.get("offset", RANDOM)
                if offset not in (RANDOM, "unfrozen"):
                    offset = self.integer(offset, at + ["offset"], 0)
                out["offset"] = offset
        return out

    def byte_range(self, raw: Any, at: list) -> tuple[int, int]:
        if not isinstance(raw, list) or len(raw) != 2:
            raise self.fail(at, "must be [start, end): two byte offsets inside the segment")
        start, end = (self.integer(v, at + [j], 0) for j, v in enumerate(raw))
        if end <= start:
            raise self.fail(at, f"end {end} must be greater than start {start}")
        return start, end

    def choice(self, raw: dict, field: str, low: int, high: int | None, at: list) -> int | str:
        value = raw.get(field, RANDOM)
        if value == RANDOM:
            return value
        value = self.integer(value, at + [field], low)
        if high is not None and value > high:
            raise self.fail(at + [field], f"must be {low}..{high} or 'random', got {value}")
        return value

    def integer(self, value: Any, at: list, minimum: int, maximum: int = MAX_INTEGER) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(at, f"must be an integer, got {_short(value)}")
        if value < minimum:
            raise self.fail(at, f"must be >= {minimum}, got {value}")
        if value > maximum:
            raise self.fail(at, f"must be <= {maximum:_}, got {value:_}")
        return value


# %% checks that need the run's geometry


BUILTIN_HOST_POOL_REFUSAL = ("in_host_pool needs SGLang's HiCache host pools: only the SGLang rig with HiCache on "
                             "prefill applies it (tests/sglang_rig/test_pd_hicache.py), not the built-in rig")


def check_against(spec: FaultSpec, layout: RowLayout, layer_ids: Sequence[int], plan: Sequence[RoomPlan], *,
                  host_pool_refusal: str | None = BUILTIN_HOST_POOL_REFUSAL, scope: str = "run") -> None:
    """Refuse references the run cannot satisfy: unknown rooms, layers, segments, offsets.

    `layer_ids`: the model's C4 layer ids (global); `plan`: the rooms of the run (or of
    one phase of it: `scope` names which in the message). `host_pool_refusal`: why
    `in_host_pool` cannot apply here (None: it can, SGLang's HiCache is on prefill).
    """
    rooms = {p.room for p in plan}
    for f in spec.faults:
        if f.when == "in_host_pool" and host_pool_refusal is not None:
            raise FaultSpecError(f"{spec.source}: faults[{f.index}].when: {host_pool_refusal}")
    seg_bytes = {s.name: layout.slots * s.slot_bytes for s in layout.segments}
    for f in spec.faults:
        at = f"{spec.source}: faults[{f.index}]"
        for room in f.room_ids or ():
            if room not in rooms:
                raise FaultSpecError(f"{at}.room: room {room} is not in this {scope} (rooms {_rooms_text(rooms)})")
        if f.with_room is not None and f.with_room not in rooms:
            raise FaultSpecError(f"{at}.with_room: room {f.with_room} is not in this {scope} (rooms {_rooms_text(rooms)})")
        if isinstance(f.layer, int) and f.layer not in layer_ids:
            raise FaultSpecError(f"{at}.where.layer: {f.layer} is not a C4 layer id of this {scope} ({list(layer_ids)})")
        if f.segment is not None and f.segment != RANDOM and f.segment not in seg_bytes:
            raise FaultSpecError(
                f"{at}.where.segment: {_short(f.segment)} is not a segment of layout {layout.name!r} ({', '.join(seg_bytes)})"
            )
        limit = seg_bytes.get(f.segment) if f.segment not in (None, RANDOM) else min(seg_bytes.values())
        if isinstance(f.offset, int) and f.offset >= limit:
            raise FaultSpecError(f"{at}.where.offset: {f.offset} is outside the segment ({limit} bytes)")
        if f.byte_range is not None and f.byte_range[1] > limit:
            raise FaultSpecError(f"{at}.where.range: end {f.byte_range[1]} is outside the segment ({limit} bytes)")
        if isinstance(f.keep_bytes, int) and f.keep_bytes >= layout.row_bytes:
            raise FaultSpecError(f"{at}.keep_bytes: must be below the row size {layout.row_bytes}, got {f.keep_bytes}")


def _rooms_text(rooms: set[int]) -> str:
    """`1..20` for a contiguous run of rooms, else the rooms themselves (a few, then a count)."""
    if not rooms:
        return "none"
    ordered = sorted(rooms)
    if ordered[-1] - ordered[0] + 1 == len(ordered) and len(ordered) > 2:
        return f"{ordered[0]}..{ordered[-1]}"
    shown = ", ".join(str(r) for r in ordered[:8])
    return shown + (f", ... ({len(ordered)} rooms)" if len(ordered) > 8 else "")


# %% line numbers for messages


def _line_of(node: Any, path: list) -> int | None:
    """1-based line of the YAML node at `path` (or of its nearest existing parent)."""
    line = None
    for part in path:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            node = None
    if node is not None:
        line = node.start_mark.line + 1
    return line


def _dotted(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
