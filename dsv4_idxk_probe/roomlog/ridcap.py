"""A request id (`rid`) is capped when read: a huge one never hides its room.

The rid is SGLang's request id, which a client may choose; the serving side
writes what it got. A rid over MAX_RID_CHARS characters is cut to that many
when read, with a marker that says so and how long it was (`cap_rid`), so the
tables, the JSON and the page stay readable and the room is still judged.

A rid so long that its line is over the reader's line bound (8 MiB) would make
the line be skipped, and with it the room. `squeeze_long_line` reads such a line
in bounded pieces instead: it checks the line's checksum over all of its bytes
(xxh64, streamed), keeps every byte but those of a top-level ``"rid"`` string
past its first few KiB, and hands back the kept line, checksummed anew, for the
usual checks and parse. Anything else that makes a line that long (or a line
that does not check out) still makes it a skipped line. Memory stays bounded:
what is kept is at most the line bound.
"""

from __future__ import annotations

import re

import xxhash

MAX_RID_CHARS = 256  # SGLang's own rids are 32 hex digits; a router's or a client's are short names
_RID_KEEP_BYTES = 12 * MAX_RID_CHARS  # raw JSON bytes of a long rid kept: MAX_RID_CHARS characters even if escaped
_CHUNK = 1 << 20
_SUFFIX = 24  # ,"h":"<16 hex>"}
_STRUCTURE = re.compile(rb'["{}\[\],:]')
_SPACE = b" \t\r\n"


def rid_marker(kept: str, length: int, unit: str) -> str:
    return f"{kept}... (rid cut to {MAX_RID_CHARS} characters; {length:,} {unit} in the log)"


def rids_as_read(rids: list[str]) -> list[str]:
    """Rids asked for (`--rid`), and each long one as the reader cut it: a rid over
    MAX_RID_CHARS characters was never found by its full text."""
    return [*rids, *(rid_marker(r[:MAX_RID_CHARS], len(r), "characters") for r in rids if len(r) > MAX_RID_CHARS)]


def cap_rid(record: dict, raw_length: int | None = None) -> bool:
    """Cut the record's top-level `rid` to MAX_RID_CHARS characters and a marker; True if cut.
    `raw_length`: the rid's length in the line's bytes, when `squeeze_long_line` cut it first."""
    rid = record.get("rid")
    if type(rid) is not str or (len(rid) <= MAX_RID_CHARS and raw_length is None):
        return False
    if raw_length is not None:
        record["rid"] = rid_marker(rid[:MAX_RID_CHARS], raw_length, "bytes")
    else:
        record["rid"] = rid_marker(rid[:MAX_RID_CHARS], len(rid), "characters")
    return True


def _safe_prefix(raw: bytes) -> int:
    """The length of the longest prefix of JSON string content `raw` that ends between
    two characters: no escape sequence or UTF-8 character cut in two."""
    i, n = 0, len(raw)
    while i < n:
        b = raw[i]
        if b == 0x5C:  # backslash
            step = 6 if i + 1 < n and raw[i + 1] == 0x75 else 2  # \uXXXX or \x
        elif b < 0x80:
            step = 1
        elif b >= 0xF0:
            step = 4
        elif b >= 0xE0:
            step = 3
        else:
            step = 2
        if i + step > n:
            break
        i += step
    return i


