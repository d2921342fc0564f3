"""The ingest SQL: DuckDB reads the scan's fast files and proves each line canonical.

`read_json_objects` reads the lines; each is parsed once (`json_transform`) and joined to
the scan by (file, h, length), which gives its line number and proves DuckDB parsed the
very bytes the checksum covered. A line is *canonical* when it is, byte for byte, the
writer's serialisation of the values DuckDB read (the key order of
`pd.records.room_record`, no other key, strict numbers, room ids and rids without
escapes): only then can the reference read nothing else from it. Canonical room records
become compact rows (a 64-bit hash of the digest text, and for prefill records whether
the digest is well formed as `pack_digest` checks it); every other line is *odd*.
"""

from __future__ import annotations

from ...roomlog.reader import MAX_LINE_BYTES
from ...vocabulary import STAGES, VERDICTS

_STRUCT = ('{"v":"JSON","kind":"JSON","ts":"JSON","role":"JSON","instance":"JSON","room":"JSON",'
           '"attempt":"JSON","stage":"JSON","step":"JSON","layout":"JSON",'
           '"digest":"JSON",'
           '"verdict":"JSON","reason":"JSON","expected_room":"JSON","localisation":"JSON",'
           '"first_divergence":"JSON","tokens":"JSON","rid":"JSON","h":"JSON"}')


def _n(name: str) -> str:
    return f"coalesce(x.{name}::VARCHAR, 'null')"


def _concat(parts: list[str]) -> str:
    """One concat() call: a chain of || copies the growing string once per part."""
    return "concat(" + ", ".join(parts) + ")"


_HEAD_KEYS = ("v", "kind", "ts", "role", "instance", "room", "attempt", "stage", "step", "layout")
_TAIL_KEYS = ("verdict", "reason", "expected_room", "localisation", "first_divergence")
# The writer's line around the digest: {"v":..,...,"layout":..,"digest":  DIGEST  ,"verdict":..,...,"h":".."}
_HEAD = _concat([item for i, k in enumerate(_HEAD_KEYS)
                 for item in (("'{" if i == 0 else "',") + f'"{k}":\'', _n(k))] + ["',\"digest\":'"])
_TAIL = _concat([item for k in _TAIL_KEYS for item in (f"',\"{k}\":'", _n(k))]
                + ["coalesce(',\"tokens\":' || x.tokens::VARCHAR, '')", "',\"rid\":'", _n("rid"), "',\"h\":'",
                   _n("h"), "'}'"])
# The line is the writer's serialisation of what DuckDB read: head and tail byte for byte, and
# between them exactly as many bytes as the digest DuckDB wrote back. Any other spelling of a
# strictly spelled digest (whitespace, escapes, a trailing comma, -0) is longer, and a digest
# that is not strictly spelled is never trusted (prefill: the digest regex; decode: the
# prefill digest's hash), so equal lengths mean equal bytes.
_CANONICAL = ("starts_with(raw, head) AND ends_with(raw, tail) AND "
              "len = strlen(head) + strlen(coalesce(dtext, 'null')) + strlen(tail)")

_INT = r"^(0|[1-9][0-9]{0,17})$"
_SINT = r"^(0|-?[1-9][0-9]{0,17})$"
_TOK = r"^(0|[1-9][0-9]{0,11})$"  # < 2**40: what the reference keeps as a transfer's tokens
_TS = r"^(0|[1-9][0-9]{0,10})(\.[0-9]{1,20})?$"  # < 1e11: valid for every stage
_ROOM = r'^"[ !#-\[\]-~]{1,256}"$'  # printable ASCII, no quote nor backslash: text = value
_RID = r'^"[^"\\\x00-\x1f]{1,256}"$'  # a longer rid is cut when read (ridcap.cap_rid): Python reads it
_HEX = r'"[0-9a-f]{16}"'
MAX_FAST_SEGMENTS = 8


def _digest_ok(dtext: str, n_segs: str) -> str:
    """A digest `pack_digest` accepts, strictly spelled: a 16-digit signature, n_tokens < 2**40,
    integer layer ids, segment names without escapes or commas, len(segments)-wide rows of
    16-digit hex cells and 16-digit hex pages (the row count is checked beside it)."""
    seg = r'"[^",\\\x00-\x1f]{0,256}"'  # validation.MAX_ROOM_CHARS: a longer name is a bad line
    head = (r'^\{"key":"[^"\\\x00-\x1f]*","signature":"[0-9a-f]{16}","n_tokens":(0|[1-9][0-9]{0,11}),'
            r'"layer_ids":\[((0|-?[1-9][0-9]{0,17})(,(0|-?[1-9][0-9]{0,17}))*)?\],"segments":\[')
    cases = []
    for c in range(1, MAX_FAST_SEGMENTS + 1):
        row = rf"\[{_HEX}(,{_HEX}){{{c - 1}}}\]"
        pattern = (head + seg + ("," + seg) * (c - 1)  # written out: RE2 refuses {4} of {0,256}
                   + r'\],"room":"[^"\\\x00-\x1f]*","layer_segment":\[(' + row + "(," + row + r")*)?\],"
                   + r'"pages":\[(' + _HEX + "(," + _HEX + r")*)?\]\}$")
        cases.append(f"WHEN {c} THEN regexp_full_match({dtext}, '{pattern}')")
    return f"(CASE {n_segs} " + " ".join(cases) + " ELSE false END)"


def _str_or_null(col: str) -> str:
    return f"(x.{col} IS NULL OR starts_with(x.{col}::VARCHAR, '\"'))"


_VERDICT_LIST = "[" + ",".join(f"'\"{v}\"'" for v in VERDICTS) + "]"
_STAGE_LIST = "[" + ",".join(f"'\"{s}\"'" for s in STAGES) + "]"

