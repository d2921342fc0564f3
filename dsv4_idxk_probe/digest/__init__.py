"""Index-K digests: layouts, the NumPy reference (the definition), the Triton
kernel and the asynchronous engine. See docs/digest.md."""

from .engine import BatchResult, DigestEngine
from .layout import DIGEST_VERSION, LayoutError, RowLayout, Segment, get_layout, layout_signature, load_layouts, shipped_layouts
from .result import Comparison, RoomDigest, compare
from .worklist import RoomRequest

__all__ = [
    "BatchResult",
    "Comparison",
    "DIGEST_VERSION",
    "DigestEngine",
    "LayoutError",
    "RoomDigest",
    "RoomRequest",
    "RowLayout",
    "Segment",
    "compare",
    "get_layout",
    "layout_signature",
    "load_layouts",
    "shipped_layouts",
]
