"""The join on DuckDB: `diff` and `report` over a fleet's logs (10^7-10^8 records, thousands of files).

Same findings as the reference join (`join.analyse`), byte for byte in `diff --json`; what
changes is where the work is done (docs/fleet.md):

1. **Scan** (Python, per file, chunked): every line's checksum (`h`) is verified, with
   xxhash over memoryview slices and the expected values parsed with NumPy. A file whose
   lines all hold (a torn final line aside) is *fast*: it stays on disk and the scan hands
   DuckDB only (line, h, length) per line. Any other file is *slow*: the reference reader
   (`roomlog.reader.read_file`) reads it, so its bad lines are named exactly as today.
2. **Ingest** (DuckDB, in batches of files, all cores): `read_json_objects` reads the fast
   files, each line is parsed once (`json_transform`) and joined to the scan by (file, h,
   length), which gives its line number and proves DuckDB saw the very line the checksum
   covered. A line is *canonical* when it is byte for byte the writer's serialisation of
   the values DuckDB read (the key order of `pd.records.room_record`, no other key, strict
   numbers, room ids and rids without escapes): only then can the reference read nothing
   else from it. Canonical room records become compact rows (no digest text: a 64-bit
   hash of it, and for prefill records whether it is well-formed); every other line is
   *odd* and is read by Python.
3. **Classify** (SQL): a key (room, attempt) is *clean* when all its records are canonical,
   prefill sent one well-formed digest (duplicates allowed) and every decode record
   carries that same digest: each of its decode stages is then `match` (what `compare`
   says of identical digests) and its verdicts, counts and JSON are made in SQL. So are
   prefill-only keys. Every other key (a mismatch, a retry, a missing side, an odd or
   slow line, a conflict) is *complex*.
4. **Judge** (Python): every record of the complex keys, with the slow files' and odd
   lines' records and errors, is fed in reading order to the reference `_Joiner`, so
   verdicts, localisation, diagnosis and bad lines are the reference's own.
5. **Merge**: counts add up; the JSON streams rooms in the reference's order (first decode
   record in reading order) from a DuckDB query over both kinds.

Memory is bounded by DuckDB's `memory_limit` (it spills to `temp_dir`) plus one file chunk
in the scan and the complex keys' joined state. Progress goes to `progress` (stderr in
the CLI). DuckDB is optional (`pip install dsv4-idxk-probe[fleet]`): `available()` says
whether it is installed; the CLI falls back to the reference join without it.
"""

from __future__ import annotations

import fnmatch
import gc
import logging
import gzip
import os
import queue
import shutil
import threading
import tempfile
import time
import zlib
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import numpy as np
import xxhash

from ..roomlog.lineformat import LineError, decode_line
from ..roomlog.reader import MAX_FILE_BYTES, MAX_LINE_BYTES, TORN, _torn_tail, read_file
from ..vocabulary import DECODE_STAGES, STAGES, VERDICTS
from .diff_output import _json_bytes, json_head, write_document
from .join import _first_role, _Joiner, cluster_of
from .printable import json_safe
from .results import Analysis, RoomResult, StageResult
from .validation import RecordError, record_kind, room_fields

log = logging.getLogger("dsv4_idxk_probe.roomlog")

LINE_BITS = 40  # ord = file's reading position << 40 | line: reading order as one integer
CHUNK_BYTES = 64 << 20  # the scan reads a file in chunks of about this size
BATCH_BYTES = 512 << 20  # fast files handed to DuckDB per ingest query (text bytes)
BATCH_FILES = 256
SUFFIX = b',"h":"'
SUFFIX_LEN = len(SUFFIX) + 16 + 2
DEFAULT_MEMORY_LIMIT = "1GB"


def available() -> bool:
    """Whether DuckDB is installed (the `fleet` extra)."""
    try:
        import duckdb  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


# %% options and the result


@dataclass
class Filters:
    """Which keys (room, attempt) to judge: those with a decode record whose `ts` is in
    [since, until) (a key never decoded: a prefill record's), and with a record (either
    side) whose `instance` matches one of the glob patterns. Bad lines and HiCache
    records are reported whatever the filters."""

    since: float | None = None
    until: float | None = None
    instances: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.since is not None or self.until is not None or bool(self.instances)

    def in_window(self, ts: Any) -> bool:
        if self.since is None and self.until is None:
            return True
        if type(ts) not in (int, float):
            return False
        return (self.since is None or ts >= self.since) and (self.until is None or ts < self.until)

    def instance_ok(self, instance: Any) -> bool:
        if not self.instances:
            return True
        return type(instance) is str and any(fnmatch.fnmatchcase(instance, p) for p in self.instances)


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
    seconds: dict = field(default_factory=dict)