_INGEST = f"""
CREATE OR REPLACE TEMP TABLE batch AS
WITH r AS (
    SELECT filename, json AS raw, strlen(json) AS len, TRY(json_transform(json, '{_STRUCT}')) AS x
    FROM read_json_objects($files, format='newline_delimited', ignore_errors=true, filename=true,
                           compression=$compression, maximum_object_size={MAX_LINE_BYTES + 1})
), m AS (
    -- the scan's lines by (file, h, length): the line number, and the proof that DuckDB
    -- parsed the bytes the checksum covered; a line it could not parse is missing (odd)
    SELECT l.fid, l.line, r.raw, r.len, r.x FROM r JOIN files f ON f.path = r.filename
    JOIN lines_b l ON l.fid = f.fid AND l.h = TRY(('0x' || (r.x.h::VARCHAR)[2:17])::UBIGINT) AND l.len = r.len
), q AS (
    SELECT fid, line, raw, len, x,
           x.digest::VARCHAR AS dtext, {_HEAD} AS head, {_TAIL} AS tail,
           CASE WHEN x.stage::VARCHAR = '"prefill_send"' AND x.digest IS NOT NULL
                THEN json_array_length(x.digest, ['$.layer_ids', '$.segments', '$.layer_segment', '$.pages']) END AS lens
    FROM m
), c AS (
    SELECT *, (x IS NOT NULL AND {_CANONICAL}
       AND x.v::VARCHAR = '1' AND x.kind::VARCHAR = '"room"'
       AND (x.ts IS NULL OR regexp_full_match(x.ts::VARCHAR, '{_TS}'))
       AND regexp_full_match(coalesce(x.room::VARCHAR, ''), '{_ROOM}')
       AND regexp_full_match(coalesce(x.attempt::VARCHAR, ''), '{_INT}')
       AND list_contains({_STAGE_LIST}, x.stage::VARCHAR)
       AND (x.step IS NULL OR regexp_full_match(x.step::VARCHAR, '{_SINT}'))
       AND (x.verdict IS NULL OR list_contains({_VERDICT_LIST}, x.verdict::VARCHAR))
       AND (x.rid IS NULL OR regexp_full_match(x.rid::VARCHAR, '{_RID}'))
       AND (x.tokens IS NULL OR regexp_full_match(x.tokens::VARCHAR, '{_TOK}'))
       AND x.localisation IS NULL
       AND {_str_or_null('role')} AND {_str_or_null('instance')} AND {_str_or_null('layout')}
       AND (x.instance IS NULL OR length(x.instance->>'$') <= 256)  -- validation.MAX_ROOM_CHARS
       AND {_str_or_null('reason')} AND {_str_or_null('expected_room')} AND {_str_or_null('first_divergence')}
       AND (dtext IS NULL OR starts_with(dtext, '{{'))) AS canon FROM q
)
SELECT fid, line, canon,
       CASE WHEN canon THEN (x.room::VARCHAR)[2:-2] END AS room,
       CASE WHEN canon THEN x.attempt::VARCHAR::BIGINT END AS attempt,
       CASE WHEN canon THEN (x.stage::VARCHAR)[2:-2] END AS stage,
       CASE WHEN canon THEN x.step::VARCHAR::BIGINT END AS step,
       CASE WHEN canon THEN x.ts::VARCHAR::DOUBLE END AS ts,
       CASE WHEN canon THEN (x.verdict::VARCHAR)[2:-2] END AS live,
       CASE WHEN canon THEN (x.rid::VARCHAR)[2:-2] END AS rid,
       CASE WHEN canon AND dtext IS NULL THEN x.tokens::VARCHAR::BIGINT
            WHEN canon AND x.stage::VARCHAR = '"prefill_send"' THEN
                 TRY(regexp_extract(dtext, '"n_tokens":([0-9]{{1,12}}),', 1)::BIGINT)
       END AS tokens,
       CASE WHEN canon AND dtext IS NOT NULL THEN hash(dtext) END AS dh,
       CASE WHEN canon AND dtext IS NOT NULL AND x.stage::VARCHAR = '"prefill_send"' THEN
            {_digest_ok("dtext", "lens[2]")} AND lens[1] = lens[3]
       END AS dvalid,
       CASE WHEN canon THEN x.instance->>'$' END AS instance,
       CASE WHEN canon THEN lens[1] * lens[4] END AS cells,  -- coverage: layers x pages of a prefill digest
       CASE WHEN canon THEN x.layout->>'$' END AS layout
FROM c
"""


def ingest_sql(files: list[str], gz: bool) -> str:
    listed = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
    return _INGEST.replace("$files", listed).replace("$compression", "'gzip'" if gz else "'none'")


# The working tables: files, canonical room records (`rec`), odd lines, and the keys and
# records the Python join reads (`pykeys`, `pyrecs`).
SCHEMA = """
CREATE TABLE files (fid INTEGER, path VARCHAR, ford INTEGER, wesc VARCHAR);
CREATE TABLE rec (fid INTEGER, ord BIGINT, room VARCHAR, attempt BIGINT, stage VARCHAR, step BIGINT, ts DOUBLE,
                  live VARCHAR, rid VARCHAR, tokens BIGINT, dh UBIGINT, dvalid BOOLEAN, instance VARCHAR,
                  cells BIGINT, layout VARCHAR);
CREATE TABLE odd (fid INTEGER, line BIGINT);
CREATE TABLE pykeys (room VARCHAR, attempt BIGINT);
CREATE TABLE pyrecs (room VARCHAR, attempt BIGINT, ord BIGINT, decode BOOLEAN, ts DOUBLE, instance VARCHAR);
"""
