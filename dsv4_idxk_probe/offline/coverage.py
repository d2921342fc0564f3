"""Coverage per instance, from the room logs: how many rooms, and how many index-K bytes, each
writer instance had verified, and what became of the rest (with the reason the join gave).

`diff` prints it and writes it as `coverage` in its JSON (docs/fleet.md, "Coverage"). What it
is computed from, so an operator can judge it:

- a room (a key of the join) belongs to the instance of its first decode record (the
  instance that verified it), or of its first prefill record when decode logged none;
- its outcome is its verdict's: `match` and `mismatch` are **verified** (the digests were
  compared), `unverified`, `not_comparable` and `skipped` are not; a room only prefill
  logged is `unverified` ("no decode record");
- its reason is the join's reason at its worst stage, cut at the first ":" so that it stays
  a handful of values ("layers differ: 4 layers (0..3) vs ..." counts as "layers differ");
- its bytes are the index-K bytes its digest covers: layers x pages x the layout's row bytes
  (the first prefill record's digest; the first decode record's when prefill logged none).
  A record without a digest, or of a layout this package does not ship, has no size: such
  rooms are counted as "of unknown size", never guessed.

Both join engines feed it: the reference join's rooms carry what `join._Joiner._note_meta`
read; the fleet engine adds the rooms it judged in SQL (all verified, or prefill-only) as
grouped rows (`clean_coverage`). Kept apart from the outputs so the table and the JSON say
the same.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable

from ..digest.layout import LayoutError, get_layout
from ..vocabulary import SEVERITY

OUTCOME = {"match": "verified", "mismatch": "verified", "unverified": "unverified",
           "not_comparable": "not_comparable", "skipped": "skipped"}
PREFILL_ONLY_REASON = "no decode record in these logs"
MAX_REASONS = 8  # per instance; the rest are counted under OTHER_REASONS
OTHER_REASONS = "(other reasons)"
MAX_REASON_CHARS = 80


@lru_cache(maxsize=64)
def row_bytes(layout: str) -> int | None:
    """Bytes of one index-K row (one page of one layer) of a shipped layout; None otherwise."""
    try:
        return get_layout(layout).row_bytes
    except (LayoutError, TypeError):
        return None


def _short(reason: str) -> str:
    head = reason.split(":", 1)[0].strip() or "-"
    return head if len(head) <= MAX_REASON_CHARS else head[:MAX_REASON_CHARS] + "..."


class _Instance:
    __slots__ = ("rooms", "bytes", "unknown", "verified_rooms", "verified_bytes", "other")

    def __init__(self) -> None:
        self.rooms = self.bytes = self.unknown = self.verified_rooms = self.verified_bytes = 0
        self.other: dict[tuple[str, str], list[int]] = {}

    def add(self, outcome: str, reason: str, rooms: int, nbytes: int | None) -> None:
        self.rooms += rooms
        if nbytes is None:
            self.unknown += rooms
            nbytes = 0
        self.bytes += nbytes
        if outcome == "verified":
            self.verified_rooms += rooms
            self.verified_bytes += nbytes
            return
        slot = (outcome, _short(reason))
        if slot not in self.other and len(self.other) >= MAX_REASONS:
            slot = (outcome, OTHER_REASONS)
        counts = self.other.setdefault(slot, [0, 0])
        counts[0] += rooms
        counts[1] += nbytes


def _worst_reason(room) -> str:
    worst = max(room.stages, key=lambda s: SEVERITY[s.verdict])
    return worst.reason or ""


def per_instance(analysis: Any) -> list[dict[str, Any]] | None:
    """One entry per instance, sorted by name: rooms and bytes, verified and not (by outcome
    and reason). Both engines give the same list for the same logs. None for a selection
    of rooms (`--rid`): coverage is a property of a whole log set."""
    if analysis.selected:
        return None
    by: dict[str, _Instance] = {}
    meta = analysis.room_meta
    for key, room in analysis.rooms.items():
        instance, nbytes = meta.get(key, ("", None))[:2]
        by.setdefault(instance, _Instance()).add(OUTCOME[room.verdict], _worst_reason(room), 1, nbytes)
    for key in analysis.prefill_only_keys:
        instance, nbytes = meta.get(key, ("", None))[:2]
        by.setdefault(instance, _Instance()).add("unverified", PREFILL_ONLY_REASON, 1, nbytes)
    for outcome, instance, layout, cells, rooms in getattr(analysis, "clean_coverage", ()):
        row = row_bytes(layout) if layout else None
        nbytes = None if row is None or cells is None else int(cells) * row * int(rooms)
        by.setdefault(instance or "", _Instance()).add(
            outcome, PREFILL_ONLY_REASON if outcome != "verified" else "", int(rooms), nbytes)
    out = []
    for instance in sorted(by):
        c = by[instance]
        others = sorted(c.other.items(), key=lambda kv: (-kv[1][0], kv[0]))
        out.append({
            "instance": instance,
            "rooms": c.rooms,
            "verified_rooms": c.verified_rooms,
            "bytes": c.bytes,
            "verified_bytes": c.verified_bytes,
            "rooms_of_unknown_size": c.unknown,
            "not_verified": [{"outcome": o, "reason": r, "rooms": n, "bytes": b} for (o, r), (n, b) in others],
        })
    return out


def size(n: int) -> str:
    """Bytes for people: 1.5 MiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def lines(rows: Iterable[dict[str, Any]], show=str) -> list[str]:
    """The coverage table as text lines (each user-supplied text passed through `show`)."""
    rows = list(rows)
    if not rows:
        return []
    out = ["coverage per instance (docs/fleet.md): rooms by the instance of their first decode record",
           "(else prefill's); bytes = layers x pages x row bytes of each room's digest"]
    for r in rows:
        name = show(r["instance"]) or "(no instance)"
        line = (f"  {name}: verified {r['verified_rooms']:,} of {r['rooms']:,} rooms "
                f"({_pct(r['verified_rooms'], r['rooms'])}), {size(r['verified_bytes'])} of {size(r['bytes'])} "
                f"({_pct(r['verified_bytes'], r['bytes'])})")
        if r["rooms_of_unknown_size"]:
            line += f"; {r['rooms_of_unknown_size']:,} rooms of unknown size"
        out.append(line)
        for item in r["not_verified"]:
            out.append(f"    {item['outcome']} {item['rooms']:,} rooms, {size(item['bytes'])}: {show(item['reason'])}")
    return out
