"""`dsv4-idxk-probe diff`: compare prefill and decode room logs room by room.

Exit status: `EXIT_STATUS` below, printed by ``diff --help`` (docs/roomlog.md).
``--json -`` writes the JSON to stdout (the table then goes to stderr).
This module parses the arguments and prints the table; the join, the status and
the JSON are library code in `offline/`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import TextIO

from ..diagnosis.diagnose import describe_room
from ..hicache.culprit import describe as describe_culprit
from ..offline import engine
from ..offline import coverage
from ..offline.diff_output import exit_status, sides
from ..offline.join import analyse
from ..offline.printable import printable
from ..offline.results import Analysis, RoomResult
from ..roomlog.ridcap import rids_as_read
from ..vocabulary import DECODE_STAGES, SEVERITY, VERDICTS

HELP = "join prefill and decode room logs by (room, attempt) and report where index-K diverged"

EXIT_STATUS = """exit status of diff:
  0  every room the logs could judge matched, both sides' logs present
  1  a mismatch, a HiCache round-trip diagnosis, or a room decode found mismatching live
     that these logs cannot judge (one side's logs missing); with --strict also a
     not-comparable or unverified room
  2  bad input: a path that names nothing, no room records, skipped lines, one side's
     logs missing (prefill's or decode's: add them), no room logged by both sides, or
     prefill records of one room, attempt and length with other digests (clusters
     sharing room ids without a `cluster` label; a rebootstrap at the same length);
     a mismatch still exits 1"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS + ("\n\n" + parser.epilog if parser.epilog else "")
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="prefill and decode room logs, in any order: files, directories or globs (rotated, .gz)",
    )
    parser.add_argument("--json", metavar="FILE",
                        help="also write the summary and every room's verdicts as JSON ('-': stdout, the table goes to stderr)")
    parser.add_argument("--max-rooms", type=int, default=20, metavar="N", help="bad rooms listed in the table (20)")
    parser.add_argument("--max-errors", type=int, default=20, metavar="N", help="bad lines printed (20)")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 for not-comparable or unverified rooms too, not only mismatches"
    )
    parser.add_argument(
        "--rid", action="append", metavar="RID",
        help="only the room(s) of this SGLang request id (prefill's or decode's), listed whatever their verdict; repeatable",
    )
    engine.add_engine_arguments(parser)


PREFIX = "dsv4-idxk-probe diff:"
WIDTH = 100  # the warning about one side's logs is wrapped to this many columns


def main(args: argparse.Namespace) -> int:
    analysis = engine.analyse_inputs(args, PREFIX, reference=lambda p: analyse(p))  # `analyse` read at call time
    if analysis is None:
        return 2
    try:
        return _report(analysis, args)
    finally:
        engine.close(analysis)


def _report(analysis, args: argparse.Namespace) -> int:
    to_stdout = args.json == "-"
    if args.rid:
        analysis.select_rids(rids_as_read(args.rid))
        if not analysis.rooms and not analysis.prefill_only:
            print(f"dsv4-idxk-probe diff: no room in these logs has rid {printable(', '.join(args.rid))}", file=sys.stderr)
            return 2
    print_errors(analysis, args.max_errors, sys.stderr)
    out = sys.stderr if to_stdout else sys.stdout
    print_summary(analysis, args.max_rooms, out, selected=bool(args.rid))
    engine.print_per_instance(analysis, out, printable)
    print_coverage(analysis, out)
    print_sides(analysis, out, sys.stderr)
    status = exit_status(analysis, strict=args.strict)
    if args.json:
        try:
            engine.write_any_json(analysis, args.json, status)
        except OSError as exc:
            if isinstance(exc, BrokenPipeError):
                raise
            print(f"{PREFIX} cannot write {printable(args.json)}: {printable(exc.strerror or exc)}", file=sys.stderr)
            return 2
    return status


def print_errors(analysis: Analysis, limit: int, out: TextIO) -> None:
    for message in analysis.errors[: max(0, limit)]:
        print(f"skipped {printable(message)}", file=out)
    hidden = analysis.n_errors - min(len(analysis.errors), max(0, limit))
    if hidden > 0:
        print(f"... and {hidden} more bad lines (see --json)", file=out)
    if not analysis.rooms and not analysis.prefill_only:
        print(f"{PREFIX} no room records found in the inputs", file=out)


def print_coverage(analysis: Analysis, out: TextIO) -> None:
    text = coverage.lines(coverage.per_instance(analysis) or (), printable)
    if text:
        print("", file=out)
        for line in text:
            print(line, file=out)


def side_warning(analysis: Analysis) -> str | None:
    """The loud line for logs of one side only, or live mismatches the logs cannot judge."""
    seen = sides(analysis)
    live = seen["live_mismatch"]
    parts = []
    if seen["missing"] == "prefill":
        parts.append(f"no prefill records in these logs: {seen['decode_rooms']:,} rooms decode logged "
                     "cannot be verified (add the prefill pods' room logs)")
    elif seen["missing"] == "decode":
        parts.append(f"no decode records in these logs: {seen['prefill_rooms']:,} rooms prefill sent "
                     "cannot be verified (add the decode pods' room logs)")
    elif seen["missing"] == "pairs":
        parts.append(f"no room in these logs has records of both sides: the {seen['decode_rooms']:,} rooms decode "
                     f"logged and the {seen['prefill_rooms']:,} prefill sent are other rooms, none verified (add the "
                     "logs of the pods that served the same rooms, of the same time)")
    if live["rooms"]:
        parts.append(f"decode's live verdict was MISMATCH for {live['rooms']:,} rooms ({live['records']:,} records) "
                     "that these logs cannot judge: treat them as corrupt until both sides' logs say otherwise")
    if not parts:
        return None
    return "WARNING: " + "; ".join(parts)


