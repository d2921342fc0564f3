"""`dsv4-idxk-probe report`: one self-contained HTML page of what the room logs say.

Exit status (`dsv4-idxk-probe --help` has the table for every command): 0
the page was written; 2 bad input (nothing readable) or the page could not
be written. Findings do not change the status: `diff` is the tool for a
pass/fail answer. ``-o -`` writes the page to stdout.
"""

from __future__ import annotations

import argparse
import sys

from ..offline import engine
from ..offline.join import analyse
from ..offline.printable import printable
from ..offline.report_html import render
from ..roomlog.ridcap import rids_as_read
from .atomic import write_atomically

HELP = "write an HTML report: each bad room (when, which pod, both rids, cells, what next) and timelines"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG", help="room logs: files, directories or globs (rotated, .gz)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="HTML file to write ('-': stdout)")
    parser.add_argument("--title", default="dsv4-idxk-probe report", help="page title")
    parser.add_argument("--max-rooms", type=int, default=50, metavar="N", help="bad rooms drawn (50)")
    parser.add_argument(
        "--rid", action="append", metavar="RID",
        help="only the room(s) of this SGLang request id (prefill's or decode's): draws a room the page "
             "left out; repeatable",
    )
    engine.add_engine_arguments(parser, per_instance=False)


PREFIX = "dsv4-idxk-probe report:"
PAGE_MODE = 0o644  # the written page: readable by all, as a web server or a colleague needs


def main(args: argparse.Namespace) -> int:
    analysis = engine.analyse_inputs(args, PREFIX, reference=lambda p: analyse(p))  # `analyse` read at call time
    if analysis is None:
        return 2
    try:
        return _render(analysis, args)
    finally:
        engine.close(analysis)


def _render(analysis, args: argparse.Namespace) -> int:
    if args.rid:
        analysis.select_rids(rids_as_read(args.rid))
        if not analysis.rooms and not analysis.prefill_only:
            print(f"{PREFIX} no room in these logs has rid {printable(', '.join(args.rid))}", file=sys.stderr)
            return 2
    for message in analysis.errors[:20]:
        print(f"skipped {printable(message)}", file=sys.stderr)
    if analysis.n_errors > 20:
        print(f"... and {analysis.n_errors - 20} more bad lines (listed in the report)", file=sys.stderr)
    if not analysis.record_kinds:
        print(f"{PREFIX} no records found in the inputs", file=sys.stderr)
        return 2
    rooms = analysis.summary()["rooms"]
    if hasattr(analysis, "with_clean_rooms"):  # the fleet engine: its clean rooms, for the timeline
        analysis.with_clean_rooms()
    page = render(analysis, title=args.title, max_rooms=max(0, args.max_rooms))
    if args.output == "-":
        sys.stdout.write(page)
        return 0
    try:
        write_atomically(args.output, page, mode=PAGE_MODE)
    except OSError as exc:
        print(f"{PREFIX} cannot write {printable(args.output)}: {printable(exc.strerror or exc)}", file=sys.stderr)
        return 2
    print(f"wrote {printable(args.output)} ({rooms:,} rooms, {len(analysis.bad_rooms()):,} not matching)")
    return 0
