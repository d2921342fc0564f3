"""Clean or complex: which keys (room, attempt) SQL judges, and which the reference joiner.

A key is *clean* when all its records are canonical, prefill sent one well-formed digest
(duplicates allowed, one rid) and every decode record carries that same digest: each of
its decode stages is then `match` (what `compare` says of identical digests), and its
verdicts, counts and JSON are made in SQL. Keys only prefill logged are clean too. Every
other key (a mismatch, a retry, a missing side, an odd or slow line, a conflict) is
*complex*. Two digests are equal in SQL when their texts hash alike (64-bit).
"""

from __future__ import annotations

from .filters import Filters, filter_sql


def classify(con, filters: Filters) -> None:
    """The filters, then the tables of clean keys (`clean`, `clean_po`, their kept stages
    `kept`, `po_stats`) and of complex keys (`complex`)."""
    if filters.active:
        con.execute(filter_sql(filters))
    con.execute(CLASSIFY)


CLASSIFY = """
    CREATE TABLE keys AS
    SELECT room, attempt,
           count(*) FILTER (WHERE stage = 'prefill_send') AS p,
           count(*) FILTER (WHERE stage <> 'prefill_send') AS d,
           count(DISTINCT dh) FILTER (WHERE stage = 'prefill_send') AS p_dh_n,
           count(*) FILTER (WHERE stage = 'prefill_send' AND dh IS NULL) AS p_null,
           coalesce(bool_and(dvalid) FILTER (WHERE stage = 'prefill_send' AND dh IS NOT NULL), true) AS p_valid,
           count(DISTINCT coalesce(rid, chr(1))) FILTER (WHERE stage = 'prefill_send') AS p_rid_n,
           min(dh) FILTER (WHERE stage = 'prefill_send') AS p_dh,
           min(dh) FILTER (WHERE stage <> 'prefill_send') AS d_min,
           max(dh) FILTER (WHERE stage <> 'prefill_send') AS d_max,
           count(*) FILTER (WHERE stage <> 'prefill_send' AND dh IS NULL) AS d_null
    FROM rec GROUP BY room, attempt;
    CREATE TABLE clean_keys AS
    SELECT k.room, k.attempt, k.d > 0 AS decoded FROM keys k ANTI JOIN pykeys USING (room, attempt)
    WHERE (k.d > 0 AND k.p > 0 AND k.p_null = 0 AND k.p_dh_n = 1 AND k.p_valid AND k.p_rid_n = 1
           AND k.d_null = 0 AND k.d_min = k.p_dh AND k.d_max = k.p_dh)
       OR (k.d = 0 AND k.p > 0 AND k.p_valid);
    CREATE TABLE complex AS
    SELECT room, attempt FROM keys ANTI JOIN clean_keys USING (room, attempt)
    UNION SELECT room, attempt FROM pykeys;
    -- the decode stages the reference keeps: the first record of each (stage, step)
    CREATE TABLE kept AS
    SELECT r.room, r.attempt, r.stage, r.step, min(r.ord) AS ord, arg_min(r.live, r.ord) AS live,
           arg_min(r.ts, r.ord) AS ts, arg_min(r.tokens, r.ord) AS tokens, count(*) AS n
    FROM rec r SEMI JOIN (SELECT room, attempt FROM clean_keys WHERE decoded) c USING (room, attempt)
    WHERE r.stage <> 'prefill_send'
    GROUP BY r.room, r.attempt, r.stage, r.step;
    CREATE TABLE clean AS
    SELECT r.room, r.attempt,
           min(r.ord) FILTER (WHERE r.stage <> 'prefill_send') AS first_d,
           min(r.rid) FILTER (WHERE r.stage = 'prefill_send') AS prid,
           arg_min(r.rid, r.ord) FILTER (WHERE r.stage <> 'prefill_send' AND r.rid IS NOT NULL) AS drid,
           count(*) FILTER (WHERE r.stage = 'prefill_send') AS p,
           min(r.tokens) FILTER (WHERE r.stage = 'prefill_send') AS ptok
    FROM rec r SEMI JOIN (SELECT room, attempt FROM clean_keys WHERE decoded) c USING (room, attempt)
    GROUP BY r.room, r.attempt;
    CREATE TABLE po_groups AS
    SELECT r.room, r.attempt, r.tokens, arg_min(coalesce(r.dh::VARCHAR, 'null'), r.ord) AS first
    FROM rec r SEMI JOIN (SELECT room, attempt FROM clean_keys WHERE NOT decoded) c USING (room, attempt)
    GROUP BY r.room, r.attempt, r.tokens;
    CREATE TABLE po_stats AS
    SELECT r.room, r.attempt, count(*) AS n,
           sum(CASE WHEN coalesce(r.dh::VARCHAR, 'null') = g.first THEN 1 ELSE 0 END) AS same
    FROM rec r JOIN po_groups g ON g.room = r.room AND g.attempt = r.attempt AND g.tokens IS NOT DISTINCT FROM r.tokens
    GROUP BY r.room, r.attempt, r.tokens;
    CREATE TABLE clean_po AS
    SELECT r.room, r.attempt, min(r.ord) AS first_p,
           arg_min(r.rid, r.ord) FILTER (WHERE r.rid IS NOT NULL) AS prid
    FROM rec r SEMI JOIN (SELECT room, attempt FROM clean_keys WHERE NOT decoded) c USING (room, attempt)
    GROUP BY r.room, r.attempt;
"""
