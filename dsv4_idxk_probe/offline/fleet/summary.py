"""The summary of both kinds of keys, as the reference's: counts add up, and every dict
keeps the order the reference's Counters would have (first appearance in reading order).

Each summary Counter is kept as [(first position, name, count)]: the Python rooms one by
one, the SQL-judged rooms as one entry at the position of the first of them.
"""

from __future__ import annotations

from collections import Counter

from ...vocabulary import DECODE_STAGES
from ..results import StageResult
from .positions import position


def stage_position(file_rank: dict, s: StageResult) -> int:
    return position(file_rank[s.file], s.line)


def ordered_counts(pairs: list) -> dict:
    """[(first position, name, count)] -> {name: count} in first-appearance order."""
    out: dict = {}
    for _, name, n in sorted(pairs, key=lambda p: p[0]):
        if n:
            out[name] = out.get(name, 0) + n
    return out


def merge(con, analysis, first_prefill: dict, file_rank: dict) -> None:
    """The SQL-judged keys' counts into `analysis` (a `FleetAnalysis`), with the positions
    that order the summary and the JSON."""
    x = analysis.extra
    (x["match_rooms"], x["open"], x["live"], x["duplicates"]) = con.execute("""
        SELECT (SELECT count(*) FROM clean),
               (SELECT count(*) FROM clean c ANTI JOIN (SELECT room, attempt FROM kept WHERE stage = 'decode_finish') f
                    USING (room, attempt)),
               (SELECT count(*) FROM kept WHERE live IN ('mismatch', 'not_comparable')),
               (SELECT coalesce(sum(n - 1), 0) FROM kept) + (SELECT coalesce(sum(p - 1), 0) FROM clean)
                 + (SELECT coalesce(sum(same - 1), 0) FROM po_stats)""").fetchall()[0]
    x["conflicts"] = int(con.execute("SELECT coalesce(sum(n - same), 0) FROM po_stats").fetchall()[0][0])
    x["duplicates"] = int(x["duplicates"])
    x["clean_orders"] = _clean_orders_sql(con) if x["match_rooms"] else None
    clean_room_records, first_clean = con.execute("""
        SELECT count(*), min(r.ord) FROM rec r SEMI JOIN clean_keys c USING (room, attempt)""").fetchall()[0]
    finish(analysis, x, con.execute("SELECT count(*) FROM clean_po").fetchall()[0][0], first_prefill, file_rank,
           clean_room_records, first_clean)


def merge_table(c: dict, analysis, first_prefill: dict, file_rank: dict) -> None:
    """The same from the native room table's counts (`table_route.counts`)."""
    x = analysis.extra
    for name in ("open", "live", "duplicates", "conflicts"):
        x[name] = c[name]
    x["match_rooms"] = c["rooms"]
    x["clean_orders"] = (c["first_decode"], c["stages"]) if c["rooms"] else None
    finish(analysis, x, c["prefill_only"], first_prefill, file_rank, c["records"], c["first_record"])


def _clean_orders_sql(con) -> tuple:
    """(the first clean room's first decode position, {stage: (the first clean room having
    it, a kept record's position there, kept records)})."""
    first = con.execute("SELECT min(first_d) FROM clean").fetchall()[0][0]
    stages = {}
    for stage, o, n in con.execute("""
            SELECT k.stage, arg_min(k.ord, c.first_d), count(*)
            FROM kept k JOIN clean c USING (room, attempt) GROUP BY k.stage""").fetchall():
        first_room = con.execute("""SELECT min(c.first_d) FROM kept k JOIN clean c USING (room, attempt)
                                    WHERE k.stage = ?""", [stage]).fetchall()[0][0]
        stages[stage] = (first_room, o, n)
    return first, stages


def finish(analysis, x: dict, clean_prefill_only: int, first_prefill: dict, file_rank: dict,
           clean_room_records: int, first_clean) -> None:
    """Positions and orders of both kinds of keys, whoever judged the clean ones."""
    analysis.adopt_clean(x["match_rooms"], clean_prefill_only)
    # the Python rooms, in reading order of their first decode record
    analysis.room_positions = [(key, min(stage_position(file_rank, s) for s in room.stages))
                               for key, room in analysis.rooms.items()]
    analysis.prefill_only_positions = {k: first_prefill.get(k, 0) for k in analysis.prefill_only_keys}
    first = analysis.kind_first
    kinds = [(first.get(kind, 0), kind, n) for kind, n in analysis.record_kinds.items()]
    if clean_room_records:
        kinds.append((first_clean, "room", clean_room_records))
    analysis.summary_orders = orders_of(analysis, x, kinds=kinds)
    analysis.record_kinds = Counter(ordered_counts(kinds))  # both kinds, in the reference's order


def orders_of(analysis, x: dict, *, kinds: list) -> dict:
    """Each summary Counter as [(first position, name, count)], the reference's dict order."""
    order: dict = {"kinds": kinds}
    file_rank = {f: i for i, f in enumerate(analysis.ordered_files)}
    room_positions = dict(analysis.room_positions)
    rv: list = []
    sv: dict = {s: [] for s in DECODE_STAGES}
    for key, room in analysis.rooms.items():
        o = room_positions.get(key, 0)
        rv.append(((o, 0), room.verdict, 1))
        for s in room.stages:
            sv[s.stage].append(((o, stage_position(file_rank, s)), s.verdict, 1))
    if x.get("match_rooms") and x.get("clean_orders"):
        first, stages = x["clean_orders"]
        rv.append(((first, 0), "match", x["match_rooms"]))
        for stage, (first_room, o, n) in stages.items():
            sv[stage].append(((first_room, o), "match", n))
    order["room_verdicts"] = rv
    for stage in DECODE_STAGES:
        order[("stage", stage)] = sv[stage]
    return order