class FleetAnalysis(Analysis):
    """An `Analysis` whose clean rooms live in DuckDB: `rooms` holds only the rooms the
    Python join judged (every room that is not all-match is one of them), the counts
    cover all rooms, and `write_json` streams every room in the reference's order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.con = None
        self.workdir: str | None = None
        self.clean_rooms = 0
        self.clean_prefill_only = 0
        self.extra: dict = {}  # counts from SQL, merged into the summary
        self.stats = FleetStats()
        self.selected_rids: set[str] | None = None
        self.per_instance: list[dict] | None = None
        self._order: dict = {}  # each summary Counter as [(first position, name, count)]
        self._room_ords: list = []  # (key, reading position of its first decode record), Python rooms
        self._po_ords: dict = {}  # key -> reading position of its first prefill record, Python prefill-only keys
        self._ordered_files: list = []  # display names in reading order (a position's file)
        self._kind_first: dict = {}

    # The summary must be the reference's: counts of both kinds, dict orders as the
    # reference's Counters would have them (first appearance in reading order).
    def summary(self) -> dict[str, Any]:
        base = super().summary()
        x = self.extra
        base["records"] = _ordered_counts(self._order.get("kinds", []))
        base["rooms"] = len(self.rooms) + self.clean_rooms
        base["room_verdicts"] = _ordered_counts(self._order.get("room_verdicts", []))
        base["stage_verdicts"] = {s: _ordered_counts(self._order.get(("stage", s), [])) for s in DECODE_STAGES}
        base["rooms_without_decode_finish"] += x.get("open", 0)
        base["live_verdict_disagreements"] += x.get("live", 0)
        base["duplicate_records"] += x.get("duplicates", 0)
        base["conflicting_prefill_records"] += x.get("conflicts", 0)
        return base

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
        order = dict(self._room_ords)
        super().select_rids(wanted)
        clean = self._clean_rooms_for_rids(wanted)
        merged = [(order.get(k, 0), k, r) for k, r in self.rooms.items()] + clean
        merged.sort(key=lambda t: t[0])
        self.rooms = {k: r for _, k, r in merged}  # every selected room is a RoomResult now
        self._room_ords = [(k, o) for o, k, _ in merged]
        po = [(self._po_ords.get(k, 0), k) for k in self.prefill_only_keys]
        po += self._clean_prefill_only_for_rids(wanted)
        po.sort()
        self.prefill_only_keys = [k for _, k in po]
        self.prefill_only = len(self.prefill_only_keys)
        self.clean_rooms = self.clean_prefill_only = 0
        self.extra = dict(self.extra, match_rooms=0, open=0)  # the global counts stay, as the reference's do
        self._order = _orders_of(self, {}, kinds=self._order.get("kinds", []))
        self.__dict__.pop("tally", None)

    def with_clean_rooms(self) -> None:
        """`rooms` as the page's timeline reads it: the Python rooms, then the clean rooms'
        decode stages (verdict `match`, their `ts`) streamed from DuckDB in chunks."""
        self.rooms = _RoomsWithClean(self.rooms, self.con if self.clean_rooms else None)

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def _clean_rooms_for_rids(self, rids: list[str]) -> list:
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
                file, line = self._where(o)
                result.stages.append(StageResult(stage, step, "match", "", live, ts, file, line, tokens=ptok))
            result.transfers = [ptok] if ptok is not None else []
            out.append((first, (room, attempt), result))
        return out

    def _clean_prefill_only_for_rids(self, rids: list[str]) -> list:
        if self.con is None or not self.clean_prefill_only:
            return []
        rows = self.con.execute("SELECT first_p, room, attempt, prid FROM clean_po WHERE list_contains(?, prid)",
                                [rids]).fetchall()
        for _, room, attempt, prid in rows:
            self.prefill_only_rids[(room, attempt)] = prid
        return [(o, (room, attempt)) for o, room, attempt, _ in rows]

    def _where(self, o: int) -> tuple[str, int]:
        return self._ordered_files[o >> LINE_BITS], o & ((1 << LINE_BITS) - 1)


class _Rooms(dict):
    """The Python join's rooms; true when any room was judged, in SQL or in Python."""

    clean = 0

    def __bool__(self) -> bool:
        return bool(self.clean) or dict.__len__(self) > 0


class _Stub:
    __slots__ = ("ts", "verdict", "stage")

    def __init__(self, ts: float):
        self.ts, self.verdict, self.stage = ts, "match", ""


class _Chunk:
    __slots__ = ("stages",)

    def __init__(self, stages: list):
        self.stages = stages


class _RoomsWithClean(dict):
    """A dict of the Python rooms whose values() goes on with the clean rooms' stages."""

    def __init__(self, rooms: dict, con):
        super().__init__(rooms)
        self._con = con

    def values(self):  # type: ignore[override]
        yield from super().values()
        if self._con is None:
            return
        cur = self._con.execute("SELECT k.ts FROM kept k SEMI JOIN clean c USING (room, attempt) WHERE k.ts IS NOT NULL")
        while True:
            rows = cur.fetchmany(10_000)
            if not rows:
                return
            yield _Chunk([_Stub(t) for (t,) in rows])


def _ordered_counts(pairs: list) -> dict:
    """[(first ord, name, count)] -> {name: count} in first-appearance order."""
    out: dict = {}
    for _, name, n in sorted(pairs, key=lambda p: p[0]):
        if n:
            out[name] = out.get(name, 0) + n
    return out


# %% the scan


@dataclass
class FileScan:
    path: Path
    order: int  # reading position (the reference's `sorted(paths, key=_first_role)`)
    fast: bool = True
    why: str = ""
    gzip: bool = False
    h: list = field(default_factory=list)  # numpy arrays per chunk
    line: list = field(default_factory=list)
    length: list = field(default_factory=list)
    n_valid: int = 0
    text_bytes: int = 0
    name: str = ""  # what outputs call the file (its path, or the URL it was fetched from)


def _open(path: Path) -> tuple[BinaryIO, bool]:
    f = open(path, "rb")
    if f.read(2) == b"\x1f\x8b":
        f.close()
        return gzip.open(path, "rb"), True
    f.seek(0)
    return f, False


_HEXVAL = np.full(256, 255, dtype=np.uint8)
_HEXVAL[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)
_SUFFIX_ARR = np.frombuffer(SUFFIX, np.uint8)


