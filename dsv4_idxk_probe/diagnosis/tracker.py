"""Diagnosis for one decode monitor: keeps the content index and reads the journal.

The monitor calls it on the collector thread: the journal events of a room
(`allocated`, `landed`, `freed`, each stamped with the time the serving thread
saw it, `at_ns`, and put in its place in the journal's time order) come with
the digest results that carried them, and the room's page ids are copied to
the host there, once, behind an event the collector has waited for
(`host_ids.capture`). With each room digest's content digests: a matching
digest becomes the room's verified content in the index; a mismatching one
is diagnosed cell by cell (`diagnose_cells`), against the last verified
content when the room has one (which names exactly the cells that changed),
else the localisation's bound. Only an allocation without a snapshot digest
journals on the serving thread (nothing else orders its page ids' copy).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..digest.layout import RowLayout
from ..digest.room_table import frozen_slots_per_page
from .content import zero_table
from .content_index import ContentIndex
from .diagnose import bad_cells, diagnose_cells
from .host_ids import HostIds, capture, host_ints
from .journal import PageJournal, on_index_k_pages


@dataclass
class _Track:
    pages: np.ndarray  # host copy of the room's physical pages
    frozen: np.ndarray
    zero: np.ndarray
    last_good_ns: int | None = None
    last_seen_ns: int | None = None
    # the index entry its last match made, weakly: a track never keeps an evicted entry alive
    held: weakref.ref | None = None


class DecodeDiagnosis:
    def __init__(self, layout: RowLayout, layer_ids: Sequence[int], journal: PageJournal | None,
                 index: ContentIndex, *, max_cells: int = 64, max_tracks: int = 100_000):
        self.layout = layout
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.journal = journal
        self.index = index
        self.max_cells = max_cells
        self.max_tracks = max_tracks
        self._tracks: dict[str, _Track] = {}
        self._captured: dict[str, tuple[Any, Any]] = {}  # room -> (its page table, host_ids.capture of it)
        self._lock = threading.Lock()
        # looked up once: `zero_cell_digests` would hash the layout again for every room
        self._zeros = zero_table(layout)

    # %% room events (O(1); `at_ns`: when the serving thread saw the event, else now)

    def allocated(self, key: str, pages: Any, *, deferred: bool = False, at_ns: int | None = None) -> HostIds | None:
        """`deferred`: the page ids' copy, when this call queues it, is returned unsettled,
        for the caller to settle with the event of the launch it queues next (or none)."""
        ids, fresh = self._capture(key, pages, deferred)  # also marks the room live until its free (see `before`)
        if self.journal is not None:
            self.journal.record_captured("allocated", ids, key, at_ns)
        return ids if deferred and fresh and isinstance(ids, HostIds) else None

    def landed(self, key: str, pages: Any, at_ns: int | None = None) -> None:
        if self.journal is not None:
            self.journal.record_captured("transfer_landed", self._ids(key, pages), key, at_ns)

    def freed(self, key: str, pages: Any, at_ns: int | None = None) -> None:
        if self.journal is not None:
            self.journal.record_captured("freed", self._ids(key, pages), key, at_ns)

    def _ids(self, key: str, pages: Any) -> Any:
        return self._capture(key, pages)[0]

    def _capture(self, key: str, pages: Any, deferred: bool = False) -> tuple[Any, bool]:
        """The room's page ids on their way to the host, and whether this call queued
        their copy: captured once per page table (allocation, landing and free hand the
        hooks the same tensor), so a room costs one device-to-host copy, queued at its
        first event. Kept until the collector retires the room (or it is abandoned), not
        only until its free: the collector may still be behind, with the room's snapshot
        and digests queued (see `before`)."""
        with self._lock:
            known = self._captured.get(key)
        if known is not None and known[0] is pages:
            return known[1], False
        ids = capture(pages, deferred=deferred)
        with self._lock:
            self._captured[key] = (pages, ids)
            while len(self._captured) > self.max_tracks:
                self._captured.pop(next(iter(self._captured)))
        return ids, True

    # %% collector thread

    def _track(self, key: str, pages: Any, n_tokens: int) -> _Track:
        with self._lock:
            track = self._tracks.get(key)
        if track is None:
            host = host_ints(self._ids(key, pages))
            frozen = frozen_slots_per_page(self.layout, len(host), n_tokens)
            track = _Track(host, frozen, self._zeros[frozen])  # zero_cell_digests(layout, frozen)
            with self._lock:
                self._tracks[key] = track
                while len(self._tracks) > self.max_tracks:
                    self._tracks.pop(next(iter(self._tracks)))
        return track

    def before(self, key: str, pages: Any, n_tokens: int, content: np.ndarray) -> None:
        """What the room's pages held when they were allocated to it: dropped when the
        room was abandoned before this snapshot came back (it would otherwise make a track
        nobody retires). A room merely freed meanwhile keeps it: its digests, queued after
        the snapshot, still come and use it, and the room is retired after the last."""
        with self._lock:
            live = key in self._captured
        if not live:
            return
        track = self._track(key, pages, n_tokens)
        self.index.before(key, track.pages, content, track.frozen)

    def observe(self, key: str, pages: Any, n_tokens: int, digested_ns: int, content: np.ndarray | None,
                verdict: str, comparison: Any) -> tuple[list[dict], dict | None] | None:
        """A digest of room `key` was judged: remember verified content, diagnose a mismatch.

        Returns (cells, page events) for a mismatch, else None. Page events (logical page ->
        its journal events) come only with a mismatch decode could not localise: the
        diff, which localises from the logs, then names the cells and shows their events."""
        if content is None:
            return None
        track = self._track(key, pages, n_tokens)
        if verdict == "match":
            # the common case, every digest of a clean room: its content is the one its last
            # match kept, so that entry is only renewed
            if not self.index.renew(key, track.held() if track.held is not None else None, content):
                track.held = weakref.ref(self.index.hold(key, track.pages, content, track.frozen))
            track.last_good_ns = digested_ns
            return None
        if verdict != "mismatch":
            return None
        held = self.index.held_content(key)
        reference = held.content if held is not None and track.last_good_ns is not None else None
        rows, segs, pages_bad = [], [], []
        if comparison is not None and comparison.verdict == "mismatch":
            where = {layer: i for i, layer in enumerate(self.layer_ids)}
            names = {name: i for i, name in enumerate(self.layout.segment_names)}
            for layer, segment in comparison.layer_segments:
                rows.append(where[int(layer)])
                segs.append(names[segment])
            pages_bad = list(comparison.pages)
        elif reference is None:
            return self._unlocalised(key, track, content, digested_ns)
        cells, exact = bad_cells(content, reference, rows, pages_bad, segs)
        if held is None and comparison is not None and comparison.verdict == "mismatch":
            # Never verified, but localised: its other cells match prefill's, so another
            # room's page that now holds their bytes can still be named (a swap partner
            # that has a fault of its own). Kept only until the room matches.
            verified = content.copy()
            for layer_index, page, segment in cells:
                verified[layer_index, page, segment] = 0  # 0 is no frozen cell's content: never found
            self.index.hold(key, track.pages, verified, track.frozen)
        cells = cells[: self.max_cells]
        found = diagnose_cells(
            key, cells, content, track.zero, track.pages, self.layer_ids, self.layout.segment_names,
            self.index, self.journal, since_ns=track.last_good_ns, until_ns=digested_ns, exact=exact,
            frozen=track.frozen,
        )
        return [d.to_record() for d in found], None

    def _unlocalised(self, key: str, track: _Track, content: np.ndarray, digested_ns: int):
        """No localisation and no verified content (the prefill vectors did not come): the
        cells whose bytes are zero or what the page held before the transfer are suspects
        (`exact` false); the diff names the rest from its own localisation."""
        before = self.index.before_content(key)
        frozen = (track.frozen > 0)[None, :, None]
        suspect = frozen & (content == track.zero[None, :, :])
        if before is not None and before.content.shape == content.shape:
            suspect |= frozen & (content == before.content)
        cells = [tuple(int(v) for v in ix) for ix in np.argwhere(suspect)][: self.max_cells]
        found = diagnose_cells(
            key, cells, content, track.zero, track.pages, self.layer_ids, self.layout.segment_names,
            self.index, self.journal, since_ns=track.last_good_ns, until_ns=digested_ns, exact=False,
            frozen=track.frozen,
        )
        events = {}
        if self.journal is not None:
            for page in range(min(len(track.pages), self.max_cells)):
                found_events = self.journal.events_for(int(track.pages[page]), track.last_good_ns, digested_ns,
                                                       pools=on_index_k_pages)
                if found_events:
                    events[str(page)] = found_events
        return [d.to_record() for d in found], events

    def retired(self, key: str) -> None:
        """The room's pages were released (finished) or it stopped being tracked."""
        with self._lock:
            self._tracks.pop(key, None)
            self._captured.pop(key, None)
        self.index.release(key)

    def abandoned(self, key: str) -> None:
        with self._lock:
            self._tracks.pop(key, None)
            self._captured.pop(key, None)
        self.index.forget(key)


def decode_diagnosis(config: Any, layout: RowLayout, layer_ids: Sequence[int],
                     journal: PageJournal | None = None) -> DecodeDiagnosis | None:
    """Decode's diagnosis from the probe config's `diagnosis` section; None when it is off.
    `journal`: the process's page journal (one is made when the caller has none)."""
    cfg = getattr(config, "diagnosis", None)
    if cfg is None or not cfg.enabled:
        return None
    if journal is None:
        journal = PageJournal(cfg.journal_events, cfg.journal_per_page)
    return DecodeDiagnosis(layout, layer_ids, journal, ContentIndex(cfg.index_cells), max_cells=cfg.max_cells_per_room)
