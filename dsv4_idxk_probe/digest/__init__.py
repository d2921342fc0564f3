"""Index-K digests: layouts, the NumPy reference (the definition), the Triton
kernel and the asynchronous engine. See docs/digest.md.

Names are loaded on first use, so tools that only read digests (diff, report)
never import torch.
"""

from importlib import import_module

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
    "RoomRequest": ".worklist",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
