"""What `diff` hands back besides its table: the exit status and the JSON document.

Library code, so the fault rig's verification (`testbed/faults/verify.py`)
judges a run by the very same JSON and status the command gives, without
importing the CLI. Format: docs/roomlog.md.
"""

from __future__ import annotations

import json
import sys
from typing import Any, BinaryIO, Callable

from . import coverage
from .printable import json_safe
from .results import Analysis


def sides(analysis: Analysis) -> dict[str, Any]:
    """Whether both sides' logs are here, and what decode said live where the logs cannot judge.

    `missing` is "prefill" when decode logged rooms and no key has a prefill record, "decode"
    when prefill logged rooms and decode none, "pairs" when both logged rooms and none of
    them has records of both sides (other pods' logs, another time, a `cluster` label or an
    attempt that differs: nothing was compared), else None. `live_mismatch` counts the rooms
    (and decode records) whose live verdict was `mismatch` while the logs leave them
    `unverified` (no prefill record to compare with): decode found corruption the logs
    cannot confirm, which `diff` must not pass as an all-clear (the on-call often has only
    the alerting pod's logs). Read from the judged rooms both engines hand over: the rooms
    the fleet engine judged in SQL all had both sides and matched."""
    clean = getattr(analysis, "clean_rooms", 0)
    both = clean  # rooms with records of both sides
    live_rooms = live_records = 0
    for room in analysis.rooms.values():
        both += room.has_prefill
        n = 0
        for s in room.stages:
            if s.live_verdict == "mismatch" and s.verdict == "unverified":
                n += 1
        if n:
            live_rooms += 1
            live_records += n
    decode_rooms = len(analysis.rooms) + clean
    with_prefill = both + analysis.prefill_only
    missing = None
    if decode_rooms and not with_prefill:
        missing = "prefill"
    elif analysis.prefill_only and not decode_rooms:
        missing = "decode"
    elif decode_rooms and not both:  # both sides logged, never the same room: nothing was compared
        missing = "pairs"
    return {"missing": missing, "decode_rooms": decode_rooms, "prefill_rooms": with_prefill,
            "live_mismatch": {"rooms": live_rooms, "records": live_records}}


def exit_status(analysis: Analysis, *, strict: bool = False) -> int:
    """0 every verified room matches; 1 a mismatch, a broken HiCache round trip, or a live
    mismatch the logs cannot judge (strict: also a not-comparable or unverified room);
    2 no room records, skipped lines, one side's logs missing, no room of both sides, or
    conflicting prefill records (docs/roomlog.md)."""
    verdicts = analysis.room_verdicts()
    if verdicts["mismatch"] or analysis.roundtrip_n or analysis.restore_n:  # a HiCache row broken upstream of the digests too
        return 1
    seen = sides(analysis)
    if seen["live_mismatch"]["rooms"]:  # decode said mismatch live; the logs here cannot say otherwise
        return 1
    if not analysis.rooms and not analysis.prefill_only:
        return 2
    if analysis.n_errors or seen["missing"] or analysis.prefill_conflicts():
        return 2  # conflicting prefill records: rooms the logs cannot judge (two clusters unlabelled, ...)
    if strict and (verdicts["not_comparable"] or verdicts["unverified"]):
        return 1
    return 0


def _stdlib_json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()  # ASCII: escapes even lone surrogates


try:  # present wherever SGLang is, and much faster on a million rooms
    from orjson import dumps as _orjson_dumps
except ImportError:
    _orjson_dumps = None


def _json_bytes(obj: Any) -> bytes:
    """Compact JSON; DEL, C1 and bidi controls in its strings written as escapes (`json_safe`),
    so ``--json -`` on a terminal never runs a control sequence from a log."""
    if _orjson_dumps is not None:
        try:
            return json_safe(_orjson_dumps(obj))
        except TypeError:  # a file name with undecodable bytes (a lone surrogate)
            pass
    return _stdlib_json_bytes(obj)


json_bytes = _json_bytes  # public: the fleet engine writes rooms with the very same bytes


def json_head(analysis: Analysis, status: int) -> dict[str, Any]:
    """What the diff's JSON document says before its rooms (both join engines write it)."""
    return {
        "tool": "dsv4-idxk-probe diff",
        "format": 1,
        "exit_status": status,
        "inputs": analysis.files,
        "summary": analysis.summary(),
        "errors": analysis.errors,
        "sides": sides(analysis),
        "coverage": coverage.per_instance(analysis),
    }


def write_document(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Hand `write` the binary file at `path`, or standard output for "-" (flushed around it,
    so the document does not interleave with text printed before)."""
    if path == "-":
        sys.stdout.flush()
        write(sys.stdout.buffer)
        sys.stdout.buffer.flush()
        return
    with open(path, "wb") as f:
        write(f)


def write_json(analysis: Analysis, path: str, status: int) -> None:
    """Summary first, then one room per line inside the array, streamed (a million rooms fit),
    then the rooms only prefill logged: unverified, since no decode record names them."""
    head = json_head(analysis, status)
    write_document(path, lambda f: _write_json_to(f, analysis, head))


def _write_json_to(f: BinaryIO, analysis: Analysis, head: dict[str, Any]) -> None:
    f.write(_json_bytes(head)[:-1])
    f.write(b',"rooms":[\n')
    separator = b""
    for room in analysis.rooms.values():
        f.write(separator)
        f.write(_json_bytes(room.to_json()))
        separator = b",\n"
    f.write(b'\n],"prefill_only":[\n')
    separator = b""
    for key in analysis.prefill_only_keys:
        f.write(separator)
        entry = {"room": key[0], "attempt": key[1], "verdict": "unverified",
                 "reason": "prefill sent it; no decode record in these logs"}
        if len(key) > 2:  # (room, attempt, cluster)
            entry["cluster"] = key[2]
        rid = analysis.prefill_only_rids.get(key)
        if rid is not None:
            entry["rid"] = {"prefill": rid, "decode": None}
        f.write(_json_bytes(entry))
        separator = b",\n"
    f.write(b"\n]}\n")
