"""The fleet engine's result: an `Analysis` whose clean rooms stay in DuckDB.

`rooms` holds only the rooms the Python join judged (every room that is not all-match is
one of them); the counts cover all rooms, every summary dict keeps the reference's key
order (first appearance in reading order), and `output.write_fleet_json` streams every
room in the reference's order.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from ...vocabulary import DECODE_STAGES
from ..results import Analysis, RoomResult, StageResult
from .positions import LINE_BITS, LINE_MASK
from .summary import ordered_counts, orders_of
from .table_route import rooms_for_rids, timeline_chunks


@dataclass
class FleetStats:
    """How the work was split, for the progress line, the docs and the benchmark."""

    files: int = 0
    fast_files: int = 0
    slow_files: int = 0
    lines: int = 0
    canonical_records: int = 0
    odd_lines: int = 0
    clean_keys: int = 0
    complex_keys: int = 0
    python_records: int = 0
    clean_judge: str = ""  # who judged the clean keys: "room table" or "DuckDB (why)"
    table_fallbacks: int = 0  # runs the room table gave back to DuckDB (over its memory budget)
    table_bytes: int = 0  # the room table's size at the end of the scan
    seconds: dict = field(default_factory=dict)


class FleetAnalysis(Analysis):
    """An `Analysis` whose clean rooms live in DuckDB: `rooms` holds only the rooms the
    Python join judged (every room that is not all-match is one of them), the counts
    cover all rooms, and `write_json` streams every room in the reference's order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.con = None
        self.table = None  # the native room table, where it judged the clean keys (no DuckDB then)
        self.workdir: str | None = None
        self.clean_rooms = 0
        self.clean_prefill_only = 0
        self.extra: dict = {}  # counts from SQL, merged into the summary
        self.stats = FleetStats()
        self.selected_rids: set[str] | None = None
        self.per_instance: list[dict] | None = None
        self.clean_coverage: list = []  # (outcome, instance, layout, cells, rooms) of the SQL-judged keys
        self.summary_orders: dict = {}  # each summary Counter as [(first position, name, count)]
        self.room_positions: list = []  # (key, reading position of its first decode record), Python rooms
        self.prefill_only_positions: dict = {}  # key -> reading position of its first prefill record, Python prefill-only keys
        self.ordered_files: list = []  # display names in reading order (a position's file)
        self.kind_first: dict = {}

    # The summary must be the reference's: counts of both kinds, dict orders as the
    # reference's Counters would have them (first appearance in reading order).
    def summary(self) -> dict[str, Any]:
        base = super().summary()
        x = self.extra
        base["records"] = ordered_counts(self.summary_orders.get("kinds", []))
        base["rooms"] = len(self.rooms) + self.clean_rooms
        base["room_verdicts"] = ordered_counts(self.summary_orders.get("room_verdicts", []))
        base["stage_verdicts"] = {s: ordered_counts(self.summary_orders.get(("stage", s), [])) for s in DECODE_STAGES}
        base["rooms_without_decode_finish"] += x.get("open", 0)
        base["live_verdict_disagreements"] += x.get("live", 0)
        base["duplicate_records"] += x.get("duplicates", 0)
        return base

    def prefill_conflicts(self) -> int:
        return super().prefill_conflicts() + self.extra.get("conflicts", 0)  # the Python rooms' and SQL's

    def room_verdicts(self) -> Counter:
        out = Counter(super().room_verdicts())
        if self.extra.get("match_rooms"):
            out["match"] += self.extra["match_rooms"]
        return out

    def select_rids(self, rids: Iterable[str]) -> None:
        """Rooms of these request ids only: the Python rooms filtered as the reference does,
        the clean ones selected in SQL and made into `RoomResult`s (a handful)."""
        wanted = sorted(set(rids))
        self.selected_rids = set(wanted)
        order = dict(self.room_positions)
        super().select_rids(wanted)
        clean = self._clean_rooms_for_rids(wanted)
        merged = [(order.get(k, 0), k, r) for k, r in self.rooms.items()] + clean
        merged.sort(key=lambda t: t[0])
        self.rooms = {k: r for _, k, r in merged}  # every selected room is a RoomResult now
        self.room_positions = [(k, o) for o, k, _ in merged]
        po = [(self.prefill_only_positions.get(k, 0), k) for k in self.prefill_only_keys]
        po += self._clean_prefill_only_for_rids(wanted)
        po.sort()
        self.prefill_only_keys = [k for _, k in po]
        self.prefill_only = len(self.prefill_only_keys)
        self.clean_rooms = self.clean_prefill_only = 0
        self.extra = dict(self.extra, match_rooms=0, open=0)  # the global counts stay, as the reference's do
        self.summary_orders = orders_of(self, {}, kinds=self.summary_orders.get("kinds", []))
        self.__dict__.pop("tally", None)

    def with_clean_rooms(self) -> None:
        """`rooms` as the page's timeline reads it: the Python rooms, then the clean rooms'
        decode stages (verdict `match`, their `ts`) streamed from DuckDB (or the room table) in chunks."""
        chunks = None
        if self.clean_rooms and self.table is not None:
            chunks = timeline_chunks(self.table)
        elif self.clean_rooms and self.con is not None:
            chunks = _sql_timeline_chunks(self.con)
        self.rooms = _RoomsWithClean(self.rooms, chunks)

    def adopt_clean(self, clean_rooms: int, clean_prefill_only: int) -> None:
        """Count the keys judged in SQL: `rooms` stays the Python rooms', but is true when
        any room was judged, as the reference's would be."""
        self.clean_rooms, self.clean_prefill_only = clean_rooms, clean_prefill_only
        self.rooms = _Rooms(self.rooms)
        self.rooms.clean = clean_rooms
        self.prefill_only += clean_prefill_only

    def close(self) -> None:
        self.table = None
        if self.con is not None:
            self.con.close()
            self.con = None
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def _clean_rooms_for_rids(self, rids: list[str]) -> list:
        if self.table is not None and self.clean_rooms:
            return rooms_for_rids(self.table, rids, self.where)
        if self.con is None or not self.clean_rooms:
            return []
        rows = self.con.execute(
            "SELECT c.room, c.attempt, c.first_d, c.prid, c.drid, c.ptok FROM clean c "
            "WHERE list_contains(?, c.prid) OR list_contains(?, c.drid)", [rids, rids]).fetchall()
        out = []
        for room, attempt, first, prid, drid, ptok in rows:
            stages = self.con.execute(
                "SELECT stage, step, live, ts, ord FROM kept WHERE room = ? AND attempt = ? ORDER BY ord",
                [room, attempt]).fetchall()
            result = RoomResult(room, attempt, [], has_prefill=True, prefill_rid=prid, decode_rid=drid)
            for stage, step, live, ts, o in stages:
                file, line = self.where(o)
                result.stages.append(StageResult(stage, step, "match", "", live, ts, file, line, tokens=ptok))
            result.transfers = [ptok] if ptok is not None else []
            out.append((first, (room, attempt), result))
        return out

    def _clean_prefill_only_for_rids(self, rids: list[str]) -> list:
        if self.table is not None and self.clean_prefill_only:
            wanted = set(rids)
            rows = [(o, room, attempt, rid) for o, room, attempt, rid in self.table.prefill_only() if rid in wanted]
            for _, room, attempt, rid in rows:
                self.prefill_only_rids[(room, attempt)] = rid
            return [(o, (room, attempt)) for o, room, attempt, _ in rows]
        if self.con is None or not self.clean_prefill_only:
            return []
        rows = self.con.execute("SELECT first_p, room, attempt, prid FROM clean_po WHERE list_contains(?, prid)",
                                [rids]).fetchall()
        for _, room, attempt, prid in rows:
            self.prefill_only_rids[(room, attempt)] = prid
        return [(o, (room, attempt)) for o, room, attempt, _ in rows]

    def where(self, o: int) -> tuple[str, int]:
        """(file, line) of a reading position."""
        return self.ordered_files[o >> LINE_BITS], o & LINE_MASK


