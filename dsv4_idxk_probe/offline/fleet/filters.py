"""`--since`, `--until`, `--instance`: which keys (room, attempt) the fleet engine judges."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any


@dataclass
class Filters:
    """Which keys (room, attempt) to judge: those with a decode record whose `ts` is in
    [since, until) (a key never decoded: a prefill record's), and with a record (either
    side) whose `instance` matches one of the glob patterns. Bad lines and HiCache
    records are reported whatever the filters."""

    since: float | None = None
    until: float | None = None
    instances: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.since is not None or self.until is not None or bool(self.instances)

    def in_window(self, ts: Any) -> bool:
        if self.since is None and self.until is None:
            return True
        if type(ts) not in (int, float):
            return False
        return (self.since is None or ts >= self.since) and (self.until is None or ts < self.until)

    def instance_ok(self, instance: Any) -> bool:
        if not self.instances:
            return True
        return type(instance) is str and any(fnmatch.fnmatchcase(instance, p) for p in self.instances)


def filter_sql(filters: Filters) -> str:
    """SQL that keeps only the selected keys in `rec`, `pyrecs` and `pykeys`, judged over
    canonical and Python-read records alike ('' without filters). GLOB is case-sensitive
    and matches as `fnmatchcase` does for *, ? and [..]."""
    if not filters.active:
        return ""
    window = []
    if filters.since is not None:
        window.append(f"ts >= {float(filters.since)!r}")
    if filters.until is not None:
        window.append(f"ts < {float(filters.until)!r}")
    win = " AND ".join(window) or "true"
    inst = "true"
    if filters.instances:
        pats = " OR ".join(f"instance GLOB '{p.replace(chr(39), chr(39) * 2)}'" for p in filters.instances)
        inst = f"({pats})"
    return f"""
    CREATE TEMP TABLE allrecs AS
        SELECT room, attempt, stage <> 'prefill_send' AS decode, ts, instance FROM rec
        UNION ALL SELECT room, attempt, decode, ts, instance FROM pyrecs;
    CREATE TEMP TABLE selected AS
        SELECT room, attempt FROM allrecs GROUP BY room, attempt
        HAVING (CASE WHEN bool_or(decode) THEN bool_or(decode AND {win}) ELSE bool_or({win}) END)
           AND bool_or({inst});
    DELETE FROM rec WHERE (room, attempt) NOT IN (SELECT (room, attempt) FROM selected);
    DELETE FROM pyrecs WHERE (room, attempt) NOT IN (SELECT (room, attempt) FROM selected);
    DELETE FROM pykeys WHERE (room, attempt) NOT IN (SELECT (room, attempt) FROM selected);
    """
