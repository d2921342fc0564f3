"""The in-band digest: what rides in the free slots of the metadata row.

SGLang's `MetadataBuffers.bootstrap_room` is uint64 (rows, 8) and only slot 0
is used; slots 1..7 travel with the last chunk's aux data at no extra cost.
We use four of them: a magic word with the digest version, the room digest,
the layout signature, and the token count the digest covers.
"""

from __future__ import annotations

from typing import Sequence

from ..digest.layout import DIGEST_VERSION

MAGIC = 0x1D4B_0000_0000_0000  # "idxk" marker in the high bits
MAGIC_MASK = 0xFFFF_0000_0000_0000
SLOTS = 4
_MASK64 = (1 << 64) - 1


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

    def to_slots(self) -> list[int]:
        """Four uint64 values for bootstrap_room[idx, 1:5]."""
        return [MAGIC | self.version, self.room_digest, self.signature, self.n_tokens]

    @classmethod
    def from_slots(cls, slots: Sequence[int]) -> "InbandDigest | None":
        """None when the slots hold no probe digest (probe off on prefill, or cleared)."""
        if len(slots) < SLOTS:
            return None
        header = int(slots[0]) & _MASK64
        if header & MAGIC_MASK != MAGIC:
            return None
        return cls(int(slots[1]) & _MASK64, int(slots[2]) & _MASK64, int(slots[3]), header & 0xFFFF)
