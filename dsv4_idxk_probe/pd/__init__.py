"""Room life cycle on both sides of a PD transfer: digest, compare, verdict.

Plain tensors, page lists and records in; records and metrics out. No SGLang
import: the adapters in dsv4_idxk_probe.sglang and the local rig in
dsv4_idxk_probe.sim call the same API.
"""

from .decode import DecodeMonitor
from .inband import InbandDigest
from .prefill import PrefillMonitor
from .rooms import RoomId

__all__ = ["DecodeMonitor", "InbandDigest", "PrefillMonitor", "RoomId"]
