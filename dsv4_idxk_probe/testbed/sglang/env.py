"""The environment variables through which the rig's driver talks to its servers.

In a module of their own, so that the plugin, the launcher, the driver and the
in-server parts read the same names without importing one another.
"""

from __future__ import annotations

ENV_RIG = "DSV4_IDXK_RIG"  # set by the rig's launcher in its servers' environment
ENV_ROLE = "DSV4_IDXK_RIG_ROLE"  # prefill | decode | router
ENV_PLAN = "DSV4_IDXK_RIG_PLAN"  # the driver's plan file (rids, fault spec, seed)
ENV_OUT = "DSV4_IDXK_RIG_OUT"  # folder for the oracle's and the injector's records
