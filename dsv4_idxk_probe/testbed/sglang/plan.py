"""Inside the rig's servers: what the driver planned.

The rig's driver (`run`) hands each server a plan file (``DSV4_IDXK_RIG_PLAN``:
the requests by rid, the fault spec, the seed, whether to scribble freed
pages, the requests whose transfer prefill fails); it replaces the file for a new phase, and the servers re-read it when
it changed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Plan:
    rooms: dict[str, int]  # rid -> rig room number
    seed: int
    scribble_freed: bool = False  # overwrite a finished room's pages right after SGLang frees them
    fail_transfer: frozenset = frozenset()  # rids whose KV transfer prefill fails on purpose
    faults: Any = None  # testbed.faults.spec.FaultSpec
    by_room: dict[int, list] = field(default_factory=dict)  # rig room -> faults that hit it

    @classmethod
    def load(cls, path: str) -> "Plan":
        doc = json.loads(Path(path).read_text())
        plan = cls({str(k): int(v) for k, v in doc["rooms"].items()}, int(doc.get("seed", 0)),
                   bool(doc.get("scribble_freed", False)), frozenset(str(r) for r in doc.get("fail_transfer", ())))
        if doc.get("faults"):
            from ..faults.spec import load_fault_spec
            from ..faults.plan import RoomPlan

            plan.faults = load_fault_spec(doc["faults"])
            rooms = [RoomPlan(room=r, prompt_tokens=1, prefix_pages=0, steps=0) for r in sorted(plan.rooms.values())]
            plan.by_room = plan.faults.by_room(rooms, plan.seed)
        return plan


class PlanFile:
    """The driver's plan file and the plan last read from it."""

    def __init__(self, path: str):
        self.path = path
        self.mtime = None
        self.plan = Plan({}, 0)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the plan when the driver replaced it (a new phase)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if mtime != self.mtime:
            self.plan = Plan.load(self.path)
            self.mtime = mtime

    def faults_for(self, rid: str, when: tuple[str, ...]) -> list:
        """The planned faults of the room `rid` due at one of the `when` points."""
        rig_room = self.plan.rooms.get(rid)
        if rig_room is None:
            return []
        return [f for f in self.plan.by_room.get(rig_room, []) if f.when in when]
