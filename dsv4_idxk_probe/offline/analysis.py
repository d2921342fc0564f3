"""Offline side of the room log: join prefill and decode records and judge them.

Used by `dsv4-idxk-probe diff` and `report`. Verdicts are recomputed from the
digests in the logs (the decode side's live verdict is kept only to count
disagreements): each decode stage's digest is compared with the prefill
record of the same (room, attempt) through `digest.result.compare`, which
also localises a mismatch. A decode record with no prefill record is
`unverified`. Bad lines are collected with their file:line and skipped.

Speed: a million rooms must diff in under a minute on one core, so digests
are kept as packed bytes; identical digests (the common case) are a match
without unpacking, anything else goes through `compare`.
"""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np

from ..diagnosis.diagnose import KINDS, summarise
from ..hicache.culprit import summarise as summarise_roundtrip
from ..digest.result import Comparison, RoomDigest, compare
from ..vocabulary import DECODE_STAGES, SCHEMA_VERSION, SEVERITY, STAGES, VERDICTS
from ..roomlog.reader import read_file

STAGE_ORDER = {stage: i for i, stage in enumerate(DECODE_STAGES)}
STAGE_SET = frozenset(STAGES)
VERDICT_SET = frozenset(VERDICTS)
KIND_SET = frozenset(KINDS)
# Worst first: a room's verdict is its worst stage's.

DECISIVE = ("match", "mismatch", "not_comparable")
MAX_ERRORS_KEPT = 10_000
MAX_ROUNDTRIP_KEPT = 1_000  # HiCache round-trip diagnoses kept for the report (all are counted)
MAX_ROOM_CHARS = 256
MAX_TS = 1e11  # the year 5138: anything later is not a timestamp

Key = tuple  # (room: str, attempt: int)


class RecordError(ValueError):
    """A record that parses but breaks the schema; the message names the field."""


def _short(value: Any) -> str:
    """A value for an error message, never longer than a line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _printable(text: str) -> str:
    """Text any output can carry: a lone surrogate (which the writer's JSON fallback can
    produce) becomes its escape, the same for prefill and decode, so rooms still join."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")


class Packed(NamedTuple):
    """A digest as the logs carry it, packed for cheap equality and low memory."""

    signature: int
    n_tokens: int
    layer_ids: tuple
    segments: tuple
    cells: bytes  # layer_segment, row-major, big-endian uint64
    pages: bytes

    def unpack(self, key: str) -> RoomDigest:
        return RoomDigest(
            key=key,
            signature=self.signature,
            n_tokens=self.n_tokens,
            layer_ids=self.layer_ids,
            segments=self.segments,
            layer_segment=np.frombuffer(self.cells, dtype=">u8")
            .astype(np.uint64)
            .reshape(len(self.layer_ids), len(self.segments)),
            pages=np.frombuffer(self.pages, dtype=">u8").astype(np.uint64),
        )


def _order(stage: "StageResult") -> tuple[int, int, int]:
    """Transfer first (a rebootstrapped room is sent again), then stage, then step."""
    return (stage.transfer, STAGE_ORDER[stage.stage], stage.step or 0)