def print_sides(analysis: Analysis, out: TextIO, err: TextIO) -> None:
    """On the table's stream and, when that is not a terminal's stderr already, on stderr too."""
    line = side_warning(analysis)
    if line is None:
        return
    print("\n" + textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=out)
    if err is not out:
        print(textwrap.fill(f"{PREFIX} {line}", WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=err)


def _ranges(values: list[int]) -> str:
    """3,4,5,9 -> '3-5,9': localisation stays short even for many pages."""
    parts, start, prev = [], None, None
    for v in sorted(values):
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts) or "-"


def _table(rows: list[list[str]], out: TextIO) -> None:
    """Columns aligned; every cell printable first (a rid, a room id or a reason from a log)."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))), file=out)


def print_summary(analysis: Analysis, max_rooms: int, out: TextIO, selected: bool = False) -> None:
    s = analysis.summary()
    kinds = ", ".join(f"{printable(k)} {n:,}" for k, n in sorted(s["records"].items())) or "none"
    print(f"{s['files']} files, records: {kinds}; {s['rooms']:,} rooms seen on decode", file=out)
    rows = [["stage", *VERDICTS]]
    for stage in DECODE_STAGES:
        counts = s["stage_verdicts"][stage]
        rows.append([stage, *(f"{counts.get(v, 0):,}" for v in VERDICTS)])
    rows.append(["rooms (worst stage)", *(f"{s['room_verdicts'].get(v, 0):,}" for v in VERDICTS)])
    _table(rows, out)
    first = ", ".join(f"{stage} {s['first_divergence'].get(stage, 0):,}" for stage in DECODE_STAGES)
    print(f"first divergence: {first}", file=out)
    if s["diagnosis"]["lines"]:
        print(f"diagnosis: {printable('; '.join(s['diagnosis']['lines']))}", file=out)
    if analysis.roundtrip_n:
        print(f"hicache round trip: {printable('; '.join(s['hicache_roundtrip']['lines']))}", file=out)
        for diag in analysis.roundtrip[: max(0, max_rooms)]:
            print(f"  {printable(describe_culprit(diag))}", file=out)
        if analysis.roundtrip_n > min(len(analysis.roundtrip), max(0, max_rooms)):
            print(f"  ... {analysis.roundtrip_n:,} in all (see --json)", file=out)
    if analysis.restore_n:
        print(f"hicache restore: {analysis.restore_n:,} load(s) wrote pages that differ from their backup", file=out)
        for load in analysis.restore[: max(0, max_rooms)]:
            print(f"  {printable(describe_restore(load))}", file=out)
        if analysis.restore_n > min(len(analysis.restore), max(0, max_rooms)):
            print(f"  ... {analysis.restore_n:,} in all (see --json)", file=out)
    print(
        f"prefill-only rooms {s['prefill_only_rooms']:,}; rooms without decode_finish "
        f"{s['rooms_without_decode_finish']:,}; live verdict disagreements "
        f"{s['live_verdict_disagreements']:,}; duplicate records {s['duplicate_records']:,}; "
        f"conflicting prefill records {s['conflicting_prefill_records']:,}; conflicting decode records "
        f"{s['conflicting_decode_records']:,}; bad lines {s['bad_lines']:,}",
        file=out,
    )
    bad = analysis.bad_rooms()
    if selected:  # --rid: every selected room, matching ones too
        listed = {id(r) for r in bad}
        bad = bad + [r for r in analysis.rooms.values() if id(r) not in listed]
    if not bad:
        return
    shown = bad[: max(0, max_rooms)]
    what = "selected rooms" if selected else "rooms that did not match"
    print(f"\n{what} ({len(shown)} of {len(bad):,}, worst first):", file=out)
    rows = [["room/attempt", "rid", "verdict", "first divergence", "intact at", "layers", "pages", "segments",
             "diagnosis", "reason"]]
    rows += [_room_row(room) for room in shown]
    _table(rows, out)


def _room_row(room: RoomResult) -> list[str]:
    first = room.first_divergence
    intact = room.last_match_before_divergence
    worst = first or max(room.stages, key=lambda s: SEVERITY[s.verdict])
    c = first.comparison if first else None
    return [
        room.name,
        ",".join(room.rids) or "-",
        room.verdict,
        first.label if first else "-",
        intact.label if intact else "-",
        _ranges(c.layers) if c else "-",
        _ranges(c.pages) if c else "-",
        ",".join(c.segments) if c else "-",
        describe_room(first.diagnosis or ()) if first else "-",
        (worst.reason or "-") + (LIVE_MISMATCH if _live_mismatch(room) else ""),
    ]


LIVE_MISMATCH = "; decode said MISMATCH live"


def _live_mismatch(room: RoomResult) -> bool:
    """Decode's live verdict was mismatch where the logs cannot judge (no prefill record)."""
    return any(s.live_verdict == "mismatch" and s.verdict == "unverified" for s in room.stages)


def describe_restore(load: dict) -> str:
    """One restore mismatch in a line: pool, host rows, and the first cells (docs/hicache.md)."""
    rows = load.get("mismatch_rows", [])
    cells = load.get("cells", [])
    shown = ", ".join(f"layer {c.get('layer')} host row {c.get('host_row')} device page {c.get('device_page')} "
                      f"{c.get('segment')}" for c in cells[:3])
    more = f" (+{load.get('cells_total', len(cells)) - 3:,} cells)" if load.get("cells_total", len(cells)) > 3 else ""
    where = f" on {load['instance']}" if load.get("instance") else ""
    return (f"pool {load.get('pool')}{where}: {load.get('mismatch_rows_total', len(rows)):,} host row(s) "
            f"{rows[:8]}; {shown}{more}")
