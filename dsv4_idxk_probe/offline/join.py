"""The join: prefill and decode records by (room, attempt), each decode stage judged.

`analyse` is the entry point of `diff` and `report`. Verdicts are recomputed
from the digests in the logs (the decode side's live verdict is kept only to
count disagreements): each decode stage's digest is compared with the prefill
record of the same (room, attempt) through `digest.result.compare`, which also
localises a mismatch. A decode record with no prefill record is `unverified`.
Bad lines are collected with their file:line and skipped.

Speed: a million rooms must diff in under a minute on one core, so digests stay
packed (`packed.py`); identical digests (the common case) are a match without
unpacking, anything else goes through `compare`. Every record costs the same
whatever its room already holds: a room's stages are indexed by (stage, step,
transfer, digest) once it has more than a few, so a room of 100,000 records joins
in linear time (it was quadratic).

Records of one room id from two clusters are two rooms when their records carry
a `cluster` (config ``roomlog.cluster``): the key is then (room, attempt, cluster).
"""

from __future__ import annotations

import gc
import logging
from contextlib import closing
from pathlib import Path
from typing import Iterable

from ..digest.result import Comparison, compare
from ..roomlog.reader import read_file
from .coverage import row_bytes
from .packed import Packed
from .printable import clip
from .results import Analysis, Key, RoomResult, StageResult, room_sort_key
from .validation import (
    MAX_DIAGNOSED_CELLS,
    RecordError,
    hicache_branch,
    record_kind,
    room_fields,
    restore_mismatch,
    roundtrip_diagnosis,
)

DECISIVE = ("match", "mismatch", "not_comparable")
MAX_CLUSTER_CHARS = 128  # a cluster label (config roomlog.cluster) is a short name
MAX_KIND_CHARS = 64  # record kinds are counted under at most this many characters...
MAX_KINDS = 64  # ...and at most this many distinct ones; the rest as OTHER_KINDS
OTHER_KINDS = "(other kinds)"
_READER_LOG = logging.getLogger("dsv4_idxk_probe.roomlog")
_LOG = logging.getLogger("dsv4_idxk_probe.offline")
# diagnosis cells the join completes in all (~200 bytes each): rooms past it keep decode's own cells
MAX_COMPLETED_CELLS = 32 * MAX_DIAGNOSED_CELLS
_SCAN = 16  # a room's stages are scanned for a duplicate up to this many, then indexed


def _index_digest(index: dict, point: tuple, digest: int) -> str:
    """Add a digest hash at a point of a room's stage index: one int, or a set once two differ
    (grown in place: a hostile log's many digests at one point cost linear time). Says what
    the point held: "new" (nothing), "duplicate" (this digest), "conflict" (others only)."""
    known = index.get(point)
    if known is None:
        index[point] = digest
        return "new"
    if type(known) is set:
        if digest in known:
            return "duplicate"
        known.add(digest)
    elif known == digest:
        return "duplicate"
    else:
        index[point] = {known, digest}
    return "conflict"


def cluster_of(rec: dict) -> str:
    """The record's `cluster` label ("" when it has none), checked."""
    cluster = rec.get("cluster")
    if cluster is None or cluster == "":
        return ""
    if type(cluster) is not str or len(cluster) > MAX_CLUSTER_CHARS:
        raise RecordError(f"cluster must be a string of at most {MAX_CLUSTER_CHARS} characters")
    return clip(cluster, MAX_CLUSTER_CHARS)


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


