"""HiCache host-pool checks, independent of SGLang.

Usage (adapters do this; see dsv4_idxk_probe/sglang/hicache.py)::

    probe = probe_for(runtime)                  # one per runtime, config from runtime.config.hicache
    state = probe.register(pool, geometry, views)
    call = probe.begin(state, "d2h", host_idx, dev_idx, io_backend)
    ...original copy...
    probe.end(call, ok=True)

What is counted and why: docs/hicache.md.

Names are loaded on first use, so the log tools that read round-trip records
(`diff`, `report`, through `hicache.culprit`) never import torch.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "BRANCHES": ".branches",
    "DIRECTIONS": ".branches",
    "NO_IO_BACKEND": ".branches",
    "classify": ".branches",
    "label_sets": ".branches",
    "DeviceBuffer": ".geometry",
    "PoolGeometry": ".geometry",
    "TokenRow": ".geometry",
    "invariant_failures": ".geometry",
    "token_row_mismatches": ".geometry",
    "CHECK_LABELS": ".indexcheck",
    "Flusher": ".indexcheck",
    "IndexChecker": ".indexcheck",
    "GuardRefused": ".probe",
    "HiCacheProbe": ".probe",
    "forget": ".probe",
    "probe_for": ".probe",
    "probe_if_made": ".probe",
    "LEGS": ".legs",
    "RestoreVerifier": ".restore",
    "HostPageDigests": ".restore_store",
    "compare_load": ".restore_compare",
    "RoundTrip": ".roundtrip",
    "RowViews": ".roundtrip",
    "HiCacheConfigError": ".settings",
    "HiCacheSettings": ".settings",
    "parse_settings": ".settings",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