def _check_chunk(data: bytes, first_line: int, final: bool, scan: FileScan) -> int:
    """Verify the complete lines of `data` (which ends at a newline unless `final`);
    returns how many lines it held. Sets scan.fast False on anything the fast path
    does not take."""
    arr = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(arr == 10)
    starts = np.empty(len(ends), dtype=np.int64)
    if len(ends):
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
    torn_tail = None
    if final and (not len(ends) or ends[-1] != len(data) - 1) and len(data):
        # the file's last line has no newline: checked like the others, torn is allowed
        last_start = int(ends[-1]) + 1 if len(ends) else 0
        starts = np.append(starts, last_start)
        ends = np.append(ends, len(data))
        torn_tail = len(ends) - 1
    n = len(ends)
    if not n:
        return 0
    lengths = ends - starts
    if int(lengths.max()) > MAX_LINE_BYTES:
        scan.fast, scan.why = False, "line over the reader's bound"
        return n
    ok = lengths >= SUFFIX_LEN + 2
    if not ok.all():
        bad = np.flatnonzero(~ok)
        if not (len(bad) == 1 and bad[0] == torn_tail):
            scan.fast, scan.why = False, "short or empty line"
            return n
        lengths, starts, ends, n, torn_tail = lengths[:-1], starts[:-1], ends[:-1], n - 1, "dropped"
        if not n:
            return 1
    # the suffix ,"h":"<16 hex>"} at the end of every line
    pos = ends - SUFFIX_LEN
    suffix_ok = (arr[pos[:, None] + np.arange(len(SUFFIX))] == _SUFFIX_ARR).all(axis=1)
    suffix_ok &= (arr[ends - 2] == 0x22) & (arr[ends - 1] == 0x7D)
    hexd = _HEXVAL[arr[(ends - 18)[:, None] + np.arange(16)]]
    suffix_ok &= (hexd != 255).all(axis=1)
    want = np.zeros(n, dtype=np.uint64)
    hexd = hexd.astype(np.uint64)
    for k in range(16):
        want = (want << np.uint64(4)) | hexd[:, k]
    mv = memoryview(data)
    heads = (ends - SUFFIX_LEN).tolist()
    got = np.fromiter(map(xxhash.xxh64_intdigest, map(mv.__getitem__, map(slice, starts.tolist(), heads))),
                      dtype=np.uint64, count=n)
    valid = suffix_ok & (got == want)
    if not valid.all():
        bad = np.flatnonzero(~valid)
        if len(bad) == 1 and bad[0] == torn_tail and _torn_tail(data[int(starts[-1]):]):
            valid[-1] = False  # a torn final line: the reference skips it too, and logs it
            log.warning("%s:%d: %s", scan.path, first_line + len(ends) - 1, TORN)
        else:
            scan.fast, scan.why = False, "a line fails its checksum"
            return n if torn_tail != "dropped" else n + 1
    keep = np.flatnonzero(valid)
    scan.h.append(want[keep])
    scan.line.append(keep.astype(np.int64) + first_line)
    scan.length.append(lengths[keep].astype(np.int64))
    scan.n_valid += len(keep)
    return n if torn_tail != "dropped" else n + 1


def scan_file(path: Path, order: int) -> FileScan:
    """Checksum every line of one file; decide whether DuckDB may read it."""
    scan = FileScan(path, order)
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # the reference writes such a room with the stdlib's JSON
        scan.fast, scan.why = False, "file name is not UTF-8"
        return scan
    if "\x00" in name:
        scan.fast, scan.why = False, "file name"
        return scan
    try:
        f, scan.gzip = _open(path)
        with f:
            carry = b""
            line = 1
            total = 0
            while True:
                block = f.read(CHUNK_BYTES)
                total += len(block)
                if total > MAX_FILE_BYTES:
                    scan.fast, scan.why = False, "file over the reader's bound"
                    return scan
                data = carry + block if carry else block
                final = not block
                if not final:
                    cut = data.rfind(b"\n") + 1
                    if cut == 0:
                        if len(data) > MAX_LINE_BYTES:
                            scan.fast, scan.why = False, "line over the reader's bound"
                            return scan
                        carry = data
                        continue
                    data, carry = data[:cut], data[cut:]
                else:
                    carry = b""
                # A \r, a NUL or bytes that are not UTF-8 need no check here: DuckDB then reads the
                # line otherwise (or not at all), it is missing from the canonical rows, and Python reads it.
                scan.text_bytes += len(data)
                line += _check_chunk(data, line, final, scan)
                if not scan.fast:
                    return scan
                if final:
                    if scan.h and len(np.unique(np.concatenate(scan.h))) != scan.n_valid:
                        # a line written twice: (file, h, length) would not name one line
                        scan.fast, scan.why = False, "a line appears twice"
                    return scan
    except (OSError, EOFError, zlib.error) as exc:
        scan.fast, scan.why = False, f"unreadable: {exc.__class__.__name__}"
    return scan


# %% the SQL

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
_RID = r'^"[^"\\\x00-\x1f]+"$'
_HEX = r'"[0-9a-f]{16}"'
MAX_FAST_SEGMENTS = 8


