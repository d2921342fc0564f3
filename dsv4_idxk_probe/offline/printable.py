"""Text from a log, made safe to print: the one helper every output of the log tools uses.

Room logs, their file names, and the rids, pool names, kinds and messages in
them come from other machines and may be hostile. Printed raw, a control
character can clear the terminal, forge table rows (a newline), set the
window title or the clipboard (OSC), and a bidirectional override can make
an HTML page or a terminal show text in another order than it holds.
`printable` escapes, as Python would write them (``\\x1b``, ``\\u202e``):

- C0 controls (U+0000-U+001F, tab and newline included), DEL and the C1
  controls (U+007F-U+009F);
- bidirectional controls: U+061C, U+200E, U+200F, U+202A-U+202E,
  U+2066-U+2069, and the line and paragraph separators U+2028, U+2029;
- lone surrogates (U+D800-U+DFFF: undecodable file-name bytes, or a room id
  the writer's JSON fallback wrote), which no UTF-8 output can carry.

Everything else, other scripts included, is kept. Text that needs nothing
(nearly all of it) is returned as it is, after one regular-expression scan.
`json_safe` does the same to JSON bytes with JSON's own escapes, so the data
reads back unchanged. No torch, no other part of the package: any output can
import it.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from typing import Iterator

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
# The same characters as UTF-8 inside JSON text (which escapes C0 itself): DEL, C1, the bidi controls.
_UNSAFE_JSON = re.compile(
    b"\x7f|\xc2[\x80-\x9f]|\xd8\x9c|\xe2\x80[\x8e\x8f\xa8-\xae]|\xe2\x81[\xa6-\xa9]"
)


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object) -> str:
    """`value` as text with every control, bidi control and lone surrogate escaped."""
    text = value if type(value) is str else str(value)
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(_escape, text)


def clip(value: object, limit: int) -> str:
    """`printable(value)`, at most `limit` characters and a note of how many were left out."""
    text = printable(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def _escape_json(match: re.Match) -> bytes:
    return b"\\u%04x" % ord(match.group().decode("utf-8"))


def json_safe(data: bytes) -> bytes:
    """JSON text (UTF-8) with DEL, C1 and bidi controls written as ``\\uXXXX`` escapes.

    Outside its strings JSON text is ASCII, so these bytes can only be inside a
    string, where the escape stands for the very same character: the document
    reads back equal, and a terminal it is printed to shows the escape.
    """
    if _UNSAFE_JSON.search(data) is None:
        return data
    return _UNSAFE_JSON.sub(_escape_json, data)


class _PrintableRecords(logging.Filter):
    """Makes a log record's message printable before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let logging report it as usual
            return True
        safe = printable(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


@contextmanager
def printable_logs(*names: str) -> Iterator[None]:
    """While the block runs, what the loggers `names` log (file names, lines) is printable.

    A logger's filters see only the records made on that logger, so every logger
    that can log log data while a tool runs is named."""
    flt = _PrintableRecords()
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(flt)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(flt)
