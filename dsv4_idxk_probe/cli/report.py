"""`dsv4-idxk-probe report`: one self-contained HTML page of what the room logs say.

Exit status (`dsv4-idxk-probe --help` has the table for every command): 0
the page was written; 2 bad input (nothing readable) or the page could not
be written. Findings do not change the status: `diff` is the tool for a
pass/fail answer. ``-o -`` writes the page to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ..offline.analysis import analyse
from ..offline.html import render
from ..roomlog.reader import InputError, expand_inputs

HELP = "write an HTML report: summary, a (layer x page) heatmap per bad room, verdicts over time, HiCache branches"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG", help="room logs: files, directories or globs (rotated, .gz)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="HTML file to write ('-': stdout)")
    parser.add_argument("--title", default="dsv4-idxk-probe report", help="page title")
    parser.add_argument("--max-rooms", type=int, default=50, metavar="N", help="bad rooms drawn (50)")


PREFIX = "dsv4-idxk-probe report:"


def main(args: argparse.Namespace) -> int:
    try:
        paths = expand_inputs(args.logs)
    except InputError as exc:
        print(f"{PREFIX} {exc}", file=sys.stderr)
        return 2
    analysis = analyse(paths)
    for message in analysis.errors[:20]:
        print(f"skipped {message}", file=sys.stderr)
    if analysis.n_errors > 20:
        print(f"... and {analysis.n_errors - 20} more bad lines (listed in the report)", file=sys.stderr)
    if not analysis.record_kinds:
        print(f"{PREFIX} no records found in the inputs", file=sys.stderr)
        return 2
    page = render(analysis, title=args.title, max_rooms=max(0, args.max_rooms))
    if args.output == "-":
        sys.stdout.write(page)
        return 0
    try:
        write_atomically(args.output, page)
    except OSError as exc:
        print(f"{PREFIX} cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(analysis.rooms):,} rooms, {len(analysis.bad_rooms()):,} not matching)")
    return 0


def write_atomically(path: str, text: str) -> None:
    """Temp file in the same directory, then rename: a reader never sees half a page."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html.tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
