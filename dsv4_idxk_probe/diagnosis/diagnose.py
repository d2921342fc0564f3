"""Name what happened to each bad cell, from its content digest and the page journal.

For a bad cell (layer, logical page, segment) of room R, held in physical
page X, with content digest d, in this order:

1. `zeroed`: d is the content digest of an all-zero cell (same frozen slots);
2. `previous_occupant`: d is what X held when it was allocated to R, or what
   X's last occupant left in it (a stale page, a write that never landed);
3. `other_room`: d is a cell of another room decode holds or freed (a swap,
   a double mapping), named with its room, layer and logical page;
4. `unknown`: none of these (a flipped bit, a torn write, memory nobody
   wrote through a hook).

Each diagnosis carries the journal's events on X between the room's last
digest that matched and the first that did not: the operations that can
have done it, the last of them first suspect.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..vocabulary import DIAGNOSIS_KINDS
from .content_index import ContentIndex
from .journal import PageJournal, on_index_k_pages

KINDS = DIAGNOSIS_KINDS
MAX_CANDIDATES = 8  # other rooms named for one cell (identical prompts give identical pages)


@dataclass
class CellDiagnosis:
    layer: int  # global layer id
    page: int  # logical page
    segment: str
    kind: str
    physical_page: int | None = None
    rooms: list[dict] = field(default_factory=list)  # other_room: [{room, layer, page}]; previous_occupant: [{room}]
    events: list[dict] = field(default_factory=list)
    exact: bool = True  # False: a cell of a localisation bound, not known to differ

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "page": self.page, "segment": self.segment, "kind": self.kind}
        if self.physical_page is not None:
            out["physical_page"] = self.physical_page
        if self.rooms:
            out["rooms"] = self.rooms
        if self.events:
            out["events"] = self.events
        if not self.exact:
            out["exact"] = False
        return out


def bad_cells(observed: np.ndarray, reference: np.ndarray | None, layer_rows: Sequence[int], pages: Sequence[int],
              segment_index: Sequence[int]) -> tuple[list[tuple[int, int, int]], bool]:
    """The cells to diagnose: exactly those whose content differs from `reference` (the
    room's last matching content) when there is one, else the localisation's cross
    product (layer_rows x pages x segments), flagged as not exact unless it is one cell
    per (layer, segment) and page."""
    if reference is not None and reference.shape == observed.shape:
        return [tuple(int(v) for v in ix) for ix in np.argwhere(observed != reference)], True
    cells = [(li, p, si) for li, si in zip(layer_rows, segment_index) for p in pages]
    return cells, len(set(pages)) <= 1 or len(set(zip(layer_rows, segment_index))) <= 1


def diagnose_cells(
    room: str,
    cells: Sequence[tuple[int, int, int]],
    observed: np.ndarray,
    zero: np.ndarray,
    physical_pages: Sequence[int] | None,
    layer_ids: Sequence[int],
    segments: Sequence[str],
    index: ContentIndex | None,
    journal: PageJournal | None,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    exact: bool = True,
    frozen: Sequence[int] | None = None,
) -> list[CellDiagnosis]:
    """One diagnosis per cell (layer index, logical page, segment index) of `room`.

    `observed` is the room's content digests now, uint64 [layers, pages, segments];
    `zero` the all-zero cell's, uint64 [pages, segments].
    """
    before = index.before_content(room) if index is not None else None
    allocated = journal.allocated_at(room) if journal is not None else None
    out = []
    for li, p, si in cells:
        if frozen is not None and frozen[p] <= 0:
            continue  # no frozen byte: nothing there can differ
        d = int(observed[li, p, si])
        phys = int(physical_pages[p]) if physical_pages is not None and p < len(physical_pages) else None
        diagnosis = CellDiagnosis(int(layer_ids[li]), int(p), segments[si], "unknown", phys, exact=exact)
        if d == int(zero[p, si]):
            diagnosis.kind = "zeroed"
        elif before is not None and before.content.shape == observed.shape and d == int(before.content[li, p, si]):
            diagnosis.kind = "previous_occupant"
            owner = _previous_owner(index, journal, phys, li, si, d, room, allocated)
            diagnosis.rooms = [{"room": owner}] if owner is not None else []
        elif index is not None:
            _match_elsewhere(diagnosis, index, d, li, si, room, phys)
        if journal is not None and phys is not None:
            diagnosis.events = journal.events_for(phys, since_ns, until_ns, pools=on_index_k_pages)
        out.append(diagnosis)
    return out


def _previous_owner(index, journal, phys, li, si, d, room, allocated) -> str | None:
    if phys is None:
        return None
    owner = index.last_occupant(phys, li, si, d, room) if index is not None else None
    if owner is None and journal is not None and allocated is not None:
        owner = journal.previous_owner(phys, allocated, room)
    return owner


def _match_elsewhere(diagnosis: CellDiagnosis, index: ContentIndex, d: int, li: int, si: int, room: str,
                     phys: int | None) -> None:
    if phys is not None:
        owner = index.last_occupant(phys, li, si, d, room)
        if owner is not None:
            diagnosis.kind, diagnosis.rooms = "previous_occupant", [{"room": owner}]
            return
    found = index.find_all(d, si, skip=(room, li, diagnosis.page), limit=MAX_CANDIDATES)
    if found:
        diagnosis.kind = "other_room"
        diagnosis.rooms = [{"room": f.room, "layer_index": f.layer_index, "page": f.page,
                            "physical_page": f.physical_page, "held": f.kind == "held"} for f in found]


# %% summaries (diff, report, the demo)


def culprit(events: Sequence[dict]) -> str | None:
    """The last operation on the page before the bad digest: the first suspect. A logged
    event's fields are all optional (`offline.validation`), its name too: None when absent."""
    return events[-1].get("event") if events else None


EVENT_PHRASES = {
    "allocated": "an allocation", "transfer_landed": "the transfer landed", "hicache_load": "a HiCache load",
    "hicache_backup": "a HiCache backup", "freed": "a free",
}


def summarise(diagnoses: Sequence[dict]) -> list[str]:
    """Lines such as "12 cells zeroed after a hicache_load; 3 cells hold another room's page"."""
    counts: Counter = Counter()
    for d in diagnoses:
        counts[(d.get("kind", "unknown"), culprit(d.get("events") or ()))] += 1
    phrases = {  # (one cell, several cells)
        "zeroed": ("zeroed", "zeroed"),
        "other_room": ("holds another room's page", "hold another room's page"),
        "previous_occupant": ("holds the page's previous occupant", "hold the page's previous occupant"),
        "unknown": ("changed to bytes no known page holds", "changed to bytes no known page holds"),
    }
    lines = []
    for (kind, last), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][1] or "")):
        after = f" after {EVENT_PHRASES.get(last, last)}" if last else ""
        phrase = phrases.get(kind, (kind, kind))[n != 1]
        lines.append(f"{n} cell{'s' if n != 1 else ''} {phrase}{after}")
    return lines


def describe_room(cells: Sequence[dict], width: int = 60) -> str:
    """One room's diagnosis in a table cell: "zeroed x2 after transfer_landed; other_room 11/0 P0"."""
    if not cells:
        return "-"
    parts = []
    by_kind: dict[str, list[dict]] = {}
    for cell in cells:
        by_kind.setdefault(cell.get("kind", "unknown"), []).append(cell)
    for kind in KINDS:
        group = by_kind.get(kind)
        if not group:
            continue
        text = f"{kind} x{len(group)}" if len(group) > 1 else kind
        names = sorted({_name(r) for c in group for r in c.get("rooms") or ()})
        if names:
            text += " " + ",".join(names[:3]) + ("..." if len(names) > 3 else "")
        last = {culprit(c.get("events") or ()) for c in group} - {None}
        if last:
            text += " after " + "/".join(sorted(last))
        parts.append(text)
    line = "; ".join(parts)
    return line if len(line) <= width else line[: width - 3] + "..."


def _name(room: dict) -> str:
    name = str(room.get("room", "?"))
    return f"{name} P{room['page']}" if room.get("page") is not None else name
