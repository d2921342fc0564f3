"""Pack a prefill rank's exchange endpoint into one uint64 metadata slot.

Decode learns where to ask for a room's vectors from the same metadata row
that carries the room digest, so no port needs to be agreed in advance:
bits 63-48 a marker, 47-16 the IPv4 address (0 when not IPv4: decode then
uses the address SGLang's bootstrap reported for the sending rank), 15-0 the
port.
"""

from __future__ import annotations

import ipaddress

MARKER = 0xE7C4
MASK64 = (1 << 64) - 1


def pack_endpoint(host: str | None, port: int) -> int:
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} out of range")
    try:
        ip = int(ipaddress.IPv4Address(host)) if host else 0
    except ValueError:
        ip = 0
    return (MARKER << 48) | (ip << 16) | int(port)


def unpack_endpoint(value: int) -> tuple[str | None, int] | None:
    """(host or None, port), or None when the slot holds no endpoint."""
    value = int(value) & MASK64
    if value >> 48 != MARKER:
        return None
    port = value & 0xFFFF
    if port == 0:
        return None
    ip = (value >> 16) & 0xFFFFFFFF
    return (str(ipaddress.IPv4Address(ip)) if ip else None), port
