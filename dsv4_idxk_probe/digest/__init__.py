"""Index-K digests: layouts, the NumPy reference (the definition), the Triton
kernel and the asynchronous engine. See docs/digest.md.

Names are loaded on first use, so tools that only read digests (diff, report)
never import torch.
"""

from .._lazy import lazy_exports

_EXPORTS = {
    "BatchResult": ".engine",
    "DigestEngine": ".engine",
    "PendingDigest": ".engine",
    "DIGEST_VERSION": ".layout",
    "LayoutError": ".layout",
    "RowLayout": ".layout",
    "Segment": ".layout",
    "get_layout": ".layout",
    "layout_signature": ".layout",
    "load_layouts": ".layout",
    "shipped_layouts": ".layout",
    "Comparison": ".result",
    "RoomDigest": ".result",
    "compare": ".result",
    "RoomRequest": ".room_table",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
