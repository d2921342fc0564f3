"""The checks a record read from a room log must pass before the join uses it.

Logs come from other machines and may be torn, edited or hostile: a record
that parses but breaks the schema raises RecordError, whose message names the
field, and the join skips that line (the diff lists it with its file:line).
What passes is plain, bounded data: known stages, verdicts and kinds, sane
numbers, text any output can carry, and the digest packed (`packed.Packed`).

Runs once per record (millions), hence the flat code and the cached shapes. A
value's type is tested before its membership in a set: a list or an object cannot
be hashed, and must be a RecordError like any other bad value.
"""

from __future__ import annotations

from typing import Any

from ..vocabulary import DIAGNOSIS_KINDS, SCHEMA_VERSION, STAGES, VERDICTS
from .packed import Packed

STAGE_SET = frozenset(STAGES)
VERDICT_SET = frozenset(VERDICTS)
KIND_SET = frozenset(DIAGNOSIS_KINDS)
MAX_ROOM_CHARS = 256  # room ids, and the other names a log carries (instance, segments, pools)
MAX_ATTEMPT = (1 << 63) - 1  # the fleet engine keeps attempts as DuckDB BIGINTs: both engines refuse more
MAX_TS = 1e11  # the year 5138: anything later is not a timestamp
MAX_DIAGNOSED_CELLS = 4096  # per record; the probe writes at most diagnosis.max_cells_per_room


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


# %% a record's top level


def record_kind(rec: dict) -> str:
    """The record's `kind`, once its schema version is the one this tool reads."""
    version = rec.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise RecordError(f"v must be {SCHEMA_VERSION} (schema version this tool reads), got {_short(version)}")
    kind = rec.get("kind")
    if type(kind) is not str:
        raise RecordError(f"kind must be a string, got {_short(kind)}")
    return kind


def room_fields(rec: dict) -> tuple:
    """A `room` record's fields, checked: (room, attempt, stage, step, verdict, rid,
    digest, tokens, ts, diagnosis, page_events), the digest packed. A prefill record's
    ts, diagnosis and page_events are not read (None)."""
    room, attempt, stage = rec.get("room"), rec.get("attempt"), rec.get("stage")
    step, verdict = rec.get("step"), rec.get("verdict")
    if type(room) is not str or not room:
        raise RecordError("room must be a non-empty string")
    if len(room) > MAX_ROOM_CHARS:
        raise RecordError(f"room must be at most {MAX_ROOM_CHARS} characters")
    if not room.isascii():
        room = _printable(room)
    if type(attempt) is not int or not 0 <= attempt <= MAX_ATTEMPT:
        raise RecordError("attempt must be a non-negative integer below 2**63")
    if type(stage) is not str or stage not in STAGE_SET:
        raise RecordError(f"stage must be one of {', '.join(STAGES)}")
    if step is not None and type(step) is not int:
        raise RecordError("step must be an integer or null")
    if verdict is not None and (type(verdict) is not str or verdict not in VERDICT_SET):
        raise RecordError(f"verdict must be null or one of {', '.join(VERDICTS)}")
    instance = rec.get("instance")
    if type(instance) is str and len(instance) > MAX_ROOM_CHARS:  # the join keeps it per room; coverage prints it
        raise RecordError(f"instance must be at most {MAX_ROOM_CHARS} characters")
    rid = rec.get("rid")
    if rid is not None and (type(rid) is not str or not rid):
        raise RecordError("rid must be a non-empty string or null")
    digest = rec.get("digest")
    packed = pack_digest(digest) if digest is not None else None
    tokens = packed.n_tokens if packed is not None else rec.get("tokens")
    tokens = tokens if type(tokens) is int and 0 <= tokens < 1 << 40 else None
    if stage == "prefill_send":
        return room, attempt, stage, step, verdict, rid, packed, tokens, None, None, None
    ts = rec.get("ts")
    if ts is not None and (type(ts) not in (int, float) or not 0 <= ts <= MAX_TS):
        raise RecordError(f"ts must be null or a Unix time in seconds (0 to {MAX_TS:.0f}), got {_short(ts)}")
    diagnosis = page_events = None
    if rec.get("diagnosis") is not None:
        diagnosis = _diagnosis(rec["diagnosis"])
        if rec.get("localisation") is None:
            page_events = _page_events(rec.get("page_events"))
    return room, attempt, stage, step, verdict, rid, packed, tokens, ts, diagnosis, page_events


