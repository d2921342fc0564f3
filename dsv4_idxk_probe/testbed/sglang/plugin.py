"""The rig's SGLang plugin: loaded in the rig's servers only, never in a serving image.

`launch.rig_plugin_site` writes an entry point for this function into the run
folder and puts that folder on the servers' PYTHONPATH; SGLang's plugin
loader (``sglang.srt.plugins``) then calls it in every server process, beside
the probe's own entry point.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("dsv4_idxk_probe.rig")

ENV_RIG = "DSV4_IDXK_RIG"  # set by the rig's launcher in its servers' environment
ENV_ROLE = "DSV4_IDXK_RIG_ROLE"  # prefill | decode | router
ENV_PLAN = "DSV4_IDXK_RIG_PLAN"  # the driver's plan file (rids, fault spec, seed)
ENV_OUT = "DSV4_IDXK_RIG_OUT"  # folder for the oracle's and the injector's records


def load() -> None:
    if not os.environ.get(ENV_RIG):
        return  # an entry point found outside the rig does nothing
    try:
        from . import cpu_patches

        cpu_patches.apply()
        from . import inserver

        inserver.apply()
    except Exception:
        log.exception("dsv4-idxk-probe rig: plugin failed; the server runs without the rig's parts")