@dataclass(slots=True)
class StageResult:
    """One decode record, judged."""

    stage: str
    step: int | None
    verdict: str
    reason: str
    live_verdict: str | None
    ts: float | None
    file: str
    line: int
    comparison: Comparison | None = None
    tokens: int | None = None  # tokens of the transfer this stage judged (None: no digest, no tokens field)
    transfer: int = 0  # which transfer of the room: 0, then 1 after a rebootstrap, ...
    diagnosis: list | None = None  # per bad cell, what decode found its bytes became (docs/diagnosis.md)
    # decode could not localise live: its suspects and each page's journal events, completed
    # here from the localisation of the logs (`complete_diagnosis`)
    page_events: dict | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def order(self) -> tuple[int, int]:
        return _order(self)

    @property
    def label(self) -> str:
        return f"{self.stage}@{self.step}" if self.step is not None else self.stage

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage, "step": self.step, "verdict": self.verdict}
        if self.tokens is not None:
            out["tokens"] = self.tokens
        if self.transfer:
            out["transfer"] = self.transfer
        if self.reason:
            out["reason"] = self.reason
        if self.live_verdict is not None and self.live_verdict != self.verdict:
            out["live_verdict"] = self.live_verdict
        if self.comparison is not None and self.comparison.verdict == "mismatch":
            c = self.comparison
            out["localisation"] = {
                "layers": c.layers,
                "pages": c.pages,
                "segments": c.segments,
                "layer_segments": [list(x) for x in c.layer_segments],
                "exact": c.exact,
                "cells_bound": c.cells_bound,
            }
        if self.diagnosis is not None:
            out["diagnosis"] = self.diagnosis
        out["where"] = f"{self.file}:{self.line}"
        return out


def room_sort_key(room: str) -> tuple:
    """Bootstrap rooms are numbers written as text: order them as numbers (9 < 10 < 113)."""
    return (0, int(room), "") if room.isdigit() else (1, 0, room)


@dataclass(slots=True)
class RoomResult:
    room: str  # SGLang's bootstrap room
    attempt: int
    stages: list[StageResult]
    has_prefill: bool = False
    n_pages: int = 0
    layer_ids: tuple = ()
    transfers: list = field(default_factory=list)  # token counts of its transfers, in the order seen

    def transfer_of(self, tokens: int | None) -> int:
        """The index of the transfer of `tokens` tokens (a record without tokens joins the latest)."""
        if tokens is None:
            return max(len(self.transfers) - 1, 0)
        if tokens not in self.transfers:
            self.transfers.append(tokens)
        return self.transfers.index(tokens)
    prefill_rid: str | None = None  # SGLang's request id on each side (they may differ)
    decode_rid: str | None = None

    @property
    def rids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for r in (self.decode_rid, self.prefill_rid) if r))

    @property
    def ordered(self) -> list[StageResult]:
        return sorted(self.stages, key=_order)

    @property
    def verdict(self) -> str:
        return max((s.verdict for s in self.stages), key=SEVERITY.__getitem__)

    @property
    def closed(self) -> bool:
        """Whether decode's last word on the room is in the logs: `decode_finish` or `skipped`."""
        return any(s.stage == "decode_finish" or s.verdict == "skipped" for s in self.stages)

    @property
    def first_divergence(self) -> StageResult | None:
        """The earliest decode stage whose digest mismatches prefill's."""
        bad = [s for s in self.stages if s.verdict == "mismatch"]
        return min(bad, key=_order) if bad else None

    @property
    def last_match_before_divergence(self) -> StageResult | None:
        """The latest matching stage before the first divergence: "intact at ..."."""
        first = self.first_divergence
        if first is None:
            return None
        good = [s for s in self.stages if s.verdict == "match" and _order(s) < _order(first)]
        return max(good, key=_order) if good else None

    def to_json(self) -> dict[str, Any]:
        ordered = self.ordered
        first = intact = None
        for s in ordered:
            if s.verdict == "mismatch":
                first = s
                break
            if s.verdict == "match":
                intact = s
        return {
            "room": self.room,
            "attempt": self.attempt,
            "rid": {"prefill": self.prefill_rid, "decode": self.decode_rid},
            "verdict": self.verdict,
            "first_divergence": {"stage": first.stage, "step": first.step} if first else None,
            "last_match_before": {"stage": intact.stage, "step": intact.step} if first and intact else None,
            "stages": [s.to_json() for s in ordered],
            "closed": self.closed,
            **({"transfers": list(self.transfers)} if len(self.transfers) > 1 else {}),
        }