class _Rooms(dict):
    """The Python join's rooms; true when any room was judged, in SQL or in Python."""

    clean = 0

    def __bool__(self) -> bool:
        return bool(self.clean) or dict.__len__(self) > 0


class _Stub:
    __slots__ = ("ts", "verdict", "stage", "instance")

    def __init__(self, ts: float, instance: str = ""):
        self.ts, self.verdict, self.stage, self.instance = ts, "match", "", instance


class _Chunk:
    __slots__ = ("stages",)

    def __init__(self, stages: list):
        self.stages = stages


class _RoomsWithClean(dict):
    """A dict of the Python rooms whose values() goes on with the clean rooms' stages."""

    def __init__(self, rooms: dict, chunks):
        super().__init__(rooms)
        self._chunks = chunks  # lists of (first decode time, instance), one per clean room; None: none

    def values(self):  # type: ignore[override]
        yield from super().values()
        if self._chunks is None:
            return
        for rows in self._chunks:
            yield _Chunk([_Stub(t, i) for t, i in rows])


def _sql_timeline_chunks(con):
    # one row per clean room: its first decode record's time and instance (the report's timeline)
    cur = con.execute("SELECT min(r.ts), arg_min(coalesce(r.instance, ''), r.ord) FROM rec r "
                      "SEMI JOIN clean c USING (room, attempt) WHERE r.stage <> 'prefill_send' "
                      "GROUP BY r.room, r.attempt HAVING min(r.ts) IS NOT NULL")
    while True:
        rows = cur.fetchmany(10_000)
        if not rows:
            return
        yield rows
