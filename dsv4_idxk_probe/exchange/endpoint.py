"""Pack a prefill rank's exchange endpoint into one uint64 metadata slot.

Decode learns where to ask for a room's vectors from the same metadata row
that carries the room digest, so no port needs to be agreed in advance:
bits 63-48 a marker, 47-16 the IPv4 address (0 when not IPv4: decode then
uses the address SGLang's bootstrap reported for the sending rank), 15-0 the
port.

Where the row has no slot for it, the port rides in the in-band digest's
header (pd/inband.py) and decode pairs it with the sending rank's address
from SGLang's bootstrap (``rank_ip``). Where neither travels (every PP stage
writes the same row; an SGLang whose own slots leave none), decode rebuilds
the endpoint by the port rule, when one is configured: ``exchange.port_offset``
makes every prefill rank listen on its KV manager's ``rank_port`` (which the
bootstrap reports to decode) plus that offset (`rule_port`).
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


def rule_port(rank_port: int | None, offset: int) -> int | None:
    """The exchange port the ``port_offset`` rule gives a rank whose transport listens on
    `rank_port`; None when the rule is off or the result is not a port."""
    if not offset or not rank_port:
        return None
    port = int(rank_port) + int(offset)
    return port if 0 < port < 65536 else None


def rebuild_endpoint(slot_value: int | None, header_port: int | None, rank_ip: str | None,
                     rank_port: int | None, offset: int) -> tuple[str, int] | None:
    """Where to ask for a room's vectors, from whatever reached decode, best first: the
    endpoint slot (its host, else `rank_ip`); the header's port at `rank_ip`; the port rule
    at `rank_ip`. None when nothing names a port or no host is known."""
    packed = unpack_endpoint(slot_value) if slot_value is not None else None
    if packed is not None:
        host = packed[0] or rank_ip
        return (host, packed[1]) if host else None
    if not rank_ip:
        return None
    port = header_port or rule_port(rank_port, offset)
    return (rank_ip, int(port)) if port else None