@dataclass
class Tally:
    """Counts over all rooms, made in one pass."""

    stage_verdicts: dict[str, Counter]
    room_verdicts: Counter
    first_divergence: Counter
    bad_rooms: list[RoomResult]  # not all-match, worst first
    rooms_without_finish: int = 0  # seen on decode, neither finished nor skipped in these logs


@dataclass
class Analysis:
    """Everything the logs say, joined."""

    files: list[str] = field(default_factory=list)
    rooms: dict[Key, RoomResult] = field(default_factory=dict)
    prefill_only: int = 0
    prefill_only_keys: list = field(default_factory=list)  # (room, attempt): sent, never seen on decode
    prefill_only_rids: dict = field(default_factory=dict)  # (room, attempt) -> prefill's rid, where logged
    errors: list[str] = field(default_factory=list)
    n_errors: int = 0
    record_kinds: Counter = field(default_factory=Counter)
    hicache: Counter = field(default_factory=Counter)  # (pool, direction, branch) -> count
    roundtrip: list[dict] = field(default_factory=list)  # HiCache round-trip diagnoses, the first MAX_ROUNDTRIP_KEPT
    roundtrip_n: int = 0  # all of them
    duplicates: int = 0
    conflicts: int = 0
    live_disagreements: int = 0

    def error(self, where: str, message: str) -> None:
        self.n_errors += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(f"{where}: {message}")

    @cached_property
    def tally(self) -> Tally:
        stages = {stage: Counter() for stage in DECODE_STAGES}
        rooms: Counter = Counter()
        first: Counter = Counter()
        bad = []
        open_rooms = 0
        for room in self.rooms.values():
            open_rooms += not room.closed
            worst = "skipped"
            for s in room.stages:
                stages[s.stage][s.verdict] += 1
                if SEVERITY[s.verdict] > SEVERITY[worst]:
                    worst = s.verdict
            rooms[worst] += 1
            if worst == "mismatch":
                first[room.first_divergence.stage] += 1
            if worst != "match" and worst != "skipped":
                bad.append(room)
        bad.sort(key=lambda r: (-SEVERITY[r.verdict], room_sort_key(r.room), r.attempt))
        return Tally(stages, rooms, first, bad, open_rooms)

    def room_verdicts(self) -> Counter:
        return self.tally.room_verdicts

    def bad_rooms(self) -> list[RoomResult]:
        """Rooms that are not all-match, worst first."""
        return self.tally.bad_rooms

    def select_rids(self, rids: Iterable[str]) -> None:
        """Keep only the rooms whose SGLang request id (either side's) is in `rids`."""
        wanted = set(rids)
        self.rooms = {k: r for k, r in self.rooms.items() if wanted.intersection(r.rids)}
        self.prefill_only_keys = [k for k in self.prefill_only_keys if self.prefill_only_rids.get(k) in wanted]
        self.prefill_only = len(self.prefill_only_keys)
        self.__dict__.pop("tally", None)

    def diagnoses(self) -> list[dict]:
        """The diagnosed cells of every mismatching room, at its first mismatching stage."""
        out = []
        for room in self.tally.bad_rooms:
            first = room.first_divergence
            if first is not None and first.diagnosis:
                out += [dict(cell, room=room.room, stage=first.label) for cell in first.diagnosis]
        return out

    def summary(self) -> dict[str, Any]:
        t = self.tally
        cells = self.diagnoses()
        return {
            "diagnosis": {"cells": dict(Counter(c["kind"] for c in cells)), "lines": summarise(cells)},
            "files": len(self.files),
            "records": dict(self.record_kinds),
            "rooms": len(self.rooms),
            "room_verdicts": dict(t.room_verdicts),
            "stage_verdicts": {k: dict(v) for k, v in t.stage_verdicts.items()},
            "first_divergence": dict(t.first_divergence),
            "prefill_only_rooms": self.prefill_only,
            "rooms_without_decode_finish": t.rooms_without_finish,
            "live_verdict_disagreements": self.live_disagreements,
            "duplicate_records": self.duplicates,
            "conflicting_prefill_records": self.conflicts,
            "bad_lines": self.n_errors,
            "hicache_branches": [
                {"pool": p, "direction": d, "branch": b, "count": n} for (p, d, b), n in sorted(self.hicache.items())
            ],
            "hicache_roundtrip": {"mismatches": self.roundtrip_n, "lines": summarise_roundtrip(self.roundtrip),
                                  "rows": self.roundtrip},
        }