def hicache_branch(rec: dict) -> tuple[str, str, str, int]:
    """A HiCache branch count's (pool, direction, branch, count), checked."""
    pool, branch, direction, count = rec.get("pool"), rec.get("branch"), rec.get("direction", ""), rec.get("count", 1)
    if not isinstance(pool, str) or not isinstance(branch, str) or not isinstance(direction, str):
        raise RecordError("hicache records need string pool, branch and direction")
    if max(len(pool), len(branch), len(direction)) > MAX_ROOM_CHARS:
        raise RecordError(f"hicache pool, branch and direction must be at most {MAX_ROOM_CHARS} characters")
    pool, branch, direction = _printable(pool), _printable(branch), _printable(direction)
    if type(count) is not int or count < 0:
        raise RecordError("count must be a non-negative integer")
    return pool, direction, branch, count


# %% diagnoses and journal events

_CELL_INTS = ("layer", "page", "physical_page")
_ROOM_FIELDS = {"room": str, "layer_index": int, "page": int, "physical_page": int, "held": bool}
_EVENT_FIELDS = {"t_ns": int, "event": str, "page": int, "room": str, "host_row": int, "layer": int, "pool": str}
_LEG_SET = frozenset(("d2h", "host", "h2d"))
_ROUNDTRIP_VERDICTS = frozenset(("match", "mismatch", "unverified"))


def _plain(source: Any, fields: dict, where: str) -> dict:
    """The known `fields` of an object, each of its type (strings bounded); others dropped."""
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
        elif leg not in _LEG_SET or type(verdict) is not str or verdict not in _ROUNDTRIP_VERDICTS:
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


def roundtrip_diagnosis(rec: dict) -> dict:
    """A `roundtrip_diagnosis` HiCache record (docs/diagnosis.md), checked."""
    out = _plain(rec, {"pool": str, "host_row": int, "device_page": int, "layer": int}, "roundtrip_diagnosis")
    if "pool" not in out or "host_row" not in out or "layer" not in out:
        raise RecordError("roundtrip_diagnosis needs a string pool and integer host_row and layer")
    leg = rec.get("leg")
    if leg is not None and (type(leg) is not str or leg not in _LEG_SET):
        raise RecordError("roundtrip_diagnosis.leg must be null or one of d2h, host, h2d")
    out["leg"] = leg
    out["checks"] = _checks(rec.get("checks") or {}, "roundtrip_diagnosis.checks")
    events = rec.get("events") or []
    if type(events) is not list or len(events) > 64:
        raise RecordError("roundtrip_diagnosis.events must be a list of at most 64 events")
    out["events"] = [_event(e, f"roundtrip_diagnosis.events[{j}]") for j, e in enumerate(events)]
    return out


#: Cells and host rows of one `restore_mismatch` record the tools keep (the writer keeps 256 cells).
MAX_RESTORE_CELLS = 256
_RESTORE_CELL_FIELDS = {"layer": int, "pool_layer": int, "host_row": int, "device_page": int, "segment": str}


def restore_mismatch(rec: dict) -> dict:
    """A `restore_mismatch` HiCache record (restore verification, docs/hicache.md), checked:
    where a load wrote pages that differ from their backup (pool, host rows, cells)."""
    out = _plain(rec, {"pool": str, "layout": str, "rows": int, "cells_total": int, "instance": str}, "restore_mismatch")
    if "pool" not in out:
        raise RecordError("restore_mismatch needs a string pool")
    rows = rec.get("mismatch_rows") or []
    if type(rows) is not list or len(rows) > 1_000_000 or any(type(r) is not int for r in rows):
        raise RecordError("restore_mismatch.mismatch_rows must be a list of integer host rows")
    out["mismatch_rows"] = rows[:MAX_RESTORE_CELLS]
    out["mismatch_rows_total"] = len(rows)
    cells = rec.get("cells") or []
    if type(cells) is not list or len(cells) > MAX_RESTORE_CELLS:
        raise RecordError(f"restore_mismatch.cells must be a list of at most {MAX_RESTORE_CELLS} cells")
    out["cells"] = [_plain(c, _RESTORE_CELL_FIELDS, f"restore_mismatch.cells[{j}]") for j, c in enumerate(cells)]
    out.setdefault("cells_total", len(out["cells"]))
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
        if type(cell) is not dict or type(cell.get("kind")) is not str or cell["kind"] not in KIND_SET:
            raise RecordError(f"{where}.kind must be one of {', '.join(DIAGNOSIS_KINDS)}")
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


# %% the digest

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
        # every room's prefill digest is kept, and a mismatch prints its segment names
        if any(len(x) > MAX_ROOM_CHARS for x in segments):
            raise RecordError(f"digest.segments must be names of at most {MAX_ROOM_CHARS} characters")
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
    """Validate a record's ``digest`` object and pack it; RecordError names the field."""
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
