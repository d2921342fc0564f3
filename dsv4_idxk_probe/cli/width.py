"""Terminal lines that fit: every table and message of the command line stays within
`COLUMNS` (100), so it reads on a laptop terminal, in `kubectl logs` and in a ticket.

`wrap` breaks at spaces like `textwrap`, and a word longer than a line (a dotted
SGLang path, a file path) after a '.' or '/' rather than in the middle of a name.
"""

from __future__ import annotations

import re

COLUMNS = 100

_BREAK_AFTER = re.compile(r"(?<=[./,])")


def wrap(text: str, width: int = COLUMNS, first: str = "", rest: str | None = None) -> list[str]:
    """`text` as lines no wider than `width`, the first starting with `first`, the others
    with `rest` (default: as many spaces as `first`)."""
    rest = " " * len(first) if rest is None else rest
    lines: list[str] = []
    line = first
    fresh = True  # nothing but the indent on `line` yet
    for word in text.split():
        for i, piece in enumerate(_pieces(word, width - len(rest))):
            sep = "" if fresh or i else " "  # a broken word's pieces join without a space
            if len(line) + len(sep) + len(piece) <= width:
                line += sep + piece
                fresh = False
                continue
            if not fresh:
                lines.append(line)
            line, fresh = rest + piece, False
    lines.append(line)
    return lines


def _pieces(word: str, room: int) -> list[str]:
    """A word as it may be broken: whole when it fits in `room`; else chunks that end
    after '.', '/' or ',' (each under `room` where possible), the last resort a hard cut."""
    room = max(room, 8)
    if len(word) <= room:
        return [word]
    parts = [p for p in _BREAK_AFTER.split(word) if p]
    chunks: list[str] = []
    cur = ""
    for part in parts:
        while len(part) > room:  # no break point: cut
            if cur:
                chunks.append(cur)
                cur = ""
            chunks.append(part[:room])
            part = part[room:]
        if len(cur) + len(part) > room:
            chunks.append(cur)
            cur = part
        else:
            cur += part
    if cur:
        chunks.append(cur)
    return chunks


def fits(text: str, width: int = COLUMNS) -> bool:
    """Every line of `text` within `width` columns."""
    return all(len(line) <= width for line in text.splitlines())