# %% record parsing (hot path: keep it flat)

MAX_DIAGNOSED_CELLS = 4096  # per record; the probe writes at most diagnosis.max_cells_per_room
_CELL_INTS = ("layer", "page", "physical_page")
_ROOM_FIELDS = {"room": str, "layer_index": int, "page": int, "physical_page": int, "held": bool}
_EVENT_FIELDS = {"t_ns": int, "event": str, "page": int, "room": str, "host_row": int, "layer": int, "pool": str}


def _plain(source: Any, fields: dict, where: str) -> dict:
    if type(source) is not dict:
        raise RecordError(f"{where} must be an object")
    out = {}
    for name, kind in fields.items():
        value = source.get(name)
        if value is None:
            continue
        if type(value) is not kind or (kind is str and len(value) > MAX_ROOM_CHARS):
            raise RecordError(f"{where}.{name} must be {kind.__name__}, got {_short(value)}")
        out[name] = value if kind is not str or value.isascii() else _printable(value)
    return out


def complete_diagnosis(suspects: list[dict], comparison: Comparison, page_events: dict) -> list[dict]:
    """Decode's diagnosis of a mismatch it could not localise, made per cell of the logs'
    localisation: a suspect decode named keeps its diagnosis; any other cell of the bound
    is `unknown`, with its page's journal events; suspects outside the bound are dropped."""
    named = {(c.get("layer"), c.get("page"), c.get("segment")): c for c in suspects}
    out = []
    for layer, segment in comparison.layer_segments:
        for page in comparison.pages:
            cell = named.get((layer, page, segment))
            if cell is None:
                cell = {"layer": layer, "page": page, "segment": segment, "kind": "unknown"}
                events = page_events.get(str(page))
                if events:
                    cell["events"] = events
            cell = dict(cell)
            cell.pop("exact", None)
            if not comparison.exact:
                cell["exact"] = False
            out.append(cell)
            if len(out) >= MAX_DIAGNOSED_CELLS:
                return out
    return out


_LEG_SET = frozenset(("d2h", "host", "h2d"))
_ROUNDTRIP_VERDICTS = frozenset(("match", "mismatch", "unverified"))


def _checks(value: Any, where: str) -> dict:
    """Round-trip checks of a host row: leg -> verdict, and the layers that mismatched."""
    if type(value) is not dict or len(value) > 4:
        raise RecordError(f"{where} must be an object of round-trip legs")
    out: dict[str, Any] = {}
    for leg, verdict in value.items():
        if leg == "layers":
            if type(verdict) is not list or len(verdict) > 4096 or any(type(v) is not int for v in verdict):
                raise RecordError(f"{where}.layers must be a list of layer numbers")
            out[leg] = verdict
        elif leg not in _LEG_SET or verdict not in _ROUNDTRIP_VERDICTS:
            raise RecordError(f"{where} must map d2h, host, h2d to match, mismatch or unverified")
        else:
            out[leg] = verdict
    return out


def _event(value: Any, where: str) -> dict:
    """One journal event: plain fields, and a HiCache load's `host_row_checks`."""
    out = _plain(value, _EVENT_FIELDS, where)
    if value.get("host_row_checks") is not None:
        out["host_row_checks"] = _checks(value["host_row_checks"], f"{where}.host_row_checks")
    return out


