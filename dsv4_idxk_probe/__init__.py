"""dsv4-idxk-probe: verifies DeepSeek-V4 index-K through SGLang's PD transfers and HiCache copies.

Importing this package does nothing else: the probe switches on only through
``DSV4_IDXK_PROBE`` (see dsv4_idxk_probe.environment_variables).
"""

from .version import __version__

__all__ = ["__version__"]