class _Squeezer:
    """Streams one line: hashes it and keeps it, less the excess of a top-level rid string."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.hasher = xxhash.xxh64()
        self.tail = b""  # the last bytes seen, not hashed yet: the checksum member is among them
        self.depth = 0
        self.in_string = False
        self.backslashes = 0  # backslashes just before the current position, inside a string
        self.expect_key = False  # the next string at depth 1 is a key
        self.is_key = False
        self.key = bytearray()
        self.rid_state = 0  # 1: the key "rid" was read; 2: and its colon
        self.in_rid = False
        self.rid_start = 0
        self.rid_bytes = 0
        self.rid_cut: int | None = None  # the raw length of the rid that was cut
        self.failed = False

    def feed(self, chunk: bytes) -> None:
        if self.failed:
            return  # the rest is only read past
        data = self.tail + chunk
        if len(data) > 64:
            self.hasher.update(data[:-64])
            self.tail = data[-64:]
        else:
            self.tail = data
        self._scan(chunk)
        if len(self.kept) > self.limit:
            self.failed = True
            self.kept = bytearray()

    def _scan(self, chunk: bytes) -> None:
        i, n = 0, len(chunk)
        while i < n:
            if self.in_string:
                j = chunk.find(b'"', i)
                segment = chunk[i:] if j < 0 else chunk[i:j]
                run = len(segment) - len(segment.rstrip(b"\\"))
                backslashes = self.backslashes + run if run == len(segment) else run
                if j < 0:
                    self._string_bytes(segment)
                    self.backslashes = backslashes
                    return
                if backslashes % 2:  # an escaped quote: still inside the string
                    self._string_bytes(chunk[i : j + 1])
                    self.backslashes = 0
                else:
                    self._string_bytes(segment)
                    self._end_string()
                i = j + 1
                continue
            m = _STRUCTURE.search(chunk, i)
            j = n if m is None else m.start()
            if j > i:
                plain = chunk[i:j]
                self.kept += plain
                if self.rid_state == 2 and plain.strip(_SPACE):
                    self.rid_state = 0  # a rid that is not a string: nothing to cut
            if m is None:
                return
            self._structure(chunk[j])
            i = j + 1

    def _string_bytes(self, segment: bytes) -> None:
        if self.in_rid:
            room = _RID_KEEP_BYTES - (len(self.kept) - self.rid_start)
            if room > 0:
                self.kept += segment[:room]
            self.rid_bytes += len(segment)
            return
        self.kept += segment
        if self.is_key and len(self.key) < 8:
            self.key += segment[:8]

    def _end_string(self) -> None:
        self.in_string = False
        self.backslashes = 0
        if self.in_rid:
            self.in_rid = False
            if self.rid_bytes > _RID_KEEP_BYTES:
                del self.kept[self.rid_start + _safe_prefix(bytes(self.kept[self.rid_start :])) :]
                self.rid_cut = self.rid_bytes
        elif self.is_key:
            self.rid_state = 1 if self.key == b"rid" else 0
            self.is_key = False
        self.kept += b'"'

    def _structure(self, c: int) -> None:
        self.kept.append(c)
        if c == 0x22:  # "
            self.in_string = True
            self.backslashes = 0
            if self.rid_state == 2 and self.depth == 1:
                self.in_rid, self.rid_start, self.rid_bytes = True, len(self.kept), 0
            else:
                self.is_key = self.depth == 1 and self.expect_key
                self.key.clear()
            self.rid_state = 0
            self.expect_key = False
        elif c == 0x3A:  # :
            self.rid_state = 2 if self.rid_state == 1 else 0
        elif c in (0x7B, 0x5B):  # { [
            self.depth += 1
            self.expect_key = c == 0x7B and self.depth == 1
            self.rid_state = 0
        elif c in (0x7D, 0x5D):  # } ]
            self.depth -= 1
            self.rid_state = 0
        elif c == 0x2C:  # ,
            self.expect_key = self.depth == 1
            self.rid_state = 0

    def finish(self) -> tuple[bytes, int] | None:
        """The kept line, checksummed anew, and the cut rid's raw length; None if the line
        does not check out whole, or nothing of a rid was cut (the excess was elsewhere)."""
        tail = self.tail.rstrip(b"\r\n")
        if self.failed or self.rid_cut is None or self.depth != 0 or self.in_string or len(tail) < _SUFFIX:
            return None
        self.hasher.update(tail[:-_SUFFIX])
        if tail[-_SUFFIX:-18] != b',"h":"' or tail[-2:] != b'"}' or self.hasher.hexdigest().encode() != tail[-18:-2]:
            return None
        kept = bytes(self.kept).rstrip(b"\r\n")
        if not kept.endswith(tail[-_SUFFIX:]) or not kept.startswith(b"{"):
            return None
        head = kept[:-_SUFFIX]
        return b'%s,"h":"%s"}\n' % (head, xxhash.xxh64_hexdigest(head).encode("ascii")), self.rid_cut


def squeeze_long_line(f, first: bytes, limit: int) -> tuple[bytes | None, int, int | None]:
    """Read the rest of an over-long line whose first `first` bytes were read from `f`.

    Returns (the line with its rid cut, or None; the bytes consumed; the rid's raw length).
    """
    consumed = len(first)
    squeezer = _Squeezer(limit)
    squeezer.failed = not first.startswith(b"{")
    piece = first
    while True:
        ends = piece.endswith(b"\n")
        squeezer.feed(piece[:-1] if ends else piece)
        if ends:
            break
        piece = f.readline(_CHUNK)
        consumed += len(piece)
        if not piece:
            break
    done = squeezer.finish()
    return (None, consumed, None) if done is None else (done[0], consumed, done[1])