def _roundtrip_diagnosis(rec: dict) -> dict:
    """A `roundtrip_diagnosis` HiCache record (docs/diagnosis.md), checked."""
    out = _plain(rec, {"pool": str, "host_row": int, "device_page": int, "layer": int}, "roundtrip_diagnosis")
    if "pool" not in out or "host_row" not in out or "layer" not in out:
        raise RecordError("roundtrip_diagnosis needs a string pool and integer host_row and layer")
    leg = rec.get("leg")
    if leg is not None and leg not in _LEG_SET:
        raise RecordError("roundtrip_diagnosis.leg must be null or one of d2h, host, h2d")
    out["leg"] = leg
    out["checks"] = _checks(rec.get("checks") or {}, "roundtrip_diagnosis.checks")
    events = rec.get("events") or []
    if type(events) is not list or len(events) > 64:
        raise RecordError("roundtrip_diagnosis.events must be a list of at most 64 events")
    out["events"] = [_event(e, f"roundtrip_diagnosis.events[{j}]") for j, e in enumerate(events)]
    return out


def _page_events(value: Any) -> dict:
    """A record's `page_events` (logical page -> journal events), checked like `diagnosis`."""
    if value is None:
        return {}
    if type(value) is not dict or len(value) > MAX_DIAGNOSED_CELLS:
        raise RecordError(f"page_events must be an object of at most {MAX_DIAGNOSED_CELLS} pages")
    out = {}
    for page, events in value.items():
        if not page.isdigit() or type(events) is not list or len(events) > 64:
            raise RecordError("page_events must map page numbers to lists of at most 64 events")
        out[page] = [_event(e, f"page_events[{page}][{j}]") for j, e in enumerate(events)]
    return out


def _diagnosis(cells: Any) -> list[dict]:
    """A record's `diagnosis`, checked: known kinds, plain fields, bounded lengths."""
    if type(cells) is not list or len(cells) > MAX_DIAGNOSED_CELLS:
        raise RecordError(f"diagnosis must be a list of at most {MAX_DIAGNOSED_CELLS} cells")
    out = []
    for i, cell in enumerate(cells):
        where = f"diagnosis[{i}]"
        if type(cell) is not dict or cell.get("kind") not in KIND_SET:
            raise RecordError(f"{where}.kind must be one of {', '.join(KINDS)}")
        if type(cell.get("segment")) is not str or len(cell["segment"]) > MAX_ROOM_CHARS:
            raise RecordError(f"{where}.segment must be a short string")
        clean = {"kind": cell["kind"], "segment": cell["segment"]}
        for name in _CELL_INTS:
            value = cell.get(name)
            if value is not None and type(value) is not int:
                raise RecordError(f"{where}.{name} must be an integer")
            if value is not None:
                clean[name] = value
        if cell.get("exact") is False:
            clean["exact"] = False
        for name, fields in (("rooms", _ROOM_FIELDS), ("events", _EVENT_FIELDS)):
            items = cell.get(name)
            if items is None:
                continue
            if type(items) is not list or len(items) > 64:
                raise RecordError(f"{where}.{name} must be a list of at most 64 entries")
            clean[name] = [_event(x, f"{where}.{name}[{j}]") if name == "events" else
                           _plain(x, fields, f"{where}.{name}[{j}]") for j, x in enumerate(items)]
        out.append(clean)
    return out



_HEX16 = frozenset({16})  # the lengths a list of 16-digit hex values may have

# Validated once, then shared: a log holds few distinct layer sets, segment sets and signatures.
_CACHE_LIMIT = 4096
_shapes: dict[tuple, tuple[tuple, tuple]] = {}
_signatures: dict[str, int] = {}


