"""The end-of-run answer both test beds print: each injected fault, found or
not, where and when; and the fault spec shipped for the demo."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TextIO

from .verify import Verification, stage_label


def shipped_fault_spec() -> Path:
    """configs/faults/demo.yaml, as installed with the package."""
    return Path(str(resources.files("dsv4_idxk_probe").joinpath("configs", "faults", "demo.yaml")))


def _short(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def render(check: Verification, n_applied: int, out: TextIO) -> None:
    """The end-of-run answer: each injected fault, found or not, where and when."""
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(check.verdicts.items()))
    print(f"diff (exit {check.diff_status}): rooms by worst stage: {verdicts}", file=out)
    print(f"\ninjected faults ({n_applied} applied):", file=out)
    rows = [("", "fault", "room", "expected", "probe saw", "where", "diagnosis", "")]
    for c in check.checks:
        expected = "; ".join(dict.fromkeys(stage_label(e["stage"], e["step"]) for e in c.expected)) or "(invisible)"
        mark = "ok" if c.ok else "MISSED"
        if not c.record["applied"]:
            mark, expected = "n/a", "-"
        rows.append((mark, c.label, str(c.record.get("rig_room") or c.record["room"]), expected, c.seen, c.localised,
                     _short(c.diagnosed), c.note))
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    for r in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(r[:7], widths)) + (f"  {r[7]}" if r[7] else ""), file=out)
    found = sum(1 for c in check.checks if c.record["applied"] and c.ok)
    print(f"\nfound where and when expected: {found}/{n_applied}; mismatches no fault explains: "
          f"{len(check.unexplained)}; probe vs byte-level oracle: {check.oracle_checked - len(check.oracle_disagreements)}"
          f"/{check.oracle_checked} digest points agree", file=out)
    for line in (check.unexplained + check.oracle_disagreements)[:20]:
        print(f"  ! {line}", file=out)
    if check.unfinished:
        print(f"rooms never verified at decode_finish (unverified): {len(check.unfinished)}", file=out)
    print("RESULT: " + ("every injected fault found, localised, at its first stage; nothing else reported"
                        if check.ok else "the probe MISSED or INVENTED something (see above)"), file=out)
