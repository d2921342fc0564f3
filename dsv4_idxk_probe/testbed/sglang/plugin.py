"""The rig's SGLang plugin: loaded in the rig's servers only, never in a serving image.

`launch.rig_plugin_site` writes an entry point for this function into the run
folder and puts that folder on the servers' PYTHONPATH; SGLang's plugin
loader (``sglang.srt.plugins``) then calls it in every server process, beside
the probe's own entry point.
"""

from __future__ import annotations

import logging
import os

from .env import ENV_RIG

log = logging.getLogger("dsv4_idxk_probe.rig")


def load() -> None:
    if not os.environ.get(ENV_RIG):
        return  # an entry point found outside the rig does nothing
    try:
        from . import cpu_patches

        cpu_patches.apply()
        from . import hooks

        hooks.apply()
    except Exception:
        log.exception("dsv4-idxk-probe rig: plugin failed; the server runs without the rig's parts")