def _shape(layer_ids: Any, segments: Any) -> tuple[tuple, tuple]:
    if type(layer_ids) is not list or type(segments) is not list:
        raise RecordError("digest.layer_ids and digest.segments must be lists")
    # Types first: a list or dict inside cannot be hashed into the cache key.
    if any(type(i) is not int for i in layer_ids):
        raise RecordError("digest.layer_ids must be a list of integers")
    if not segments or any(type(x) is not str for x in segments):
        raise RecordError("digest.segments must be a non-empty list of strings")
    key = (tuple(layer_ids), tuple(segments))
    shape = _shapes.get(key)
    if shape is None:
        shape = key
        if len(_shapes) < _CACHE_LIMIT:
            _shapes[key] = shape
    return shape


def _signature(value: Any) -> int:
    known = _signatures.get(value) if type(value) is str else None
    if known is not None:
        return known
    if type(value) is not str or len(value) != 16:
        raise RecordError("digest.signature must be a 16-digit hex string")
    try:
        parsed = int(value, 16)
    except ValueError:
        raise RecordError("digest.signature must be a 16-digit hex string") from None
    if len(_signatures) < _CACHE_LIMIT:
        _signatures[value] = parsed
    return parsed


def pack_digest(d: Any) -> Packed:
    """Validate a record's ``digest`` object and pack it; RecordError names the field.

    Runs once per record (millions), hence the flat code and cached shapes.
    """
    if type(d) is not dict:
        raise RecordError("digest must be an object or null")
    try:
        layer_ids, segments, matrix = d["layer_ids"], d["segments"], d["layer_segment"]
        pages, n_tokens, signature = d["pages"], d["n_tokens"], d["signature"]
    except KeyError as exc:
        raise RecordError(f"digest.{exc.args[0]} is missing") from None
    ids, segs = _shape(layer_ids, segments)
    if type(n_tokens) is not int or n_tokens < 0:
        raise RecordError("digest.n_tokens must be a non-negative integer")
    sig = _signatures.get(signature) if type(signature) is str else None
    n_cells = len(ids) * len(segs)
    try:
        if type(matrix) is not list or len(matrix) != len(ids) or (matrix and set(map(len, matrix)) != {len(segs)}):
            raise TypeError
        cells = [v for row in matrix for v in row]
        if set(map(len, cells)) <= _HEX16:
            packed_cells = bytes.fromhex("".join(cells))
        else:
            raise ValueError
    except (TypeError, ValueError):
        raise RecordError(f"digest.layer_segment must be {len(ids)} rows of {len(segs)} 16-digit hex strings") from None
    try:
        if type(pages) is not list or not set(map(len, pages)) <= _HEX16:
            raise ValueError
        packed_pages = bytes.fromhex("".join(pages))
    except (TypeError, ValueError):
        raise RecordError("digest.pages must be a list of 16-digit hex strings") from None
    if len(packed_cells) != 8 * n_cells or len(packed_pages) != 8 * len(pages):  # whitespace inside a value
        raise RecordError("digest values must be 16-digit hex strings")
    return Packed(_signature(signature) if sig is None else sig, n_tokens, ids, segs, packed_cells, packed_pages)


