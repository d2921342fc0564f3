"""Per-room JSONL log: the line format, the writer the serving side uses, and the
reader that `dsv4-idxk-probe diff` and `report` use (their join is in `offline/`).

Usage (serving side)::

    writer = RoomLogWriter(log_dir, role="decode", metrics=metrics)
    writer.emit(record)      # never blocks; False when dropped (counted)
    writer.close()           # drains and stops the daemon thread

Format and schema: docs/roomlog.md.
"""

from .lineformat import LineError, decode_line, encode_line
from .reader import Entry, InputError, expand_inputs, read_entries, read_file
from .writer import RoomLogWriter

__all__ = [
    "Entry",
    "InputError",
    "LineError",
    "RoomLogWriter",
    "decode_line",
    "encode_line",
    "expand_inputs",
    "read_entries",
    "read_file",
]
