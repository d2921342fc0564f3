"""What the logs say, judged: a decode stage, a room, and everything joined.

The join (`join.py`) fills these in; `diff` and `report` only read them. Kept
apart from the parsing so the readers see plain data, and a summary that is
the same for the terminal table, the JSON and the HTML page.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

from ..diagnosis.diagnose import summarise
from ..digest.result import Comparison
from ..hicache.culprit import summarise as summarise_roundtrip
from ..vocabulary import DECODE_STAGES, SEVERITY

STAGE_ORDER = {stage: i for i, stage in enumerate(DECODE_STAGES)}
MAX_ERRORS_KEPT = 10_000
MAX_ROUNDTRIP_KEPT = 1_000  # HiCache round-trip diagnoses kept for the report (all are counted)

Key = tuple  # (room: str, attempt: int), or (room, attempt, cluster: str) for records that name a cluster
_TRANSFER_SCAN = 8  # a room's transfers are scanned up to this many, then indexed


def _order(stage: "StageResult") -> tuple[int, int, int]:
    """Transfer first (a rebootstrapped room is sent again), then stage, then step."""
    return (stage.transfer, STAGE_ORDER[stage.stage], stage.step or 0)


def room_sort_key(room: str) -> tuple:
    """Bootstrap rooms are numbers written as text: order them as numbers (9 < 10 < 113).
    ASCII digits only: `str.isdigit` also accepts "²" or "①", which `int` refuses."""
    return (0, int(room), "") if room.isascii() and room.isdigit() else (1, 0, room)


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
    # by the join from the localisation of the logs (`join.complete_diagnosis`)
    page_events: dict | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def order(self) -> tuple[int, int, int]:
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


@dataclass(slots=True)
class RoomResult:
    """One (room, attempt) as decode saw it: its judged stages, and what prefill sent."""

    room: str  # SGLang's bootstrap room
    attempt: int
    stages: list[StageResult]
    has_prefill: bool = False
    n_pages: int = 0
    layer_ids: tuple = ()
    transfers: list = field(default_factory=list)  # token counts of its transfers, in the order seen
    prefill_rid: str | None = None  # SGLang's request id on each side (they may differ)
    decode_rid: str | None = None
    cluster: str = ""  # the records' `cluster` label (config roomlog.cluster), "" when they name none
    # token count -> transfer index, once a room has more than _TRANSFER_SCAN transfers (hostile logs)
    transfer_index: dict | None = field(default=None, repr=False, compare=False)

    def transfer_of(self, tokens: int | None) -> int:
        """The index of the transfer of `tokens` tokens (a record without tokens joins the latest)."""
        transfers = self.transfers
        if tokens is None:
            return max(len(transfers) - 1, 0)
        if len(transfers) <= _TRANSFER_SCAN:
            if tokens in transfers:
                return transfers.index(tokens)
        else:
            index = self.transfer_index
            if index is None:
                index = self.transfer_index = {t: i for i, t in enumerate(transfers)}
            found = index.get(tokens)
            if found is not None:
                return found
            index[tokens] = len(transfers)
        transfers.append(tokens)
        return len(transfers) - 1

    @property
    def name(self) -> str:
        """``room/attempt``, and ``@cluster`` where the records name one."""
        return f"{self.room}/{self.attempt}@{self.cluster}" if self.cluster else f"{self.room}/{self.attempt}"

    @property
    def rids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r for r in (self.decode_rid, self.prefill_rid) if r))

    @property
    def ordered(self) -> list[StageResult]:
        return sorted(self.stages, key=_order)

    @property
    def verdict(self) -> str:
        """The worst stage's verdict."""
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
            **({"cluster": self.cluster} if self.cluster else {}),
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
    restore: list[dict] = field(default_factory=list)  # HiCache restore mismatches, the first MAX_ROUNDTRIP_KEPT
    restore_n: int = 0  # all of them
    duplicates: int = 0
    conflicts: int = 0  # prefill records of a key and transfer with another digest (the first kept)
    decode_conflicts: int = 0  # decode records of a point (stage, step, transfer) with another digest (each kept)
    live_disagreements: int = 0
    # key -> (instance, index-K bytes or None, instance from decode, bytes from prefill): what
    # the coverage table (offline/coverage.py) reads of each room's records
    room_meta: dict = field(default_factory=dict)
    selected: bool = False  # select_rids ran: the rooms are a selection, coverage is not computed

    def error(self, where: str, message: str) -> None:
        self.n_errors += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(f"{where}: {message}")

    def add_restore(self, mismatch: dict) -> None:
        self.restore_n += 1
        if len(self.restore) < MAX_ROUNDTRIP_KEPT:
            self.restore.append(mismatch)

    def add_roundtrip(self, diagnosis: dict) -> None:
        self.roundtrip_n += 1
        if len(self.roundtrip) < MAX_ROUNDTRIP_KEPT:
            self.roundtrip.append(diagnosis)

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
        bad.sort(key=lambda r: (-SEVERITY[r.verdict], room_sort_key(r.room), r.attempt, r.cluster))
        return Tally(stages, rooms, first, bad, open_rooms)

    def room_verdicts(self) -> Counter:
        return self.tally.room_verdicts

    def bad_rooms(self) -> list[RoomResult]:
        """Rooms that are not all-match, worst first."""
        return self.tally.bad_rooms

    def select_rids(self, rids: Iterable[str]) -> None:
        """Keep only the rooms whose SGLang request id (either side's) is in `rids`."""
        wanted = set(rids)
        self.selected = True
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

    def prefill_conflicts(self) -> int:
        """Prefill records of a key and transfer with another digest (the summary's count, and
        `exit_status`'s, without building the summary)."""
        return self.conflicts

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
            "conflicting_prefill_records": self.prefill_conflicts(),
            "conflicting_decode_records": self.decode_conflicts,
            "bad_lines": self.n_errors,
            "hicache_branches": [
                {"pool": p, "direction": d, "branch": b, "count": n} for (p, d, b), n in sorted(self.hicache.items())
            ],
            "hicache_roundtrip": {"mismatches": self.roundtrip_n, "lines": summarise_roundtrip(self.roundtrip),
                                  "rows": self.roundtrip},
            "hicache_restore": {"mismatches": self.restore_n, "loads": self.restore},
        }
