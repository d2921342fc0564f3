"""Content digests: a cell's digest that does not depend on where the cell sits.

A cell's content digest is its segment digest `d` (docs/digest.md, "Words"):
it depends on the bytes, the segment and the number of frozen slots, not on
the room, the layer or the logical page. The same bytes found in another
room's page, or left by a page's previous occupant, give the same `d`.

The digest engine hands out `d` per room (`BatchResult.contents`, stored by
the kernel beside each cell's contribution). `content_digests` reads the
same `d` back from contributions alone, `c = fmix64(d XOR salt(layer, page,
segment))` (fmix64 is a bijection with a known inverse, the salt is known):
for tools that hold only cells, and as a check of the engine's contents.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..digest import reference
from ..digest.layout import RowLayout

# Multiplicative inverses mod 2^64 of fmix64's odd constants.
_INV_1 = pow(reference.FMIX_1, -1, 1 << 64)
_INV_2 = pow(reference.FMIX_2, -1, 1 << 64)


def unfmix64(values: np.ndarray) -> np.ndarray:
    """Inverse of `reference.fmix64` (x ^= x >> 33 is its own inverse: 33 > 32)."""
    k = np.asarray(values, dtype=np.uint64).copy()
    k ^= k >> np.uint64(33)
    k *= np.uint64(_INV_2)
    k ^= k >> np.uint64(33)
    k *= np.uint64(_INV_1)
    k ^= k >> np.uint64(33)
    return k


def content_digests(cells: np.ndarray, layer_ids) -> np.ndarray:
    """Content digest `d` of each cell of one room, from its contributions.

    `cells` is uint64 [layers, pages, segments] (the engine's block of one
    room, logical page k at index k); the result has the same shape.
    """
    cells = np.asarray(cells, dtype=np.uint64)
    n_layers, n_pages, n_segments = cells.shape
    layers = np.asarray(layer_ids, dtype=np.uint64).reshape(-1, 1, 1)
    pages = np.arange(n_pages, dtype=np.uint64).reshape(1, -1, 1)
    segs = np.arange(1, n_segments + 1, dtype=np.uint64).reshape(1, 1, -1)
    salt = (layers * np.uint64(reference.CELL_LAYER) + pages * np.uint64(reference.CELL_PAGE)
            + segs * np.uint64(reference.CELL_SEGMENT))
    return unfmix64(cells) ^ salt


def zero_cell_digests(layout: RowLayout, frozen_slots) -> np.ndarray:
    """Content digest of an all-zero cell, uint64 [pages, segments], for each page's
    frozen slot count (`reference.zero_content_digest`, the definition): a lookup in
    the layout's table, since every room the collector tracks needs one."""
    frozen = np.asarray(frozen_slots, dtype=np.int64).reshape(-1)
    return zero_table(layout)[frozen]


@lru_cache(maxsize=16)
def zero_table(layout: RowLayout) -> np.ndarray:
    """uint64 [slots + 1, segments]: row n is the zero cell's content with n frozen slots
    (read-only: every caller shares it)."""
    table = np.array([[reference.zero_content_digest(layout, s, n) for s in range(len(layout.segments))]
                      for n in range(layout.slots + 1)], dtype=np.uint64)
    table.flags.writeable = False
    return table
