"""A digest as the logs carry it, packed into bytes.

A million rooms must fit in memory and diff in under a minute, so the join
keeps each record's digest as big-endian uint64 bytes: two identical digests
(the common case) compare equal as bytes, and only a pair that differs is
unpacked into a `RoomDigest` for `digest.result.compare`. The packing, which
also checks the digest's fields, is `validation.pack_digest`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..digest.result import RoomDigest


class Packed(NamedTuple):
    """A digest as the logs carry it, packed for cheap equality and low memory."""

    signature: int
    n_tokens: int
    layer_ids: tuple
    segments: tuple
    cells: bytes  # layer_segment, row-major, big-endian uint64
    pages: bytes

    def unpack(self, key: str) -> RoomDigest:
        return RoomDigest(
            key=key,
            signature=self.signature,
            n_tokens=self.n_tokens,
            layer_ids=self.layer_ids,
            segments=self.segments,
            layer_segment=np.frombuffer(self.cells, dtype=">u8")
            .astype(np.uint64)
            .reshape(len(self.layer_ids), len(self.segments)),
            pages=np.frombuffer(self.pages, dtype=">u8").astype(np.uint64),
        )
