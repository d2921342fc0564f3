"""Prefill -> decode side channel for the per-room digest vectors.

The room digest rides in band (SGLang's metadata row); the (layer, segment)
matrix and page vector that localise a mismatch are served by each prefill
scheduler from its bounded table of recent rooms, over TCP with a shared
secret (docs/security.md)::

    server = VectorServer(monitor.lookup, bind="10.0.0.5", port=0, secret_file="/etc/probe/secret")
    server.start()                      # daemon thread; server.endpoint -> (host, port)
    client = VectorClient(timeout_ms=200, secret_file="/etc/probe/secret")
    digest = client.fetch(server.endpoint, "1234/0")   # RoomDigest, or None
    client.close(); server.close()

No SGLang import here. A dead or slow peer costs at most one timeout per
backoff period and yields None (the room is then judged on its in-band
digest alone, or `unverified`); it never raises into the caller.
"""

from .endpoint import pack_endpoint, unpack_endpoint

__all__ = ["ExchangeError", "VectorClient", "VectorServer", "pack_endpoint", "unpack_endpoint"]

_LAZY = {"VectorClient": ".client", "VectorServer": ".server", "ExchangeError": ".protocol"}


def __getattr__(name):
    """The exchange's modules (and msgspec) are imported only by the sides that use it."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
