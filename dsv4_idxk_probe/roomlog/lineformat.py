"""One room-log line: a JSON object that carries its own checksum.

A line is the compact JSON of a record with one more member appended last,
``"h"``: the xxh64 (seed 0, 16 lowercase hex digits) of the line's bytes
that precede ``,"h":``. Any edit, truncation or torn write changes those
bytes, so the reader rejects the line instead of trusting it. The check
needs no JSON canonicalisation: anyone can verify a line from its bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import xxhash

try:  # SGLang depends on orjson, so serving images have it; it parses ~3x and writes ~15x faster
    from orjson import JSONDecodeError as _OrjsonError
    from orjson import dumps as _orjson_dumps
    from orjson import loads as _loads

    _PARSE_ERRORS: tuple = (ValueError, _OrjsonError)
except ImportError:  # the standard library gives the same records, slower
    _orjson_dumps = None
    _loads = json.loads
    _PARSE_ERRORS = (ValueError,)


def _dumps(record: dict[str, Any]) -> bytes:
    """Compact JSON. orjson writes it on the probe's threads several times faster than
    the standard library, which holds the GIL the serving thread needs all the while.
    orjson writes non-ASCII text as UTF-8, and NaN or infinity as null:
    so a record's top-level numbers (its only floats, `ts`) are checked first, and a
    non-finite one refuses the record (the writer drops and counts it, docs/roomlog.md).
    What orjson refuses (lone surrogates, integers past 64 bits) goes to the standard
    library, which escapes surrogates and refuses NaN anywhere, and is kept only if it
    reads back unchanged: integers past 64 bits would come back as floats."""
    for value in record.values():
        if type(value) is float and not math.isfinite(value):
            raise ValueError("NaN or infinity is not allowed in a room log record")
    if _orjson_dumps is not None:
        try:
            return _orjson_dumps(record)
        except TypeError:  # orjson.JSONEncodeError
            pass
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    if _orjson_dumps is not None and _parse(body) != record:
        raise ValueError("a record must hold integers of at most 64 bits (readers would get floats)")
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a room log line")


def _parse(data: bytes) -> Any:
    """orjson, then the standard library for what orjson refuses (escaped lone surrogates),
    which must not accept NaN or infinity where orjson would not."""
    try:
        return _loads(data)
    except _PARSE_ERRORS:
        return json.loads(data, parse_constant=_refuse_constant)


CHECKSUM_KEY = "h"
_SUFFIX_HEAD = b',"h":"'
_SUFFIX_LEN = len(_SUFFIX_HEAD) + 16 + 2  # ,"h":"<16 hex>"}


class LineError(ValueError):
    """A line that cannot be trusted; the message says why (no file/line: the reader adds them)."""


def encode_line(record: dict[str, Any]) -> bytes:
    """Serialise `record` as one checksummed line, newline included.

    Raises ValueError/TypeError for records that are not plain, non-empty
    JSON objects (the writer counts those as dropped).
    """
    if not isinstance(record, dict) or not record:
        raise ValueError("a record must be a non-empty dict")
    if CHECKSUM_KEY in record:
        raise ValueError(f"key {CHECKSUM_KEY!r} is reserved for the line checksum")
    body = _dumps(record)
    head = body[:-1]  # drop the closing brace; the checksum member goes before it
    return b"%s%s%s\"}\n" % (head, _SUFFIX_HEAD, xxhash.xxh64_hexdigest(head).encode("ascii"))


def decode_line(line: bytes) -> dict[str, Any]:
    """Check and parse one line (with or without its newline); raise LineError.

    Hot path of `diff` (millions of lines): no copies of the line are made.
    """
    end = len(line)
    while end and line[end - 1] in b"\r\n":
        end -= 1
    head_end = end - _SUFFIX_LEN
    if head_end <= 0 or line[head_end : head_end + len(_SUFFIX_HEAD)] != _SUFFIX_HEAD or line[end - 2 : end] != b'"}':
        raise LineError("no line checksum at the end (torn, truncated or not a room log line)")
    if xxhash.xxh64_hexdigest(memoryview(line)[:head_end]).encode("ascii") != line[end - 18 : end - 2]:
        raise LineError("line checksum does not match (edited or corrupted line)")
    try:
        record = _parse(line)
    except ValueError as exc:
        raise LineError(f"checksum matches but the JSON does not parse: {exc}") from None
    except RecursionError:
        raise LineError("checksum matches but the JSON nests too deeply to parse") from None
    if not isinstance(record, dict):
        raise LineError("line is not a JSON object")
    del record[CHECKSUM_KEY]
    return record
