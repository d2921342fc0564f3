"""What the rig's two processes say to each other, besides the NIXL WRITEs.

Modelled on SGLang's NIXL backend: decode pre-allocates pages and a metadata
row for a room and tells prefill where they are (SGLang's TransferInfo via
its bootstrap server); prefill WRITEs each chunk's pages with a notification
and puts the metadata row into the last WRITE. The metadata row is SGLang's
``bootstrap_room[idx, 0:8]``: slot 0 the room, slots 1..4 the in-band digest,
slot 5 the prefill rank's exchange endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

META_ROOM_SLOT = 0
META_INBAND_SLOTS = slice(1, 5)
META_ENDPOINT_SLOT = 5

_NOTIF_TAG = b"idxk"


@dataclass(frozen=True)
class TransferInfo:
    """Decode -> prefill: where a room's transferred pages and metadata row go."""

    room: int
    attempt: int
    dst_pages: tuple[int, ...]  # decode's physical pages for the transferred (logical) pages, in order
    dst_meta_row: int


def notification(room: int, attempt: int, seq: int, total: int) -> bytes:
    """Carried by each WRITE of a room; `total` (writes in all) is set on the last one only."""
    return b"%s|%d|%d|%d|%d" % (_NOTIF_TAG, room, attempt, seq, total)


def parse_notification(message: bytes) -> tuple[int, int, int, int] | None:
    """(room, attempt, seq, total) or None for a message that is not the rig's."""
    parts = bytes(message).split(b"|")
    if len(parts) != 5 or parts[0] != _NOTIF_TAG:
        return None
    try:
        room, attempt, seq, total = (int(p) for p in parts[1:])
    except ValueError:
        return None
    return room, attempt, seq, total
