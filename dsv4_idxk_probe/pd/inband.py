"""The in-band digest: what rides in the free slots of the metadata row.

SGLang's `MetadataBuffers.bootstrap_room` is uint64 (rows, 8) and only slot 0
is used; slots 1..7 travel with the last chunk's aux data at no extra cost.
We use four of them: a header word, the room digest, the layout signature,
and the token count the digest covers.

The header is a marker (bits 63-48), the prefill rank's exchange port (bits
31-16; 0 when it serves none) and the digest version (bits 15-0). The port
rides in the header so the endpoint still travels where no slot is left for
it (an SGLang whose kv_checksum.py takes slots 1-3): decode pairs it with the
address SGLang's bootstrap reports for the sending rank. Where the digest is
not ready when the aux data leaves (Mooncake), prefill writes the header
alone with the `ENDPOINT_ONLY` marker: decode then learns the port but no
digest, and an older decode, which knows only `MAGIC`, reads no digest at all
(never a zero one).
"""

from __future__ import annotations

from typing import Sequence

from ..digest.layout import DIGEST_VERSION

MAGIC = 0x1D4B_0000_0000_0000  # "idxk" marker in the high bits: a digest follows
ENDPOINT_ONLY = 0x1D4C_0000_0000_0000  # the header carries the port only; the digest was not ready
MAGIC_MASK = 0xFFFF_0000_0000_0000
SLOTS = 4
_MASK64 = (1 << 64) - 1
_PORT_SHIFT = 16


def _header(marker: int, port: int, version: int) -> int:
    port = int(port or 0)
    if not 0 <= port < 65536:
        port = 0
    return marker | (port << _PORT_SHIFT) | (int(version) & 0xFFFF)


def endpoint_only_slots(port: int) -> list[int]:
    """The four slots before the digest is known: a header naming the exchange port, zeros."""
    return [_header(ENDPOINT_ONLY, port, DIGEST_VERSION), 0, 0, 0]


def port_from_slots(slots: Sequence[int]) -> int | None:
    """The exchange port a header names (digest or endpoint-only), or None."""
    if len(slots) < 1:
        return None
    header = int(slots[0]) & _MASK64
    if header & MAGIC_MASK not in (MAGIC, ENDPOINT_ONLY):
        return None
    port = (header >> _PORT_SHIFT) & 0xFFFF
    return port or None


class InbandDigest:
    """A value (equal and hashing alike by its fields; treat it as immutable), made on the
    serving thread at every send and receipt: a plain class, one Python frame and no
    C call to make (a frozen dataclass sets each field through `object.__setattr__`)."""

    __slots__ = ("room_digest", "signature", "n_tokens", "version")

    def __init__(self, room_digest: int, signature: int, n_tokens: int, version: int = DIGEST_VERSION):
        self.room_digest = room_digest
        self.signature = signature
        self.n_tokens = n_tokens
        self.version = version

    def _fields(self) -> tuple:
        return self.room_digest, self.signature, self.n_tokens, self.version

    def __eq__(self, other):
        if other.__class__ is not InbandDigest:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        return (f"InbandDigest(room_digest={self.room_digest!r}, signature={self.signature!r}, "
                f"n_tokens={self.n_tokens!r}, version={self.version!r})")

    def __reduce__(self):
        return InbandDigest, self._fields()

    def to_slots(self, port: int = 0) -> list[int]:
        """Four uint64 values for the plan's digest slots (1:5 on 0.5.18-0.5.23); `port`:
        the sending rank's exchange port, carried in the header (0: none)."""
        return [_header(MAGIC, port, self.version), self.room_digest, self.signature, self.n_tokens]

    @classmethod
    def from_slots(cls, slots: Sequence[int]) -> "InbandDigest | None":
        """None when the slots hold no probe digest (probe off on prefill, or cleared)."""
        if len(slots) < SLOTS:
            return None
        header = int(slots[0]) & _MASK64
        if header & MAGIC_MASK != MAGIC:
            return None
        return cls(int(slots[1]) & _MASK64, int(slots[2]) & _MASK64, int(slots[3]), header & 0xFFFF)