def _digest_ok(dtext: str, n_segs: str) -> str:
    """A digest `pack_digest` accepts, strictly spelled: a 16-digit signature, n_tokens < 2**40,
    integer layer ids, segment names without escapes or commas, len(segments)-wide rows of
    16-digit hex cells and 16-digit hex pages (the row count is checked beside it)."""
    seg = r'"[^",\\\x00-\x1f]*"'
    head = (r'^\{"key":"[^"\\\x00-\x1f]*","signature":"[0-9a-f]{16}","n_tokens":(0|[1-9][0-9]{0,11}),'
            r'"layer_ids":\[((0|-?[1-9][0-9]{0,17})(,(0|-?[1-9][0-9]{0,17}))*)?\],"segments":\[')
    cases = []
    for c in range(1, MAX_FAST_SEGMENTS + 1):
        row = rf"\[{_HEX}(,{_HEX}){{{c - 1}}}\]"
        pattern = (head + seg + ("(," + seg + "){" + str(c - 1) + "}" if c > 1 else "")
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
                THEN json_array_length(x.digest, ['$.layer_ids', '$.segments', '$.layer_segment']) END AS lens
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
       CASE WHEN canon THEN x.instance->>'$' END AS instance
FROM c
"""


def _ingest_sql(files: list[str], gz: bool) -> str:
    listed = "[" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "]"
    return _INGEST.replace("$files", listed).replace("$compression", "'gzip'" if gz else "'none'")


# %% the engine


class _Progress:
    def __init__(self, out: Callable[[str], None] | None, every: float = 2.0):
        self.out, self.every, self.last, self.start = out, every, 0.0, time.monotonic()

    def __call__(self, message: str, force: bool = False) -> None:
        if self.out is None:
            return
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            self.out(f"[{now - self.start:6.1f} s] {message}")


def _connect(memory_limit: str, threads: int | None, temp_dir: str | None):
    import duckdb

    workdir = tempfile.mkdtemp(prefix="dsv4-fleet-", dir=temp_dir)
    config = {"memory_limit": memory_limit, "temp_directory": os.path.join(workdir, "spill"),
              "preserve_insertion_order": False}
    if threads:
        config["threads"] = int(threads)
    con = duckdb.connect(os.path.join(workdir, "fleet.duckdb"), config=config)
    return con, workdir


_SCHEMA = """
CREATE TABLE files (fid INTEGER, path VARCHAR, ford INTEGER, wesc VARCHAR);
CREATE TABLE rec (fid INTEGER, ord BIGINT, room VARCHAR, attempt BIGINT, stage VARCHAR, step BIGINT, ts DOUBLE,
                  live VARCHAR, rid VARCHAR, tokens BIGINT, dh UBIGINT, dvalid BOOLEAN, instance VARCHAR);
CREATE TABLE odd (fid INTEGER, line BIGINT);
CREATE TABLE pykeys (room VARCHAR, attempt BIGINT);
CREATE TABLE pyrecs (room VARCHAR, attempt BIGINT, ord BIGINT, decode BOOLEAN, ts DOUBLE, instance VARCHAR);
"""


def analyse_fleet(
    paths: Iterable[Path],
    *,
    filters: Filters | None = None,
    memory_limit: str = DEFAULT_MEMORY_LIMIT,
    threads: int | None = None,
    temp_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    per_instance: bool = False,
    names: dict[str, str] | None = None,
) -> FleetAnalysis:
    """The reference's findings over any number of files, with DuckDB doing the bulk.

    The caller closes the result (`close()`) once its JSON is written: the clean rooms
    stay in DuckDB until then."""
    paths = list(paths)
    names = names or {}  # local copy -> what to call it (a URL fetched by `remote`)

    def name(p) -> str:
        return names.get(str(p), str(p))

    filters = filters or Filters()
    say = _Progress(progress)
    analysis = FleetAnalysis(files=[name(p) for p in paths])
    stats = analysis.stats
    stats.files = len(paths)
    t0 = time.monotonic()
    ordered = sorted(paths, key=_first_role)
    analysis._ordered_files = [name(p) for p in ordered]
    file_order = {name(p): i for i, p in enumerate(ordered)}
    con, analysis.workdir = _connect(memory_limit, threads, temp_dir)
    analysis.con = con
    try:
        con.execute(_SCHEMA)
        scans: list[FileScan] = []
        batch: list[FileScan] = []
        batch_bytes = 0
        py_keys: set = set()
        # The scan (Python, holds the GIL) runs while DuckDB ingests the batch before
        # (it releases the GIL): one thread owns the connection until the scan ends.
        jobs: queue.Queue = queue.Queue(maxsize=1)
        failed: list[BaseException] = []

        def worker() -> None:
            while True:
                job = jobs.get()
                if job is None:
                    return
                if failed:
                    continue
                try:
                    kind, item = job
                    if kind == "batch":
                        _ingest(con, "", item, stats, analysis, py_keys, filters)
                    else:
                        _slow_keys(item, py_keys, con, filters)
                except BaseException as exc:  # re-raised by the scanning thread
                    failed.append(exc)

        thread = threading.Thread(target=worker, name="dsv4-fleet-ingest", daemon=True)
        thread.start()
        try:
            for i, path in enumerate(ordered):
                if failed:
                    break
                scan = scan_file(path, i)
                scan.name = name(path)
                scans.append(scan)
                stats.lines += scan.n_valid
                if scan.fast:
                    stats.fast_files += 1
                    batch.append(scan)
                    batch_bytes += scan.text_bytes
                    if batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_FILES:
                        jobs.put(("batch", batch))
                        batch, batch_bytes = [], 0
                else:
                    stats.slow_files += 1
                    jobs.put(("slow", scan))
                say(f"scanned {i + 1:,}/{len(ordered):,} files, {stats.lines:,} lines checked "
                    f"({stats.slow_files:,} files for the reference reader)")
            if batch and not failed:
                jobs.put(("batch", batch))
        finally:
            jobs.put(None)
            thread.join()
        if failed:
            raise failed[0]
        stats.seconds["scan_and_ingest"] = time.monotonic() - t0
        say(f"scanned {len(ordered):,} files: {stats.canonical_records:,} canonical room records, "
            f"{stats.odd_lines:,} other lines; classifying", force=True)

        t1 = time.monotonic()
        if py_keys:
            _insert(con, "pykeys", ("room", "attempt"), list(py_keys))
        _classify(con, filters)
        stats.seconds["classify"] = time.monotonic() - t1
        stats.clean_keys, stats.complex_keys = con.execute(
            "SELECT (SELECT count(*) FROM clean) + (SELECT count(*) FROM clean_po), (SELECT count(*) FROM complex)").fetchall()[0]
        say(f"{stats.clean_keys:,} clean keys judged in SQL, {stats.complex_keys:,} for the reference join", force=True)

        t2 = time.monotonic()
        joiner, first_prefill, instances_py = _judge_complex(con, scans, analysis, filters, say, name)
        stats.seconds["python_join"] = time.monotonic() - t2
        t3 = time.monotonic()
        _merge(con, analysis, joiner, first_prefill, file_order)
        if per_instance:
            analysis.per_instance = _per_instance(con, analysis, instances_py)
        stats.seconds["merge"] = time.monotonic() - t3
        say(f"judged: {len(analysis.rooms):,} rooms in Python, {analysis.clean_rooms:,} clean in SQL", force=True)
    except BaseException:
        analysis.close()
        raise
    return analysis


def _ingest(con, sql: str, batch: list[FileScan], stats: FleetStats, analysis: FleetAnalysis, py_keys: set,
            filters: Filters) -> None:
    fids = np.concatenate([np.full(sum(len(a) for a in s.h), s.order, dtype=np.int32) for s in batch])
    lines = {
        "fid": fids,
        "h": np.concatenate([np.concatenate(s.h) if s.h else np.zeros(0, np.uint64) for s in batch]),
        "line": np.concatenate([np.concatenate(s.line) if s.line else np.zeros(0, np.int64) for s in batch]),
        "len": np.concatenate([np.concatenate(s.length) if s.length else np.zeros(0, np.int64) for s in batch]),
    }
    for s in batch:
        con.execute("INSERT INTO files VALUES (?, ?, ?, ?)", [s.order, str(s.path), s.order,
                                                              _json_bytes(s.name or str(s.path)).decode()[1:-1]])
    con.register("lines_b", lines)
    try:
        for gz in (False, True):
            group = [s for s in batch if s.gzip == gz]
            if not group:
                continue
            con.execute(_ingest_sql([str(s.path) for s in group], gz))
            _distribute(con, group, stats, analysis, py_keys, filters)
    finally:
        con.unregister("lines_b")
    for s in batch:
        s.h, s.line, s.length = [], [], []  # the scan's arrays are in DuckDB now


def _distribute(con, group: list[FileScan], stats: FleetStats, analysis: FleetAnalysis, py_keys: set,
                filters: Filters) -> None:
    seen = {fid: (n, d) for fid, n, d in con.execute(
        "SELECT fid, count(*), count(DISTINCT line) FROM batch GROUP BY fid").fetchall()}
    # A line DuckDB's parser refused (a lone surrogate, not JSON) is missing from `batch`:
    # it is odd (Python reads it). A line matched twice means DuckDB split the file
    # otherwise than the scan: the reference reads that file.
    bad = [s for s in group if seen.get(s.order, (0, 0))[0] != seen.get(s.order, (0, 0))[1]]
    if bad:  # DuckDB did not see exactly the lines the scan checked: the reference reads the file
        ids = [s.order for s in bad]
        con.execute("DELETE FROM batch WHERE list_contains(?, fid)", [ids])
        for s in bad:
            s.fast, s.why = False, "DuckDB read its lines differently"
            stats.fast_files -= 1
            stats.slow_files += 1
            _slow_keys(s, py_keys, con, filters)
    con.execute(f"INSERT INTO rec SELECT fid, (fid::BIGINT << {LINE_BITS}) | line, room, attempt, stage, step, ts, live, "
                "rid, tokens, dh, dvalid, instance FROM batch WHERE canon")
    ids = [s.order for s in group if s not in bad]
    odd = con.execute("""
        SELECT fid, line FROM batch WHERE NOT canon
        UNION ALL (SELECT fid, line FROM lines_b WHERE list_contains($ids, fid)
                   EXCEPT SELECT fid, line FROM batch)
        ORDER BY fid, line""", {"ids": ids}).fetchall()
    n_canon = con.execute("SELECT count(*) FROM batch WHERE canon").fetchall()[0][0]
    stats.canonical_records += n_canon
    stats.odd_lines += len(odd)
    if odd:
        _insert(con, "odd", ("fid", "line"), odd)
        by_file: dict[int, list[int]] = {}
        for fid, line in odd:
            by_file.setdefault(fid, []).append(line)
        scans = {s.order: s for s in group}
        rows: list = []
        for fid, wanted in by_file.items():
            for line, raw in _lines_of(scans[fid].path, wanted):
                try:
                    rec = decode_line(raw)
                except LineError:
                    continue
                _note_key(rec, fid, line, py_keys, rows)
        _insert(con, "pyrecs", _PYRECS, rows)
    con.execute("DROP TABLE batch")


def _lines_of(path: Path, wanted: list[int]) -> Iterator[tuple[int, bytes]]:
    """The lines numbered `wanted` (sorted, 1-based) of a file the scan found whole."""
    f, _ = _open(path)
    with f:
        it = iter(wanted)
        target = next(it, None)
        for n, raw in enumerate(f, 1):
            if target is None:
                return
            if n == target:
                yield n, raw
                target = next(it, None)


def _key(rec: dict) -> tuple:
    """The join's key of a room record that passed `room_fields`, as `_Joiner._room` makes it."""
    room, attempt = room_fields(rec)[:2]
    cluster = cluster_of(rec) if "cluster" in rec else ""
    return (room, attempt, cluster) if cluster else (room, attempt)


def _note_key(rec: Any, fid: int, line: int, py_keys: set, rows: list) -> None:
    """A record the Python join will read: its key joins the complex keys."""
    try:
        if record_kind(rec) != "room":
            return
        room, attempt, stage = room_fields(rec)[:3]
    except (RecordError, AttributeError, TypeError):
        return
    py_keys.add((room, attempt))
    ts, inst = rec.get("ts"), rec.get("instance")
    rows.append([room, attempt, (fid << LINE_BITS) | line, stage != "prefill_send",
                 float(ts) if type(ts) in (int, float) and abs(ts) < 1e300 else None,
                 inst if type(inst) is str else None])


def _slow_keys(scan: FileScan, py_keys: set, con, filters: Filters) -> None:
    """Keys of a file the reference reader reads: all of them go to the Python join."""
    scan.h, scan.line, scan.length = [], [], []
    rows = []
    with closing(read_file(scan.path)) as entries:
        for entry in entries:
            rec = entry.record
            if rec is None:
                continue
            try:
                if record_kind(rec) != "room":
                    continue
                room, attempt, stage = room_fields(rec)[:3]
            except RecordError:
                continue
            py_keys.add((room, attempt))
            ts = rec.get("ts")
            inst = rec.get("instance")
            rows.append([room, attempt, (scan.order << LINE_BITS) | entry.line, stage != "prefill_send",
                         float(ts) if type(ts) in (int, float) and abs(ts) < 1e300 else None,
                         inst if type(inst) is str else None])
            if len(rows) >= 50_000:
                _insert(con, "pyrecs", _PYRECS, rows)
                rows = []
    if rows:
        _insert(con, "pyrecs", _PYRECS, rows)


def _insert(con, table: str, columns: tuple[str, ...], rows: list) -> None:
    """Rows into `table` through one registered NumPy frame (executemany costs ~50 us a row)."""
    if not rows:
        return
    frame = {name: np.array([r[i] for r in rows], dtype=object) for i, name in enumerate(columns)}
    con.register("rows_in", frame)
    try:
        cast = ", ".join(f"rows_in.{c}" for c in columns)
        con.execute(f"INSERT INTO {table} SELECT {cast} FROM rows_in").fetchall()
    finally:
        con.unregister("rows_in")


_PYRECS = ("room", "attempt", "ord", "decode", "ts", "instance")


def _filter_sql(filters: Filters) -> str:
    """The keys the filters select, over canonical and Python-read records alike."""
    if not filters.active:
        return ""
    window = []
    if filters.since is not None:
        window.append(f"ts >= {float(filters.since)!r}")
    if filters.until is not None:
        window.append(f"ts < {float(filters.until)!r}")
    win = " AND ".join(window) or "true"
    inst = "true"
    if filters.instances:
        pats = " OR ".join(f"instance GLOB '{p.replace(chr(39), chr(39) * 2)}'" for p in filters.instances)
        inst = f"({pats})"
    return f"""
    CREATE TEMP TABLE allrecs AS
        SELECT room, attempt, stage <> 'prefill_send' AS decode, ts, instance FROM rec
        UNION ALL SELECT room, attempt, decode, ts, instance FROM pyrecs;
    CREATE TEMP TABLE selected AS
        SELECT room, attempt FROM allrecs GROUP BY room, attempt
        HAVING (CASE WHEN bool_or(decode) THEN bool_or(decode AND {win}) ELSE bool_or({win}) END)
           AND bool_or({inst});
    DELETE FROM rec WHERE (room, attempt) NOT IN (SELECT (room, attempt) FROM selected);
    DELETE FROM pyrecs WHERE (room, attempt) NOT IN (SELECT (room, attempt) FROM selected);
    DELETE FROM pykeys WHERE (room, attempt) NOT IN (SELECT (room, attempt) FROM selected);
    """


def _classify(con, filters: Filters) -> None:
    if filters.active:
        con.execute(_filter_sql(filters))
        # GLOB is case-sensitive and matches fnmatchcase for *, ?, [..]
    con.execute("""
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
    """)


def _judge_complex(con, scans: list[FileScan], analysis: FleetAnalysis, filters: Filters, say,
                   name: Callable[[Path], str] = str) -> tuple:
    """Feed every record of the complex keys, the slow files and the odd lines to the
    reference joiner, in reading order (file by file, line by line)."""
    joiner = _Joiner(analysis)
    first_prefill: dict = {}
    instances: Counter = Counter()  # (instance, role, key) seen in Python-read records
    wanted = con.execute(f"""
        SELECT fid, line FROM (
            SELECT r.fid, r.ord & {(1 << LINE_BITS) - 1} AS line FROM rec r SEMI JOIN complex c USING (room, attempt)
            UNION SELECT fid, line FROM odd)
        ORDER BY fid, line""").fetchall()
    by_file: dict[int, list[int]] = {}
    for fid, line in wanted:
        by_file.setdefault(fid, []).append(line)
    selected = None
    if filters.active:
        selected = {tuple(r) for r in con.execute("SELECT room, attempt FROM complex").fetchall()}
    fed = 0
    kind_first = analysis._kind_first

    def feed(rec: dict, file: str, line: int, order: int) -> None:
        nonlocal fed
        fed += 1
        if selected is not None:  # filters: only the selected keys' room records
            try:
                kind = rec.get("kind") if type(rec) is dict else None
                if kind == "room" and record_kind(rec) == "room":
                    room, attempt = room_fields(rec)[:2]
                    if (room, attempt) not in selected:
                        return
            except RecordError:
                pass
        n_kinds = len(analysis.record_kinds)
        try:
            joiner.add_record(rec, file, line)
        except RecordError as exc:
            analysis.error(f"{file}:{line}", str(exc))
            return
        finally:
            if len(analysis.record_kinds) > n_kinds:  # a kind seen first here (as the joiner names it)
                kind_first[next(reversed(analysis.record_kinds))] = (order << LINE_BITS) | line
        if rec.get("kind") == "room":
            key = _key(rec)
            if rec.get("stage") == "prefill_send":
                first_prefill.setdefault(key, (order << LINE_BITS) | line)
            inst = rec.get("instance")
            if type(inst) is str:
                instances[(inst, "prefill" if rec.get("stage") == "prefill_send" else "decode", key)] += 1

    gc_was = gc.isenabled()
    gc.disable()
    try:
        for scan in scans:
            file = name(scan.path)
            if not scan.fast:
                for entry in read_file(scan.path):
                    if entry.record is None:
                        analysis.error(f"{file}:{entry.line}", entry.error or "unreadable line")
                        continue
                    feed(entry.record, file, entry.line, scan.order)
            elif scan.order in by_file:
                for line, raw in _lines_of(scan.path, by_file[scan.order]):
                    try:
                        rec = decode_line(raw)
                    except LineError as exc:
                        analysis.error(f"{file}:{line}", "empty line" if raw.isspace() else str(exc))
                        continue
                    feed(rec, file, line, scan.order)
            say(f"reference join: {fed:,} records of complex keys and other lines")
        joiner.finish()
    finally:
        if gc_was:
            gc.enable()
    analysis.stats.python_records = fed
    return joiner, first_prefill, instances


def _stage_ord(file_order: dict, s: StageResult) -> int:
    return (file_order[s.file] << LINE_BITS) | s.line


def _merge(con, analysis: FleetAnalysis, joiner, first_prefill: dict, file_order: dict) -> None:
    """Counts and orders of both kinds of keys; Python rooms' JSON into DuckDB for the stream."""
    x = analysis.extra
    (x["match_rooms"], x["open"], x["live"], x["duplicates"]) = con.execute("""
        SELECT (SELECT count(*) FROM clean),
               (SELECT count(*) FROM clean c ANTI JOIN (SELECT room, attempt FROM kept WHERE stage = 'decode_finish') f
                    USING (room, attempt)),
               (SELECT count(*) FROM kept WHERE live IN ('mismatch', 'not_comparable')),
               (SELECT coalesce(sum(n - 1), 0) FROM kept) + (SELECT coalesce(sum(p - 1), 0) FROM clean)
                 + (SELECT coalesce(sum(same - 1), 0) FROM po_stats)""").fetchall()[0]
    x["conflicts"] = con.execute("SELECT coalesce(sum(n - same), 0) FROM po_stats").fetchall()[0][0]
    x["duplicates"] = int(x["duplicates"])
    x["conflicts"] = int(x["conflicts"])
    analysis.clean_rooms = x["match_rooms"]
    analysis.clean_prefill_only = con.execute("SELECT count(*) FROM clean_po").fetchall()[0][0]
    analysis.rooms = _Rooms(analysis.rooms)
    analysis.rooms.clean = analysis.clean_rooms
    analysis.prefill_only += analysis.clean_prefill_only
    # the Python rooms, in reading order of their first decode record
    room_ords = []
    for key, room in analysis.rooms.items():
        room_ords.append((key, min(_stage_ord(file_order, s) for s in room.stages)))
    analysis._room_ords = room_ords
    analysis._po_ords = {k: first_prefill.get(k, 0) for k in analysis.prefill_only_keys}
    kinds = [(o, k, n) for k, (o, n) in _py_kinds(analysis, file_order).items()]
    clean_room_records, first_clean = con.execute("""
        SELECT count(*), min(r.ord) FROM rec r SEMI JOIN clean_keys c USING (room, attempt)""").fetchall()[0]
    if clean_room_records:
        kinds.append((first_clean, "room", clean_room_records))
    analysis._order = _orders_of(analysis, x, kinds=kinds)
    analysis.record_kinds = Counter(_ordered_counts(kinds))  # both kinds, in the reference's order


def _py_kinds(analysis: FleetAnalysis, file_order: dict) -> dict:
    """record_kinds of the Python join, each with the reading position of its first record."""
    first = analysis._kind_first
    return {kind: (first.get(kind, 0), n) for kind, n in analysis.record_kinds.items()}


def _orders_of(analysis: FleetAnalysis, x: dict, *, kinds: list) -> dict:
    """Each summary Counter as [(first ord, name, count)], the reference's dict order."""
    con = analysis.con
    order: dict = {"kinds": kinds}
    file_order = {f: i for i, f in enumerate(analysis._ordered_files)}
    room_ords = dict(analysis._room_ords)
    rv: list = []
    sv: dict = {s: [] for s in DECODE_STAGES}
    for key, room in analysis.rooms.items():
        o = room_ords.get(key, 0)
        rv.append(((o, 0), room.verdict, 1))
        for s in room.stages:
            sv[s.stage].append(((o, _stage_ord(file_order, s)), s.verdict, 1))
    if x.get("match_rooms") and con is not None:
        first = con.execute("SELECT min(first_d) FROM clean").fetchall()[0][0]
        rv.append(((first, 0), "match", x["match_rooms"]))
        for stage, o, n in con.execute("""
                SELECT k.stage, arg_min(k.ord, c.first_d), count(*)
                FROM kept k JOIN clean c USING (room, attempt) GROUP BY k.stage""").fetchall():
            first_room = con.execute("""SELECT min(c.first_d) FROM kept k JOIN clean c USING (room, attempt)
                                        WHERE k.stage = ?""", [stage]).fetchall()[0][0]
            sv[stage].append(((first_room, o), "match", n))
    order["room_verdicts"] = rv
    for stage in DECODE_STAGES:
        order[("stage", stage)] = sv[stage]
    return order


# %% output


def _clean_stage_rows_sql() -> str:
    """Every kept stage of the clean rooms as its JSON text, in the reference's room order
    (first decode record) and stage order (stage, step, reading order): one external sort,
    which spills, where a per-room string_agg would have to hold its groups in memory."""
    stage_json = (
        "'{\"stage\":\"' || k.stage || '\",\"step\":' || coalesce(k.step::VARCHAR, 'null')"
        " || ',\"verdict\":\"match\"' || coalesce(',\"tokens\":' || c.ptok::VARCHAR, '')"
        " || CASE WHEN k.live IS NOT NULL AND k.live <> 'match' THEN ',\"live_verdict\":\"' || k.live || '\"' ELSE '' END"
        f" || ',\"where\":\"' || f.wesc || ':' || (k.ord & {(1 << LINE_BITS) - 1})::VARCHAR || '\"}}'"
    )
    stage_rank = "CASE k.stage WHEN 'decode_recv' THEN 0 WHEN 'decode_step' THEN 1 ELSE 2 END"
    return f"""
        SELECT c.first_d, c.room, c.attempt, c.prid, c.drid, k.stage = 'decode_finish', {stage_json}
        FROM clean c JOIN kept k USING (room, attempt) JOIN files f ON f.fid = (k.ord >> {LINE_BITS})
        ORDER BY c.first_d, {stage_rank}, coalesce(k.step, 0), k.ord
    """


def _clean_rooms(con) -> Iterator[tuple[int, bytes]]:
    """(first decode ord, the room's JSON line) of every clean room, as `RoomResult.to_json`
    and the reference's writer make it."""
    cur = con.execute(_clean_stage_rows_sql())
    current, parts, closed, head = None, [], False, ""

    def line() -> bytes:
        return json_safe(f'{head}{",".join(parts)}],"closed":{"true" if closed else "false"}}}'.encode())

    while True:
        chunk = cur.fetchmany(50_000)
        if not chunk:
            break
        for first, room, attempt, prid, drid, finish, sj in chunk:
            if first != current:
                if current is not None:
                    yield current, line()
                current, parts, closed = first, [], False
                head = (f'{{"room":"{room}","attempt":{attempt},"rid":{{"prefill":'
                        f'{"null" if prid is None else chr(34) + prid + chr(34)},"decode":'
                        f'{"null" if drid is None else chr(34) + drid + chr(34)}}},"verdict":"match",'
                        '"first_divergence":null,"last_match_before":null,"stages":[')
            parts.append(sj)
            closed = closed or finish
    if current is not None:
        yield current, line()


def _clean_po_json_sql() -> str:
    return """
        SELECT first_p AS ord,
               '{"room":"' || room || '","attempt":' || attempt::VARCHAR
               || ',"verdict":"unverified","reason":"prefill sent it; no decode record in these logs"'
               || coalesce(',"rid":{"prefill":"' || prid || '","decode":null}', '') || '}' AS j
        FROM clean_po
    """


def write_fleet_json(analysis: FleetAnalysis, path: str, status: int) -> None:
    """`diff --json` for a fleet analysis: the reference's document, rooms streamed from DuckDB."""
    head = json_head(analysis, status)
    if analysis.per_instance is not None:
        head["instances"] = analysis.per_instance
    write_document(path, lambda f: _write_to(f, analysis, head))


def _merged(sql_rows: Iterator[tuple[int, bytes]], py_rows: list[tuple[int, bytes]]) -> Iterator[bytes]:
    """Two streams of (ord, JSON line), each in ord order, as one."""
    py_rows.sort(key=lambda r: r[0])
    i = 0
    for o, j in sql_rows:
        while i < len(py_rows) and py_rows[i][0] < o:
            yield py_rows[i][1]
            i += 1
        yield j
    while i < len(py_rows):
        yield py_rows[i][1]
        i += 1


def _clean_po(con) -> Iterator[tuple[int, bytes]]:
    cur = con.execute(f"SELECT ord, j FROM ({_clean_po_json_sql()}) ORDER BY ord")
    while True:
        chunk = cur.fetchmany(50_000)
        if not chunk:
            return
        for o, j in chunk:
            yield o, json_safe(j.encode())


def _write_to(f: BinaryIO, analysis: FleetAnalysis, head: dict) -> None:
    f.write(_json_bytes(head)[:-1])
    f.write(b',"rooms":[\n')
    room_ords = dict(analysis._room_ords)
    py = [(room_ords.get(k, 0), _json_bytes(r.to_json())) for k, r in analysis.rooms.items()]
    rows = _clean_rooms(analysis.con) if analysis.clean_rooms and analysis.con is not None else iter(())
    separator = b""
    buf = []
    for j in _merged(rows, py):
        buf.append(separator)
        buf.append(j)
        separator = b",\n"
        if len(buf) >= 20_000:
            f.write(b"".join(buf))
            buf = []
    f.write(b"".join(buf))
    f.write(b'\n],"prefill_only":[\n')
    py = []
    for room, attempt in analysis.prefill_only_keys:
        entry = {"room": room, "attempt": attempt, "verdict": "unverified",
                 "reason": "prefill sent it; no decode record in these logs"}
        rid = analysis.prefill_only_rids.get((room, attempt))
        if rid is not None:
            entry["rid"] = {"prefill": rid, "decode": None}
        py.append((analysis._po_ords.get((room, attempt), 0), _json_bytes(entry)))
    rows = _clean_po(analysis.con) if analysis.clean_prefill_only and analysis.con is not None else iter(())
    separator = b""
    buf = []
    for j in _merged(rows, py):
        buf.append(separator)
        buf.append(j)
        separator = b",\n"
        if len(buf) >= 20_000:
            f.write(b"".join(buf))
            buf = []
    f.write(b"".join(buf))
    f.write(b"\n]}\n")


# %% per instance


def _per_instance(con, analysis: FleetAnalysis, instances_py: Counter) -> list[dict]:
    """Per writer instance (host:pid): its role, records, keys and their verdicts."""
    con.execute("CREATE TEMP TABLE verdict_of (room VARCHAR, attempt BIGINT, verdict VARCHAR)")
    rows = [[k[0], k[1], r.verdict] for k, r in analysis.rooms.items()]
    rows += [[k[0], k[1], "prefill_only"] for k in analysis.prefill_only_keys]
    if rows:
        _insert(con, "verdict_of", ("room", "attempt", "verdict"), rows)
    con.execute("CREATE TEMP TABLE inst_py (instance VARCHAR, role VARCHAR, room VARCHAR, attempt BIGINT, n BIGINT)")
    if instances_py:
        _insert(con, "inst_py", ("instance", "role", "room", "attempt", "n"),
                [[i, role, k[0], k[1], n] for (i, role, k), n in instances_py.items()])
    out = con.execute("""
        WITH v AS (
            SELECT room, attempt, 'match' AS verdict FROM clean
            UNION ALL SELECT room, attempt, 'prefill_only' FROM clean_po
            UNION ALL SELECT room, attempt, verdict FROM verdict_of
        ), r AS (
            SELECT instance, CASE WHEN stage = 'prefill_send' THEN 'prefill' ELSE 'decode' END AS role,
                   room, attempt, count(*) AS n
            FROM rec r SEMI JOIN clean_keys USING (room, attempt) WHERE instance IS NOT NULL
            GROUP BY ALL
            UNION ALL SELECT instance, role, room, attempt, n FROM inst_py
        ), k AS (
            SELECT instance, role, room, attempt, sum(n) AS n FROM r GROUP BY ALL
        )
        SELECT k.instance, k.role, coalesce(v.verdict, 'dropped') AS verdict, sum(k.n)::BIGINT, count(*)
        FROM k LEFT JOIN v USING (room, attempt)
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
