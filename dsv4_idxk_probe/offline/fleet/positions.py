"""Reading positions: a record's place in the reference's reading order as one integer.

The reference reads files in `join.prefill_files_first` order and each file line by line;
a position is the file's rank in that order shifted left by `LINE_BITS`, or'ed with the
line number, so SQL can sort and compare positions as BIGINTs.
"""

from __future__ import annotations

LINE_BITS = 40
LINE_MASK = (1 << LINE_BITS) - 1


def position(file_rank: int, line: int) -> int:
    return (file_rank << LINE_BITS) | line