class _Joiner:
    """Joins records as they stream by; decode records that arrive before their prefill wait."""

    def __init__(self, analysis: Analysis):
        self.a = analysis
        self.prefill: dict[Key, dict[int | None, Packed | None]] = {}  # (room, attempt) -> tokens -> digest
        self.prefill_skipped: set[Key] = set()
        self.prefill_rids: dict[Key, str] = {}  # only rooms whose record named one
        self.deferred: list[tuple[Key, StageResult, Packed | None]] = []

    def add_record(self, rec: dict, file: str, line: int) -> None:
        """Validate and route one record; RecordError names the offending field."""
        version = rec.get("v")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise RecordError(f"v must be {SCHEMA_VERSION} (schema version this tool reads), got {_short(version)}")
        kind = rec.get("kind")
        if type(kind) is not str:
            raise RecordError(f"kind must be a string, got {_short(kind)}")
        self.a.record_kinds[kind] += 1
        if kind == "room":
            self._room(rec, file, line)
        elif kind == "hicache":
            self._hicache(rec)

    def _hicache(self, rec: dict) -> None:
        if rec.get("event") == "roundtrip_diagnosis":
            diag = _roundtrip_diagnosis(rec)
            self.a.roundtrip_n += 1
            if len(self.a.roundtrip) < MAX_ROUNDTRIP_KEPT:
                self.a.roundtrip.append(diag)
            return
        if "branch" not in rec and type(rec.get("event")) is str:
            return  # a pool, guard or check event: the room log keeps it, the diff counts only branches
        pool, branch, direction, count = rec.get("pool"), rec.get("branch"), rec.get("direction", ""), rec.get("count", 1)
        if not isinstance(pool, str) or not isinstance(branch, str) or not isinstance(direction, str):
            raise RecordError("hicache records need string pool, branch and direction")
        if max(len(pool), len(branch), len(direction)) > 256:
            raise RecordError("hicache pool, branch and direction must be at most 256 characters")
        pool, branch, direction = _printable(pool), _printable(branch), _printable(direction)
        if type(count) is not int or count < 0:
            raise RecordError("count must be a non-negative integer")
        self.a.hicache[(pool, direction, branch)] += count

    def _room(self, rec: dict, file: str, line: int) -> None:
        room, attempt, stage, step, verdict = rec.get("room"), rec.get("attempt"), rec.get("stage"), rec.get("step"), rec.get("verdict")
        if type(room) is not str or not room:
            raise RecordError("room must be a non-empty string")
        if len(room) > MAX_ROOM_CHARS:
            raise RecordError(f"room must be at most {MAX_ROOM_CHARS} characters")
        if not room.isascii():
            room = _printable(room)
        if type(attempt) is not int or attempt < 0:
            raise RecordError("attempt must be a non-negative integer")
        if type(stage) is not str or stage not in STAGE_SET:
            raise RecordError(f"stage must be one of {', '.join(STAGES)}")
        if step is not None and type(step) is not int:
            raise RecordError("step must be an integer or null")
        if verdict is not None and (type(verdict) is not str or verdict not in VERDICT_SET):
            raise RecordError(f"verdict must be null or one of {', '.join(VERDICTS)}")
        rid = rec.get("rid")
        if rid is not None and (type(rid) is not str or not rid):
            raise RecordError("rid must be a non-empty string or null")
        digest = rec.get("digest")
        packed = pack_digest(digest) if digest is not None else None
        tokens = packed.n_tokens if packed is not None else rec.get("tokens")
        tokens = tokens if type(tokens) is int and 0 <= tokens < 1 << 40 else None
        key = (room, attempt)
        if stage == "prefill_send":
            self._add_prefill(key, tokens, packed, verdict)
            if rid is not None and key not in self.prefill_rids:
                self.prefill_rids[key] = rid
            return
        ts = rec.get("ts")
        if ts is not None and (type(ts) not in (int, float) or not 0 <= ts <= MAX_TS):
            raise RecordError(f"ts must be null or a Unix time in seconds (0 to {MAX_TS:.0f}), got {_short(ts)}")
        result = StageResult(stage, step, "", "", verdict, ts, file, line, tokens=tokens)
        if rec.get("diagnosis") is not None:
            result.diagnosis = _diagnosis(rec["diagnosis"])
            if rec.get("localisation") is None:
                result.page_events = _page_events(rec.get("page_events"))
        found = self.a.rooms.get(key)
        if found is None:
            found = self.a.rooms[key] = RoomResult(room, attempt, [])
        if rid is not None and found.decode_rid is None:
            found.decode_rid = rid
        result.transfer = found.transfer_of(tokens)
        for s in found.stages:
            if s.stage == stage and s.step == step and s.transfer == result.transfer:
                self.a.duplicates += 1
                return
        found.stages.append(result)
        if key in self.prefill:
            self._judge(key, found, result, packed)
        else:
            self.deferred.append((key, result, packed))

    def _add_prefill(self, key: Key, tokens: int | None, packed: Packed | None, verdict: str | None) -> None:
        """One prefill record per transfer: a rebootstrapped room is sent again, with more tokens."""
        sent = self.prefill.setdefault(key, {})
        if tokens in sent:
            if sent[tokens] == packed:
                self.a.duplicates += 1
            else:
                self.a.conflicts += 1  # keep the first; the summary says how many disagreed
            return
        sent[tokens] = packed
        if verdict == "skipped":
            self.prefill_skipped.add(key)

    def _judge(self, key: Key, room: RoomResult, result: StageResult, observed: Packed | None) -> None:
        sent = self.prefill.get(key, {})
        # the transfer of the same length; else the latest one (a length that differs is not comparable)
        expected = sent.get(result.tokens) if result.tokens in sent else (list(sent.values())[-1] if sent else None)
        room.has_prefill = key in self.prefill
        if room.prefill_rid is None:
            room.prefill_rid = self.prefill_rids.get(key)
        if expected is not None and not room.layer_ids:
            room.layer_ids, room.n_pages = expected.layer_ids, len(expected.pages) // 8
        if observed is not None and observed == expected:
            result.verdict = "match"  # identical digests: what compare() says, without unpacking
        elif result.live_verdict == "skipped" or (expected is None and key in self.prefill_skipped):
            result.verdict, result.reason = "skipped", "skipped on the serving side"
        elif not room.has_prefill:
            result.verdict, result.reason = "unverified", "no prefill record for this room and attempt"
        elif expected is None:
            result.verdict, result.reason = "unverified", "prefill record has no digest"
        elif observed is None:
            result.verdict, result.reason = "unverified", "decode record has no digest"
        else:
            name = f"{key[0]}/{key[1]}"
            comparison = compare(expected.unpack(name), observed.unpack(name))
            result.verdict, result.reason, result.comparison = comparison.verdict, comparison.reason, comparison
            if result.page_events is not None and comparison.verdict == "mismatch":
                result.diagnosis = complete_diagnosis(result.diagnosis or [], comparison, result.page_events)
        live = result.live_verdict
        if live != result.verdict and live in DECISIVE and result.verdict in DECISIVE:
            self.a.live_disagreements += 1

    def finish(self) -> None:
        for key, result, packed in self.deferred:
            self._judge(key, self.a.rooms[key], result, packed)
        self.deferred.clear()
        self.a.prefill_only_keys = [key for key in self.prefill if key not in self.a.rooms]
        self.a.prefill_only = len(self.a.prefill_only_keys)
        self.a.prefill_only_rids = {k: self.prefill_rids[k] for k in self.a.prefill_only_keys if k in self.prefill_rids}


def _first_role(path: Path) -> int:
    """0 for files that start with a prefill record, so they are read first (fewer deferrals)."""
    with closing(read_file(path)) as entries:
        for entry in entries:
            if entry.record is not None:
                return 0 if entry.record.get("stage") == "prefill_send" else 1
            if entry.line > 100:
                break
    return 1


def analyse(paths: Iterable[Path]) -> Analysis:
    """Read every file, join by (room, attempt), judge each decode stage."""
    paths = list(paths)
    analysis = Analysis(files=[str(p) for p in paths])
    joiner = _Joiner(analysis)
    # Millions of long-lived, acyclic objects: the cyclic collector would rescan
    # them again and again for nothing (about 15% of the run).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for path in sorted(paths, key=_first_role):
            for file, line, record, error in read_file(path):
                if record is None:
                    analysis.error(f"{file}:{line}", error or "unreadable line")
                    continue
                try:
                    joiner.add_record(record, file, line)
                except RecordError as exc:
                    analysis.error(f"{file}:{line}", str(exc))
        joiner.finish()
    finally:
        if gc_was_enabled:
            gc.enable()
    return analysis
