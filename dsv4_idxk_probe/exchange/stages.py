"""One room served by several prefill pipeline stages: fetch each stage's digest, combine them.

With prefill PP > 1 and decode PP 1, each prefill stage holds (and digests)
only its own layers, and every stage sends its aux data into the same
metadata row on decode, so no in-band digest describes the whole room. Each
stage's exchange serves its own digest; decode fetches all of them and
combines them into the digest of the whole room, which compares with its own:

* a cell's digest is salted with its global layer id (digest/kernel.py), so
  the stages' (layer, segment) rows stack, in layer order, into the room's;
* the page vector and the room digest are sums mod 2^64 over cells, so the
  stages' sum to the room's;
* each stage's signature must be the one decode's layout gives that stage's
  layers (else the stages digested another layout: not comparable), and the
  union of their layers the one decode's own signature covers.

No SGLang import: the stages' endpoints come from the SGLang adapter.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..digest.layout import layout_signature
from ..digest.result import RoomDigest

Endpoint = tuple[str, int]


class StageEndpoints(tuple):
    """The exchange endpoints of every prefill PP stage of a room, in stage order, with
    what decode needs to combine their digests (its layout)."""

    layout: Any

    def __new__(cls, endpoints: Sequence[Endpoint], layout: Any):
        self = super().__new__(cls, tuple(tuple(e) for e in endpoints))
        self.layout = layout
        return self

    def describe(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self)


def describe_endpoint(endpoint: Any) -> str:
    """"host:port", or every stage's, comma-separated."""
    if isinstance(endpoint, StageEndpoints):
        return endpoint.describe()
    return f"{endpoint[0]}:{endpoint[1]}"


#: A signature no digest has: the combined digest is then "not comparable", never a mismatch.
_INCOMPARABLE = 0


def combine_stage_digests(key: str, digests: Sequence[RoomDigest], layout: Any) -> RoomDigest | None:
    """The whole room's digest from its stages' (None when there are none).

    Stages whose signatures do not match `layout`, whose token counts, segments
    or page counts differ, or whose layers overlap yield a digest with a
    signature that compares as "not comparable". A stage's digest of no layers
    (a further pool that stage does not have) is left out."""
    if not digests:
        return None
    # a stage holding none of this pool's layers answers with no layers: it adds nothing
    digests = [d for d in digests if d.layer_ids] or digests[:1]
    first = digests[0]
    comparable = all(
        d.signature == layout_signature(layout, d.layer_ids)
        and d.n_tokens == first.n_tokens and tuple(d.segments) == tuple(first.segments) and d.n_pages == first.n_pages
        for d in digests
    )
    n_segments = len(first.segments)
    rows = sorted(((int(layer), d.layer_segment[i]) for d in digests for i, layer in enumerate(d.layer_ids)),
                  key=lambda row: row[0])
    layer_ids = tuple(layer for layer, _ in rows)
    comparable = comparable and len(set(layer_ids)) == len(layer_ids)
    if not all(np.shape(row) == (n_segments,) for _, row in rows):  # stages of other segments: nothing stacks
        comparable, rows = False, []
    matrix = (np.stack([row for _, row in rows]).astype(np.uint64) if rows
              else np.zeros((0, n_segments), dtype=np.uint64))
    pages = np.zeros(first.n_pages, dtype=np.uint64)
    if comparable:
        for d in digests:
            pages += np.asarray(d.pages, dtype=np.uint64)  # wraps mod 2^64, as the kernel's folds do
    return RoomDigest(
        key=key,
        signature=layout_signature(layout, layer_ids) if comparable else _INCOMPARABLE,
        n_tokens=first.n_tokens,
        layer_ids=layer_ids,
        segments=tuple(first.segments),
        layer_segment=matrix,
        pages=pages,
    )
