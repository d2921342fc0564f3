"""Entry point of the rig's spawned prefill and decode processes.

Kept tiny and import-light: 'spawn' imports this module in a fresh
interpreter whose environment already holds the probe's variables, and the
role's module (with torch, NIXL and the probe) is imported only here.
"""

from __future__ import annotations

import logging
import os
import traceback

#: set (to anything) to time the parts of every digest submit in each child (bench/overhead.py --profile-runs)
PART_TIMES_ENV = "DSV4_IDXK_RIG_PART_TIMES"

#: errors whose message already says what is wrong (file, field); no traceback needed
_CLEAR_ERRORS = ("ConfigError", "FaultSpecError", "PlanError", "LayoutError", "TransportError", "PeerError")


def describe(exc: BaseException) -> str:
    if type(exc).__name__ in _CLEAR_ERRORS:
        return f"{type(exc).__name__}: {exc}"
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def child_main(role: str, cfg, events, peer, control) -> None:
    """Build the role's side and run it; any failure goes to the parent as ("error", role, text)."""
    logging.basicConfig(level=logging.WARNING, format=f"[{role}] %(levelname)s %(name)s: %(message)s")
    try:
        import torch

        # One intra-op thread, as a scheduler process has: the rig's copies are
        # small, and a spinning thread pool on a shared CPU slows them 100x.
        torch.set_num_threads(1)
        if role == "prefill":
            from .prefill_side import PrefillSide as Side
        else:
            from .decode_side import DecodeSide as Side
        side = Side(cfg, events, peer, control)
        if os.environ.get(PART_TIMES_ENV) and side.monitor is not None:
            side.clock.time_parts(side.monitor.engine, side.monitor)
        side.run()
    except BaseException as exc:  # the parent must hear about every failure
        events.put(("error", role, describe(exc)))
        raise SystemExit(2) from None