class Joiner:
    """Joins records as they stream by; decode records that arrive before their prefill wait."""

    def __init__(self, analysis: Analysis):
        self.a = analysis
        self.prefill: dict[Key, dict[int | None, Packed | None]] = {}  # (room, attempt) -> tokens -> digest
        self.prefill_skipped: set[Key] = set()
        self.prefill_rids: dict[Key, str] = {}  # only rooms whose record named one
        self.deferred: list[tuple[Key, StageResult, Packed | None]] = []
        self.conflicted: set[tuple[Key, int | None]] = set()  # (key, tokens) prefill sent with two digests
        self.stage_index: dict[Key, dict] = {}  # rooms of more than _SCAN stages: (stage, step, transfer) -> digest hash(es)
        self.stage_digests: dict[Key, int | list] = {}  # rooms of up to _SCAN stages: their digests' hashes
        self.to_diagnose: set[Key] = set()  # rooms with a mismatch decode could not localise (`_complete`)
        self.diagnoses_left_out = 0  # rooms whose diagnosis was not completed: MAX_COMPLETED_CELLS spent
        self._names: dict[str, str] = {}  # instance names, one string each (a million rooms share a few)
        self._row_bytes: dict = {}  # layout name -> its row bytes (None: not a built-in layout)

    def add_record(self, rec: dict, file: str, line: int) -> None:
        """Validate and route one record; RecordError names the offending field."""
        kind = record_kind(rec)
        kinds = self.a.record_kinds
        kinds[kind if kind in kinds else self._new_kind(kind)] += 1
        if kind == "room":
            self._room(rec, file, line)
        elif kind == "hicache":
            self._hicache(rec)

    def _new_kind(self, kind: str) -> str:
        """The name a kind not counted yet is counted under: printable and short, and
        OTHER_KINDS once MAX_KINDS are counted (a log of a million made-up kinds)."""
        name = clip(kind, MAX_KIND_CHARS)
        if name not in self.a.record_kinds and len(self.a.record_kinds) >= MAX_KINDS:
            return OTHER_KINDS
        return name

    def _hicache(self, rec: dict) -> None:
        if rec.get("event") == "restore_mismatch":
            self.a.add_restore(restore_mismatch(rec))
            return
        if rec.get("event") == "roundtrip_diagnosis":
            self.a.add_roundtrip(roundtrip_diagnosis(rec))
            return
        if "branch" not in rec and type(rec.get("event")) is str:
            return  # a pool, guard or check event: the room log keeps it, the diff counts only branches
        pool, direction, branch, count = hicache_branch(rec)
        self.a.hicache[(pool, direction, branch)] += count

    def _room(self, rec: dict, file: str, line: int) -> None:
        room, attempt, stage, step, verdict, rid, packed, tokens, ts, diagnosis, page_events = room_fields(rec)
        cluster = cluster_of(rec) if "cluster" in rec else ""
        key = (room, attempt, cluster) if cluster else (room, attempt)
        self._note_meta(key, rec, packed, stage == "prefill_send")
        if stage == "prefill_send":
            self._add_prefill(key, tokens, packed, verdict)
            if rid is not None and key not in self.prefill_rids:
                self.prefill_rids[key] = rid
            return
        result = StageResult(stage, step, "", "", verdict, ts, file, line, tokens=tokens,
                             diagnosis=diagnosis, page_events=page_events)
        found = self.a.rooms.get(key)
        if found is None:
            found = self.a.rooms[key] = RoomResult(room, attempt, [], cluster=cluster)
        if rid is not None and found.decode_rid is None:
            found.decode_rid = rid
        result.transfer = found.transfer_of(tokens)
        if self._duplicate(key, found.stages, result, packed):
            self.a.duplicates += 1
            return
        found.stages.append(result)
        if key in self.prefill:
            self._judge(key, found, result, packed)
        else:
            self.deferred.append((key, result, packed))

    def _duplicate(self, key: Key, stages: list[StageResult], result: StageResult, packed: Packed | None) -> bool:
        """Whether this decode record repeats a kept one: the same stage, step and transfer with
        the same digest (the same file read under two names: docs/roomlog.md). A record of the same
        stage with another digest is not a duplicate but a second observation, kept and judged like
        any stage, so that a mismatch it shows decides the room (it was dropped, and diff said 0);
        it is counted as a conflicting decode record (two decode logs that disagree on one point).
        A kept stage's digest is remembered as its hash while the join runs: one int per room while
        its stages share one digest (the common case), a list of them else; past _SCAN stages, an
        index of (stage, step, transfer) -> its digest (a set of them where they differ)."""
        stage, step, transfer, digest = result.stage, result.step, result.transfer, hash(packed)
        seen = self.stage_index.get(key)
        if seen is None:
            kept = self.stage_digests.get(key)
            digests = [kept] * len(stages) if type(kept) is int else kept or []
            if len(stages) >= _SCAN:
                seen = self.stage_index[key] = {}
                for s, d in zip(stages, digests):
                    _index_digest(seen, (s.stage, s.step, s.transfer), d)
                del self.stage_digests[key]
            else:
                same_point = False
                for s, d in zip(stages, digests):
                    if s.stage == stage and s.step == step and s.transfer == transfer:
                        if d == digest:
                            return True
                        same_point = True
                if same_point:
                    self.a.decode_conflicts += 1
                if kept is None or kept == digest:
                    self.stage_digests[key] = digest if kept is None else kept
                else:
                    self.stage_digests[key] = [*digests, digest]
                return False
        held = _index_digest(seen, (stage, step, transfer), digest)
        if held == "conflict":
            self.a.decode_conflicts += 1
        return held == "duplicate"

    def _note_meta(self, key: Key, rec: dict, packed: Packed | None, prefill: bool) -> None:
        """What coverage reads of a room (`Analysis.room_meta`): the instance of its first decode
        record (of its first prefill record when decode logged none), and the index-K bytes its
        first prefill record's digest covers (its first decode record's when no prefill record)."""
        meta = self.a.room_meta
        old = meta.get(key)
        if old is not None and (old[3] if prefill else old[2]):
            return
        instance = rec.get("instance")
        instance = self._names.setdefault(instance, instance) if type(instance) is str else ""
        nbytes = self._bytes(rec.get("layout"), packed)
        if old is None:
            meta[key] = (instance, nbytes, not prefill, prefill)
        elif prefill:  # decode came first: its instance stays, prefill's digest sizes the room
            meta[key] = (old[0], nbytes, True, True)
        else:  # prefill came first: its bytes stay, decode's instance names the room
            meta[key] = (instance, old[1], True, True)

    def _bytes(self, layout: object, packed: Packed | None) -> int | None:
        """layers x pages x the layout's row bytes; None without a digest or a built-in layout."""
        if packed is None or type(layout) is not str:
            return None
        row = self._row_bytes.get(layout, -1)
        if row == -1:
            row = row_bytes(layout)
            if len(self._row_bytes) < 256:  # a hostile log's made-up layout names are not kept
                self._row_bytes[layout] = row
        return None if row is None else len(packed.layer_ids) * (len(packed.pages) // 8) * row

    def _add_prefill(self, key: Key, tokens: int | None, packed: Packed | None, verdict: str | None) -> None:
        """One prefill record per transfer: a rebootstrapped room is sent again, with more tokens."""
        sent = self.prefill.setdefault(key, {})
        if tokens in sent:
            if sent[tokens] == packed:
                self.a.duplicates += 1
            else:
                self.a.conflicts += 1  # keep the first; the summary says how many disagreed
                self.conflicted.add((key, tokens))  # its stages of that length are judged against neither
            return
        sent[tokens] = packed
        if verdict == "skipped":
            self.prefill_skipped.add(key)

    def _unjudge_conflicts(self) -> None:
        """Stages of a length prefill sent with two digests (the same room, attempt and length: a
        rebootstrap recomputed under new weights, or two logs that disagree) are judged against
        neither: which send a decode record belongs to is not in the logs, and keeping the first
        read made the verdict depend on the order of the files. Not comparable, never a match."""
        for key, tokens in self.conflicted:
            room = self.a.rooms.get(key)
            for result in room.stages if room is not None else ():
                if result.tokens == tokens and result.verdict in ("match", "mismatch"):
                    live = result.live_verdict
                    if live != result.verdict and live in DECISIVE and result.verdict in DECISIVE:
                        self.a.live_disagreements -= 1  # counted against a verdict taken back
                    result.verdict, result.comparison = "not_comparable", None
                    result.reason = "prefill sent this room twice at this length with other digests"
                    self.to_diagnose.discard(key)

    def _judge(self, key: Key, room: RoomResult, result: StageResult, observed: Packed | None) -> None:
        sent = self.prefill.get(key, {})
        # the transfer of the same length; else the latest one (a length that differs is not comparable)
        expected = sent.get(result.tokens) if result.tokens in sent else (next(reversed(sent.values())) if sent else None)
        room.has_prefill = key in self.prefill
        if room.prefill_rid is None:
            room.prefill_rid = self.prefill_rids.get(key)
        if expected is not None and not room.layer_ids:
            room.layer_ids, room.n_pages = expected.layer_ids, len(expected.pages) // 8
        if observed is not None and observed == expected:
            result.verdict = "match"  # identical digests: what compare() says, without unpacking
        elif (result.live_verdict == "skipped" and (observed is None or expected is None)) or (
                expected is None and key in self.prefill_skipped):
            # a live `skipped` stands for a missing digest: two digests are compared, whatever it said
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
                self.to_diagnose.add(key)
        live = result.live_verdict
        if live != result.verdict and live in DECISIVE and result.verdict in DECISIVE:
            self.a.live_disagreements += 1

    def finish(self) -> None:
        for key, result, packed in self.deferred:
            self._judge(key, self.a.rooms[key], result, packed)
        self.deferred.clear()
        self._unjudge_conflicts()
        self._complete()
        self.stage_index.clear()
        self.stage_digests.clear()
        self.a.prefill_only_keys = [key for key in self.prefill if key not in self.a.rooms]
        self.a.prefill_only = len(self.a.prefill_only_keys)
        self.a.prefill_only_rids = {k: self.prefill_rids[k] for k in self.a.prefill_only_keys if k in self.prefill_rids}

    def _complete(self) -> None:
        """Decode's diagnosis of a mismatch it could not localise, completed per cell of the logs'
        localisation, for each room's first divergence only: the stage the table, the summary and
        the report read (the room's other stages keep decode's own cells). Completing every such
        record kept up to 4,096 cells of ~200 bytes for each: a 3 MB log of them took 855 MB. The
        cells completed in all are capped too (MAX_COMPLETED_CELLS), so memory stays bounded on any
        input: rooms past the cap, in the table's order, keep decode's cells and a warning counts them."""
        budget = MAX_COMPLETED_CELLS
        for key in sorted(self.to_diagnose, key=lambda k: (room_sort_key(k[0]), *k[1:])):
            first = self.a.rooms[key].first_divergence
            if first is None or first.page_events is None or first.comparison is None:
                continue
            bound = first.comparison
            cells = min(len(bound.layer_segments) * len(bound.pages), MAX_DIAGNOSED_CELLS)
            if cells > budget:
                self.diagnoses_left_out += 1
                continue
            first.diagnosis = complete_diagnosis(first.diagnosis or [], bound, first.page_events)
            budget -= len(first.diagnosis)
        self.to_diagnose.clear()
        if self.diagnoses_left_out:
            _LOG.warning("diagnosis of %d room(s) left as decode logged it, not completed per cell of the "
                         "localisation (the join completes at most %d cells in all)",
                         self.diagnoses_left_out, MAX_COMPLETED_CELLS)


class _Silent(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


_Joiner = Joiner  # the former name, kept for callers that still use it


def prefill_files_first(path: Path) -> int:
    """0 for files that start with a prefill record, so they are read first (fewer deferrals).
    What the reader logs of the lines peeked at here (a rid cut) it logs again when they are read."""
    silent = _Silent()
    _READER_LOG.addFilter(silent)
    try:
        with closing(read_file(path)) as entries:
            for entry in entries:
                if entry.record is not None:
                    return 0 if entry.record.get("stage") == "prefill_send" else 1
                if entry.line > 100:
                    break
    finally:
        _READER_LOG.removeFilter(silent)
    return 1


def analyse(paths: Iterable[Path]) -> Analysis:
    """Read every file, join by (room, attempt), judge each decode stage."""
    paths = list(paths)
    analysis = Analysis(files=[str(p) for p in paths])
    joiner = Joiner(analysis)
    # Millions of long-lived, acyclic objects: the cyclic collector would rescan
    # them again and again for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for path in sorted(paths, key=prefill_files_first):
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
