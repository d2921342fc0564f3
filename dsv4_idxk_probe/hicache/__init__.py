"""HiCache host-pool checks, independent of SGLang.

Usage (adapters do this; see dsv4_idxk_probe/sglang/hicache.py)::

    probe = probe_for(runtime)                  # one per runtime, config from runtime.config.hicache
    state = probe.register(pool, geometry, views)
    call = probe.begin(state, "d2h", host_idx, dev_idx, io_backend)
    ...original copy...
    probe.end(call, ok=True)

What is counted and why: docs/hicache.md.
"""

from .branches import BRANCHES, DIRECTIONS, NO_IO_BACKEND, classify, label_sets
from .geometry import DeviceBuffer, PoolGeometry, TokenRow, invariant_failures, token_row_mismatches
from .indexcheck import CHECK_LABELS, Flusher, IndexChecker
from .probe import GuardRefused, HiCacheProbe, forget, probe_for
from .roundtrip import LEGS, RoundTrip, RowViews
from .settings import HiCacheConfigError, HiCacheSettings, parse_settings

__all__ = [
    "BRANCHES",
    "CHECK_LABELS",
    "DIRECTIONS",
    "LEGS",
    "NO_IO_BACKEND",
    "DeviceBuffer",
    "Flusher",
    "GuardRefused",
    "HiCacheConfigError",
    "HiCacheProbe",
    "HiCacheSettings",
    "IndexChecker",
    "PoolGeometry",
    "RoundTrip",
    "RowViews",
    "TokenRow",
    "classify",
    "forget",
    "invariant_failures",
    "label_sets",
    "parse_settings",
    "probe_for",
    "token_row_mismatches",
]
