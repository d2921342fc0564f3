"""Inside the rig's servers: force the in-band digest's "not ready yet" path on prefill.

On a GPU with a transport that does not block before the metadata row leaves
(Mooncake's pinned async indices), prefill's room digest is usually not ready
at the last send, so the in-band slots stay empty and decode takes the digest
from prefill's exchange at the endpoint in the row (docs/pd.md). On CPU the
NumPy digest is ready at submit, so that late path would never run here. With
``DSV4_IDXK_RIG_DEFER_INBAND=1`` every room digest prefill submits reports
"not ready" to the in-band writer (the digest itself, the room log and the
exchange are untouched), so every room goes the late way.

Loaded through its own entry point in the rig's plugin folder (`launch.rig_plugin_site`);
does nothing unless the rig and this variable are both set.
"""

from __future__ import annotations

import logging
import os

from .env import ENV_RIG

ENV_DEFER_INBAND = "DSV4_IDXK_RIG_DEFER_INBAND"

log = logging.getLogger("dsv4_idxk_probe.rig")


class NotReadyYet:
    """A pending digest that tells the in-band writer it is not ready; all else is the real one."""

    __slots__ = ("_pending",)

    def __init__(self, pending):
        self._pending = pending

    def ready(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._pending, name)


def load() -> None:
    if not (os.environ.get(ENV_RIG) and os.environ.get(ENV_DEFER_INBAND) == "1"):
        return
    try:
        from ...pd.prefill import PrefillMonitor

        room_sent = PrefillMonitor.room_sent
        if getattr(room_sent, "_rig_deferred", False):
            return

        def deferred_room_sent(self, *args, **kwargs):
            pending = room_sent(self, *args, **kwargs)
            return None if pending is None else NotReadyYet(pending)

        deferred_room_sent._rig_deferred = True
        PrefillMonitor.room_sent = deferred_room_sent
    except Exception:
        log.exception("dsv4-idxk-probe rig: in-band deferral not applied")
