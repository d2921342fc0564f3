"""The room plan both test beds hand to their fault machinery: one request's
prompt, the pages decode already holds, and its decode steps. Neutral: no rig
knobs here (the built-in rig's are in `testbed.builtin.config`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ...vocabulary import PAGE_TOKENS


class PlanError(ValueError):
    """A rig setting out of range; the message names it."""


@dataclass(frozen=True)
class RoomPlan:
    """One request: its prompt, the pages decode already holds, and its decode steps."""

    room: int
    prompt_tokens: int
    prefix_pages: int
    steps: int

    @property
    def pages(self) -> int:
        """Pages of the whole prompt (the last may be partial)."""
        return math.ceil(self.prompt_tokens / PAGE_TOKENS)

    @property
    def total_pages(self) -> int:
        """Pages the room holds on decode by its last step (prompt plus generated tokens)."""
        return math.ceil((self.prompt_tokens + self.steps) / PAGE_TOKENS)

    @property
    def sent_pages(self) -> int:
        """Pages that travel: everything after the decode-side prefix."""
        return self.pages - self.prefix_pages

    @property
    def sent_tokens(self) -> int:
        """Tokens the digest covers, counted from the first transferred page."""
        return self.prompt_tokens - self.prefix_pages * PAGE_TOKENS


def explicit_plan(rows: Sequence[tuple[int, int, int, int]]) -> tuple[RoomPlan, ...]:
    """(room, prompt_tokens, prefix_pages, steps) rows, checked; for tests and scripted runs."""
    out = []
    for room, tokens, prefix, steps in rows:
        plan = RoomPlan(int(room), int(tokens), int(prefix), int(steps))
        if plan.prompt_tokens < 1 or plan.steps < 0 or not 0 <= plan.prefix_pages < plan.pages:
            raise PlanError(f"room {room}: need tokens >= 1, steps >= 0 and 0 <= prefix_pages < pages, got {plan}")
        out.append(plan)
    if len({p.room for p in out}) != len(out):
        raise PlanError("room ids in an explicit plan must be distinct")
    return tuple(out)
