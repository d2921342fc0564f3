"""Which room's cell holds these bytes: content digests of the rooms decode holds.

Per room, one uint64 array [layers, pages, segments] of content digests
(docs/diagnosis.md), its physical pages and each page's frozen slot count:
8 bytes a cell plus the page list. Three kinds of entries:

* `held`: a room decode holds now, its content at its last digest that
  matched prefill (a swapped-in page is found here: `other_room`);
* `freed`: the last occupant of pages decode released (a stale page or a
  write that never landed shows its bytes: `previous_occupant`);
* `before`: what a room's own pages held when they were allocated to it,
  before the transfer wrote them, digested with the room's own frozen slot
  counts, so it compares exactly with what the room holds later.

Bound: `max_cells` cells over all entries (freed and before entries are
dropped first, oldest first, then held rooms, oldest first). Lookups scan
the entries with NumPy, on the collector thread, only when a room mismatched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Entry:
    room: str
    pages: np.ndarray  # int64 [pages]: physical page of each logical page
    content: np.ndarray  # uint64 [layers, pages, segments]
    frozen: np.ndarray  # int [pages]: frozen slots of each logical page
    cells: int = field(init=False, default=0)  # content.size, kept: the bound's bookkeeping reads it at every update

    def __post_init__(self):
        self.cells = int(self.content.size)

    @property
    def nbytes(self) -> int:
        return int(self.content.nbytes + self.pages.nbytes + self.frozen.nbytes) + 200


@dataclass(frozen=True)
class Found:
    room: str
    layer_index: int
    page: int  # logical page in that room
    physical_page: int
    kind: str  # "held" | "freed"


class ContentIndex:
    def __init__(self, max_cells: int = 4_000_000):
        if max_cells < 1:
            raise ValueError("max_cells must be at least 1")
        self.max_cells = max_cells
        self._held: OrderedDict[str, Entry] = OrderedDict()
        self._freed: OrderedDict[str, Entry] = OrderedDict()
        self._before: OrderedDict[str, Entry] = OrderedDict()
        self._cells = 0
        self.evicted = 0
        self._lock = threading.Lock()

    # %% updates (collector thread)

    def _put(self, table: OrderedDict, entry: Entry) -> None:
        old = table.pop(entry.room, None)
        if old is not None:
            self._cells -= old.cells
        table[entry.room] = entry
        self._cells += entry.cells
        while self._cells > self.max_cells:
            for victims in (self._before, self._freed, self._held):
                if victims:
                    _, gone = victims.popitem(last=False)
                    self._cells -= gone.cells
                    self.evicted += 1
                    break
            else:
                break

    def hold(self, room: str, pages, content: np.ndarray, frozen) -> Entry:
        """Room `room`'s verified content (replaces what was kept for it); the entry made."""
        entry = Entry(room, np.asarray(pages, dtype=np.int64).reshape(-1), np.array(content, dtype=np.uint64),
                      np.asarray(frozen).reshape(-1))
        with self._lock:
            self._put(self._held, entry)
        return entry

    def renew(self, room: str, entry: Entry | None, content: np.ndarray) -> bool:
        """`hold` again for a room that matched again with the content `entry` (made by its
        last `hold`) keeps: the entry becomes the newest held one, as a replacement would
        make it, with no new entry and no copy. False, and nothing done, when the index no
        longer holds `entry` for the room (replaced, evicted, released) or the content
        differs: the caller then holds it."""
        if entry is None:
            return False
        with self._lock:
            if self._held.get(room) is not entry:
                return False
            kept = entry.content
            if kept.shape != content.shape or kept.tobytes() != content.tobytes():
                return False
            self._held.move_to_end(room)
        return True

    def before(self, room: str, pages, content: np.ndarray, frozen) -> None:
        """What `room`'s pages held when they were allocated to it."""
        entry = Entry(room, np.asarray(pages, dtype=np.int64).reshape(-1), np.array(content, dtype=np.uint64),
                      np.asarray(frozen).reshape(-1))
        with self._lock:
            self._put(self._before, entry)

    def release(self, room: str) -> None:
        """The room's pages were freed: its content is now their last occupant's."""
        with self._lock:
            before = self._before.pop(room, None)
            if before is not None:
                self._cells -= before.cells
            entry = self._held.pop(room, None)
            if entry is not None:
                self._cells -= entry.cells
                self._put(self._freed, entry)

    def forget(self, room: str) -> None:
        with self._lock:
            for table in (self._held, self._before):
                entry = table.pop(room, None)
                if entry is not None:
                    self._cells -= entry.cells

    def drop_before(self, room: str) -> None:
        with self._lock:
            entry = self._before.pop(room, None)
            if entry is not None:
                self._cells -= entry.cells

    # %% lookups (collector thread, on a mismatch)

    def held_content(self, room: str) -> Entry | None:
        with self._lock:
            return self._held.get(room)

    def before_content(self, room: str) -> Entry | None:
        with self._lock:
            return self._before.get(room)

    def find_all(self, digest: int, segment: int, *, skip: tuple[str, int, int] | None = None,
                 limit: int = 4) -> list[Found]:
        """Cells of other rooms (or other cells of the same room) with content `digest` in
        segment `segment`: held rooms first, newest first, then freed ones; at most `limit`.
        Content 0 (a cell with no frozen slot, or one masked out) names nothing."""
        if int(digest) == 0:
            return []
        with self._lock:
            tables = [("held", list(self._held.values())), ("freed", list(self._freed.values()))]
        want = np.uint64(digest)
        found: list[Found] = []
        for kind, entries in tables:
            for entry in reversed(entries):
                if segment >= entry.content.shape[2]:
                    continue
                for layer_index, page in np.argwhere(entry.content[:, :, segment] == want):
                    if skip is not None and (entry.room, int(layer_index), int(page)) == skip:
                        continue
                    found.append(Found(entry.room, int(layer_index), int(page), int(entry.pages[page]), kind))
                    if len(found) >= limit:
                        return found
        return found

    def last_occupant(self, physical_page: int, layer_index: int, segment: int, digest: int,
                      not_room: str) -> str | None:
        """A freed room that held `physical_page` with this content in this layer and segment."""
        with self._lock:
            entries = list(self._freed.values())
        for entry in reversed(entries):
            if entry.room == not_room:
                continue
            at = np.flatnonzero(entry.pages == physical_page)
            if at.size and int(entry.content[layer_index, at[-1], segment]) == int(digest):
                return entry.room
        return None

    # %% size

    @property
    def cells(self) -> int:
        return self._cells

    def __len__(self) -> int:
        return len(self._held) + len(self._freed) + len(self._before)

    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for t in (self._held, self._freed, self._before) for e in t.values())
