"""Entry point of the rig's spawned prefill and decode processes.

Kept tiny and import-light: 'spawn' imports this module in a fresh
interpreter whose environment already holds the probe's variables, and the
role's module (with torch, NIXL and the probe) is imported only here.
"""

from __future__ import annotations

import logging
import os
import traceback

#: set to a folder to profile each child's serving loop (its main thread) into <folder>/<role>.pstats
PROFILE_ENV = "DSV4_IDXK_RIG_PROFILE_DIR"

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
        profile_dir = os.environ.get(PROFILE_ENV)
        if not profile_dir:
            side.run()
            return
        import cProfile  # a benchmark's question: where does the serving loop's time go?

        cProfile.runctx("side.run()", {}, {"side": side}, os.path.join(profile_dir, f"{role}.pstats"))
    except BaseException as exc:  # the parent must hear about every failure
        events.put(("error", role, describe(exc)))
        raise SystemExit(2) from None
