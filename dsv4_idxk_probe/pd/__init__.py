"""Room life cycle on both sides of a PD transfer: digest, compare, verdict.

Plain tensors, page lists and records in; records and metrics out. No SGLang
import: the adapters in dsv4_idxk_probe.sglang and the local rig in
dsv4_idxk_probe.testbed.builtin build their sides with the same assembly
(`PrefillAssembly`, `DecodeAssembly`: engine, monitor, exchange) and call the
same monitors. Names load on first use (the log tools read pd.records without
importing torch).
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "DecodeAssembly": ".assembly",
    "DecodeMonitor": ".decode",
    "InbandDigest": ".inband",
    "PrefillAssembly": ".assembly",
    "PrefillMonitor": ".prefill",
    "RoomId": ".rooms",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
