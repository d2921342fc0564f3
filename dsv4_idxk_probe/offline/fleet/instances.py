"""Per writer instance (host:pid): the `--per-instance` summary, and the coverage of the
keys judged in SQL, both over the SQL-judged keys and the Python-judged ones alike."""

from __future__ import annotations

from collections import Counter

from ...vocabulary import VERDICTS
from .duck import insert_rows


def clean_coverage(con) -> list:
    """Coverage of the keys judged in SQL (offline/coverage.py reads it beside the Python
    rooms): as the reference's `join.Joiner` notes it, the instance of a key's first decode record
    (its first prefill record's for prefill-only keys), and its first prefill digest's size."""
    return con.execute("""
        WITH p AS (
            SELECT room, attempt, arg_min({'i': coalesce(instance, ''), 'l': layout, 'c': cells}, ord) AS m
            FROM rec r SEMI JOIN clean_keys USING (room, attempt) WHERE stage = 'prefill_send' GROUP BY ALL
        ), d AS (
            SELECT room, attempt, arg_min(coalesce(instance, ''), ord) AS instance
            FROM rec r SEMI JOIN clean USING (room, attempt) WHERE stage <> 'prefill_send' GROUP BY ALL
        )
        SELECT 'verified', d.instance, p.m.l, p.m.c, count(*) FROM d JOIN p USING (room, attempt) GROUP BY ALL
        UNION ALL
        SELECT 'unverified', p.m.i, p.m.l, p.m.c, count(*) FROM p SEMI JOIN clean_po USING (room, attempt) GROUP BY ALL
        ORDER BY ALL
    """).fetchall()


def _cluster(key: tuple) -> str:
    """A key's cluster: records that name one join on (room, attempt, cluster), "" else."""
    return key[2] if len(key) > 2 else ""


def per_instance(con, analysis, instances_py: Counter) -> list[dict]:
    """Per writer instance (host:pid): its role, records, keys and their verdicts. Keys are
    (room, attempt, cluster) as the join's: two clusters' room 2 are two rooms, each judged
    on its own (the SQL-judged keys name no cluster, so theirs is "")."""
    con.execute("CREATE TEMP TABLE verdict_of (room VARCHAR, attempt BIGINT, cluster VARCHAR, verdict VARCHAR)")
    rows = [[k[0], k[1], _cluster(k), r.verdict] for k, r in analysis.rooms.items()]
    rows += [[k[0], k[1], _cluster(k), "prefill_only"] for k in analysis.prefill_only_keys]
    if rows:
        insert_rows(con, "verdict_of", ("room", "attempt", "cluster", "verdict"), rows)
    con.execute("CREATE TEMP TABLE inst_py (instance VARCHAR, role VARCHAR, room VARCHAR, attempt BIGINT, "
                "cluster VARCHAR, n BIGINT)")
    if instances_py:
        insert_rows(con, "inst_py", ("instance", "role", "room", "attempt", "cluster", "n"),
                    [[i, role, k[0], k[1], _cluster(k), n] for (i, role, k), n in instances_py.items()])
    out = con.execute("""
        WITH v AS (
            SELECT room, attempt, '' AS cluster, 'match' AS verdict FROM clean
            UNION ALL SELECT room, attempt, '', 'prefill_only' FROM clean_po
            UNION ALL SELECT room, attempt, cluster, verdict FROM verdict_of
        ), r AS (
            SELECT instance, CASE WHEN stage = 'prefill_send' THEN 'prefill' ELSE 'decode' END AS role,
                   room, attempt, '' AS cluster, count(*) AS n
            FROM rec r SEMI JOIN clean_keys USING (room, attempt) WHERE instance IS NOT NULL
            GROUP BY ALL
            UNION ALL SELECT instance, role, room, attempt, cluster, n FROM inst_py
        ), k AS (
            SELECT instance, role, room, attempt, cluster, sum(n) AS n FROM r GROUP BY ALL
        )
        SELECT k.instance, k.role, coalesce(v.verdict, 'dropped') AS verdict, sum(k.n)::BIGINT, count(*)
        FROM k LEFT JOIN v USING (room, attempt, cluster)
        GROUP BY ALL ORDER BY k.role DESC, k.instance
    """).fetchall()
    by: dict = {}
    for instance, role, verdict, records, rooms in out:
        row = by.setdefault((instance, role), {"instance": instance, "role": role, "records": 0, "rooms": 0,
                                               "room_verdicts": Counter()})
        row["records"] += int(records)
        row["rooms"] += int(rooms)
        row["room_verdicts"][verdict] += int(rooms)
    result = []
    for row in by.values():
        counts = row["room_verdicts"]
        row["room_verdicts"] = {v: counts[v] for v in (*VERDICTS, "prefill_only", "dropped") if counts.get(v)}
        result.append(row)
    return result
