"""The end-of-run answer both test beds print: each injected fault, found or
not, where and when; and the fault spec shipped for the demo."""

from __future__ import annotations

import textwrap
from importlib import resources
from pathlib import Path
from typing import TextIO

from ...offline.printable import printable
from .verify import Verification, stage_label


def shipped_fault_spec() -> Path:
    """configs/faults/demo.yaml, as installed with the package."""
    return Path(str(resources.files("dsv4_idxk_probe").joinpath("configs", "faults", "demo.yaml")))


#: Every line of the answer fits a 100-column terminal (as the command line's own output does).
COLUMNS = 100
_DETAIL = "      "  # where the lines under a fault start


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _wrapped(text: str, first: str, rest: str = _DETAIL) -> list[str]:
    return textwrap.wrap(text, COLUMNS, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first.rstrip()]


def render(check: Verification, n_applied: int, out: TextIO) -> None:
    """The end-of-run answer: each injected fault, found or not, where and when; one line per
    fault (mark, fault, rig room, expected stage, the stage the probe saw), then where the
    probe localised it, what it diagnosed and any note, wrapped at 100 columns."""
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(check.verdicts.items()))
    for line in _wrapped(f"diff (exit {check.diff_status}): rooms by worst stage: {verdicts}", "", "  "):
        print(line, file=out)
    print(f"\ninjected faults ({n_applied} applied):", file=out)
    rows = [("", "fault", "room", "expected", "probe saw")]
    details = [[]]
    for c in check.checks:
        expected = "; ".join(dict.fromkeys(stage_label(e["stage"], e["step"]) for e in c.expected)) or "(invisible)"
        mark = "ok" if c.ok else "MISSED"
        if not c.record["applied"]:
            mark, expected = "n/a", "-"
        rows.append((mark, printable(c.label), str(c.record.get("rig_room") or c.record["room"]),  # a spec's name
                     _short(expected, 16), _short(c.seen, 16)))
        lines = []
        if c.localised != "-":
            lines += _wrapped(printable(c.localised), _DETAIL + "at ")
        if c.diagnosed != "-":
            lines += _wrapped(printable(c.diagnosed), _DETAIL + "diagnosis: ")
        if c.note:
            lines += _wrapped(printable(c.note), _DETAIL + "note: ")
        details.append(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    widths[1] = min(widths[1], COLUMNS - 2 - 2 * 4 - sum(widths) + widths[1])  # the fault's name gives way
    rows = [(r[0], _short(r[1], widths[1]), *r[2:]) for r in rows]
    for r, lines in zip(rows, details):
        print(("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths))).rstrip(), file=out)
        for line in lines:
            print(line, file=out)
    found = sum(1 for c in check.checks if c.record["applied"] and c.ok)
    tally = (f"found where and when expected: {found}/{n_applied}; mismatches no fault explains: "
             f"{len(check.unexplained)}; probe vs byte-level oracle: "
             f"{check.oracle_checked - len(check.oracle_disagreements)}/{check.oracle_checked} digest points agree")
    if check.live_disagreements:
        tally += f"; decode's own verdict differs from its digests' at {len(check.live_disagreements)} point(s)"
    print(file=out)
    for line in _wrapped(tally, "", "  "):
        print(line, file=out)
    for problem in (check.unexplained + check.oracle_disagreements + check.live_disagreements)[:20]:
        for line in _wrapped(problem, "  ! ", "    "):
            print(line, file=out)
    if check.unfinished:
        print(f"rooms never verified at decode_finish (unverified): {len(check.unfinished)}", file=out)
    print("RESULT: " + ("every injected fault found, localised, at its first stage; nothing else reported"
                        if check.ok else "the probe MISSED or INVENTED something (see above)"), file=out)
