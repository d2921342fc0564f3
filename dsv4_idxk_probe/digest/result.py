"""A room's digest, and the comparison that localises a mismatch.

A room digest keeps two small folds of its cells: a (layer, segment) matrix
and a per-page vector. One bad cell changes exactly one entry of each, so the
pair names its (layer, page, segment); several bad cells are bounded by the
cross product of the entries that differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MASK64 = (1 << 64) - 1


def _hex_words(values: np.ndarray) -> list[str]:
    """uint64 values as 16-digit lowercase hex strings: one hex pass and one split, both
    in C (the collector formats every room's vectors while holding the GIL)."""
    data = np.ascontiguousarray(values, dtype=">u8").tobytes()
    return data.hex(" ", 8).split(" ") if data else []


def _hex_rows(matrix: np.ndarray) -> list[list[str]]:
    """Rows of `_hex_words`, cut in C (`zip` over one iterator `width` times, `map(list)`)."""
    words, width = _hex_words(matrix.reshape(-1)), matrix.shape[1] if matrix.ndim == 2 else 0
    return list(map(list, zip(*[iter(words)] * width))) if width else [[] for _ in range(len(matrix))]


@dataclass
class RoomDigest:
    """Digest of one room's index-K, keyed logically (never by physical page)."""

    key: str
    signature: int
    n_tokens: int
    layer_ids: tuple[int, ...]
    segments: tuple[str, ...]
    layer_segment: np.ndarray  # uint64 [n_layers, n_segments]
    pages: np.ndarray  # uint64 [n_pages], indexed by logical page

    @property
    def n_pages(self) -> int:
        return int(self.pages.shape[0])

    @property
    def room(self) -> int:
        """The room digest: every cell folded, sum mod 2^64 (the ufunc called directly:
        `ndarray.sum` adds a Python frame, and the collector asks this for every record)."""
        return int(np.add.reduce(self.layer_segment, axis=None, dtype=np.uint64)) & MASK64

    @property
    def layers(self) -> np.ndarray:
        return self.layer_segment.sum(axis=1, dtype=np.uint64)

    @property
    def segment_vector(self) -> np.ndarray:
        return self.layer_segment.sum(axis=0, dtype=np.uint64)

    def to_record(self) -> dict[str, Any]:
        """JSON-ready form (64-bit values as 16-digit hex strings)."""
        return {
            "key": self.key,
            "signature": f"{self.signature:016x}",
            "n_tokens": self.n_tokens,
            "layer_ids": list(self.layer_ids),
            "segments": list(self.segments),
            "room": f"{self.room:016x}",
            "layer_segment": _hex_rows(self.layer_segment),
            "pages": _hex_words(self.pages),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "RoomDigest":
        """Inverse of `to_record`; raises KeyError/ValueError on a malformed record."""
        segments = tuple(record["segments"])
        layer_segment = np.array(
            [[int(v, 16) for v in row] for row in record["layer_segment"]], dtype=np.uint64
        ).reshape(len(record["layer_ids"]), len(segments))
        digest = cls(
            key=str(record["key"]),
            signature=int(record["signature"], 16),
            n_tokens=int(record["n_tokens"]),
            layer_ids=tuple(int(i) for i in record["layer_ids"]),
            segments=segments,
            layer_segment=layer_segment,
            pages=np.array([int(v, 16) for v in record["pages"]], dtype=np.uint64),
        )
        if "room" in record and int(record["room"], 16) != digest.room:
            raise ValueError("room digest does not equal the fold of its layer_segment matrix")
        return digest


@dataclass
class Comparison:
    """Outcome of comparing an expected (prefill) digest with an observed one."""

    verdict: str  # "match" | "mismatch" | "not_comparable"
    reason: str = ""
    layers: list[int] = field(default_factory=list)  # global layer ids that differ
    pages: list[int] = field(default_factory=list)  # logical pages that differ
    segments: list[str] = field(default_factory=list)
    layer_segments: list[tuple[int, str]] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """True when the differing entries pin down a single cell."""
        return len(self.layer_segments) == 1 and len(self.pages) == 1

    @property
    def cells_bound(self) -> int:
        """Upper bound on the number of differing (layer, page, segment) cells."""
        return len(self.layer_segments) * len(self.pages)

    def to_record(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "layers": self.layers,
            "pages": self.pages,
            "segments": self.segments,
            "layer_segments": [list(x) for x in self.layer_segments],
        }


def _span(layer_ids: tuple[int, ...]) -> str:
    return f"({layer_ids[0]}..{layer_ids[-1]})" if layer_ids else "()"


def compare(expected: RoomDigest, observed: RoomDigest) -> Comparison:
    """Compare two digests of the same room; localise any difference."""
    if expected.signature != observed.signature:
        return Comparison("not_comparable", "layout signature differs")
    if expected.layer_ids != observed.layer_ids:
        return Comparison(
            "not_comparable",
            f"layers differ: {len(expected.layer_ids)} layers {_span(expected.layer_ids)} "
            f"vs {len(observed.layer_ids)} {_span(observed.layer_ids)}",
        )
    if expected.segments != observed.segments:
        return Comparison("not_comparable", f"segments differ: {','.join(expected.segments)} vs {','.join(observed.segments)}")
    if expected.layer_segment.shape != observed.layer_segment.shape:
        return Comparison("not_comparable", "layer_segment shapes differ")
    if expected.n_tokens != observed.n_tokens or expected.n_pages != observed.n_pages:
        return Comparison(
            "not_comparable",
            f"room length differs: {expected.n_tokens} tokens/{expected.n_pages} pages "
            f"vs {observed.n_tokens}/{observed.n_pages}",
        )
    bad_ls = np.argwhere(expected.layer_segment != observed.layer_segment)
    bad_pages = np.flatnonzero(expected.pages != observed.pages)
    if not len(bad_ls) and not len(bad_pages):
        return Comparison("match")
    layer_segments = [(expected.layer_ids[li], expected.segments[si]) for li, si in bad_ls]
    return Comparison(
        "mismatch",
        layers=sorted({layer for layer, _ in layer_segments}),
        pages=[int(p) for p in bad_pages],
        segments=[s for s in expected.segments if any(s == seg for _, seg in layer_segments)],
        layer_segments=layer_segments,
    )
