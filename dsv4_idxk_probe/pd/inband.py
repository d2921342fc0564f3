"""The in-band digest: what rides in the free slots of the metadata row.

SGLang's `MetadataBuffers.bootstrap_room` is uint64 (rows, 8) and only slot 0
is used; slots 1..7 travel with the last chunk's aux data at no extra cost.
We use four of them: a magic word with the digest version, the room digest,
the layout signature, and the token count the digest covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..digest.layout import DIGEST_VERSION

MAGIC = 0x1D4B_0000_0000_0000  # "idxk" marker in the high bits
MAGIC_MASK = 0xFFFF_0000_0000_0000
SLOTS = 4


@dataclass(frozen=True)
class InbandDigest:
    room_digest: int
    signature: int
    n_tokens: int
    version: int = DIGEST_VERSION

    def to_slots(self) -> list[int]:
        """Four uint64 values for bootstrap_room[idx, 1:5]."""
        return [MAGIC | self.version, self.room_digest, self.signature, self.n_tokens]

    @classmethod
    def from_slots(cls, slots: Sequence[int]) -> "InbandDigest | None":
        """None when the slots hold no probe digest (probe off on prefill, or cleared)."""
        if len(slots) < SLOTS:
            return None
        header = int(slots[0]) & ((1 << 64) - 1)
        if header & MAGIC_MASK != MAGIC:
            return None
        return cls(
            room_digest=int(slots[1]) & ((1 << 64) - 1),
            signature=int(slots[2]) & ((1 << 64) - 1),
            n_tokens=int(slots[3]),
            version=header & 0xFFFF,
        )
