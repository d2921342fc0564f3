"""The digest, defined in NumPy.

This module *is* the definition written out in docs/digest.md; the Triton
kernel must agree with it bit for bit. It also digests host memory (HiCache
host pools, the CPU rig) where no GPU is involved.

Arithmetic, per row:
  * the row is read as little-endian 32-bit words; word j sits at byte 4*j;
  * each frozen word w of segment s is salted by its position,
    x = w ^ (j * SALT_MUL + SALT_ADD), and mixed into two lanes by two
    bijections of x:  a = m(x * MIX_A), b = (x ^ (x >> 15)) * MIX_B,
    with m(v) = v ^ (v >> 16), all mod 2^32;
  * lane sums are taken mod 2^32 (order-free, so any tiling gives the same
    value) and the segment digest is d = (sum_b << 32) | sum_a;
  * the cell (layer id, logical page, segment) contributes
    c = fmix64(d ^ cell_salt), folded by sums mod 2^64;
  * d itself is the cell's content digest: it depends on the frozen bytes
    only, not on the room, layer or logical page, so equal contents are
    found wherever they sit (docs/digest.md, "Content digests").
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

from .layout import RowLayout, layout_signature
from .result import RoomDigest

# 32-bit word mixing (docs/digest.md, "Words").
SALT_MUL = 0x9E3779B1
SALT_ADD = 0x7F4A7C15
MIX_A = 0x85EBCA6B
MIX_B = 0xC2B2AE35
# 64-bit cell salting and finalisation (docs/digest.md, "Cells").
CELL_LAYER = 0x9E3779B97F4A7C15
CELL_PAGE = 0xC2B2AE3D27D4EB4F
CELL_SEGMENT = 0x165667B19E3779F9
FMIX_1 = 0xFF51AFD7ED558CCD
FMIX_2 = 0xC4CEB9FE1A85EC53

_U32 = np.uint64(0xFFFFFFFF)


def _as_rows(rows) -> np.ndarray:
    array = rows.numpy() if hasattr(rows, "numpy") else np.asarray(rows)
    if array.dtype != np.uint8 or array.ndim != 2:
        raise ValueError(f"rows must be a 2-D uint8 array, got {array.dtype} {array.shape}")
    return np.ascontiguousarray(array)


def segment_digests(rows, frozen_slots, layout: RowLayout) -> np.ndarray:
    """Digest of each (row, segment) over its frozen slots: uint64 [n_rows, n_segments].

    All word arithmetic is in uint32, which NumPy wraps mod 2^32 exactly as
    the definition asks; only rows with unfrozen slots (a room's tail page)
    pay for masking.
    """
    rows = _as_rows(rows)
    if rows.shape[1] != layout.row_bytes:
        raise ValueError(f"rows have {rows.shape[1]} bytes, layout {layout.name!r} has {layout.row_bytes}")
    frozen = np.asarray(frozen_slots, dtype=np.int64).reshape(-1)
    if frozen.shape[0] != rows.shape[0]:
        raise ValueError(f"{frozen.shape[0]} frozen counts for {rows.shape[0]} rows")
    words = rows.view("<u4")
    partial = np.flatnonzero(frozen < layout.slots)
    out = np.zeros((rows.shape[0], len(layout.segments)), dtype=np.uint64)
    for s, seg in enumerate(layout.segments):
        n_words = layout.slots * seg.slot_words
        j = np.arange(seg.word_offset, seg.word_offset + n_words, dtype=np.uint32)
        salt = j * np.uint32(SALT_MUL) + np.uint32(SALT_ADD)
        x = words[:, seg.word_offset : seg.word_offset + n_words] ^ salt
        a = x ^ (x >> np.uint32(16))  # lane A: fmix32(x)
        a *= np.uint32(MIX_A)
        a ^= a >> np.uint32(13)
        a *= np.uint32(MIX_B)
        a ^= a >> np.uint32(16)
        b = (x ^ (x >> np.uint32(15))) * np.uint32(MIX_B)
        if partial.size:
            cut = np.arange(n_words) >= (frozen[partial] * seg.slot_words)[:, None]
            a[partial] = np.where(cut, np.uint32(0), a[partial])
            b[partial] = np.where(cut, np.uint32(0), b[partial])
        sum_a = a.sum(axis=1, dtype=np.uint32).astype(np.uint64)
        sum_b = b.sum(axis=1, dtype=np.uint32).astype(np.uint64)
        out[:, s] = (sum_b << np.uint64(32)) | sum_a
    return out


def fmix64(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: a bijection, so distinct inputs stay distinct."""
    k = np.asarray(values, dtype=np.uint64).copy()
    k ^= k >> np.uint64(33)
    k *= np.uint64(FMIX_1)
    k ^= k >> np.uint64(33)
    k *= np.uint64(FMIX_2)
    k ^= k >> np.uint64(33)
    return k


def cell_contributions(digests: np.ndarray, layer_ids, logical_pages) -> np.ndarray:
    """c = fmix64(d ^ salt(layer id, logical page, segment)) for each (row, segment)."""
    layer_ids = np.asarray(layer_ids, dtype=np.uint64).reshape(-1, 1)
    pages = np.asarray(logical_pages, dtype=np.uint64).reshape(-1, 1)
    segs = np.arange(1, digests.shape[1] + 1, dtype=np.uint64).reshape(1, -1)
    salt = layer_ids * np.uint64(CELL_LAYER) + pages * np.uint64(CELL_PAGE) + segs * np.uint64(CELL_SEGMENT)
    return fmix64(digests ^ salt)


def fold_cells(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fold one room's cell contributions, uint64 [layers, pages, segments], into its
    (layer, segment) matrix and its page vector (sums mod 2^64).

    Each sum runs over a contiguous axis: NumPy reduces the middle axis of a
    [layers, pages, 2] block much slower, and this runs on the collector
    thread, holding the GIL the serving thread may want."""
    add = np.add.reduce  # not `ndarray.sum`, which adds a Python frame per call
    by_layer = add(np.ascontiguousarray(block.transpose(0, 2, 1)), axis=2, dtype=np.uint64)
    by_page = add(add(block, axis=0, dtype=np.uint64), axis=1, dtype=np.uint64)
    return by_layer, by_page


def room_contents(buffers: Sequence, physical_pages, n_tokens: int, layout: RowLayout) -> np.ndarray:
    """Every cell's content digest of one room: uint64 [layers, pages, segments], the
    segment digest d of each (layer, logical page, segment), unsalted."""
    pages = np.asarray(physical_pages, dtype=np.int64).reshape(-1)
    n_pages = len(pages)
    frozen = np.array([layout.frozen_slots(n_tokens, k) for k in range(n_pages)], dtype=np.int64)
    contents = np.zeros((len(buffers), n_pages, len(layout.segments)), dtype=np.uint64)
    for li, buf in enumerate(buffers):
        if n_pages:
            contents[li] = segment_digests(_as_rows(buf)[pages], frozen, layout)
    return contents


def room_cells(buffers: Sequence, physical_pages, n_tokens: int, layout: RowLayout, layer_ids: Sequence[int]) -> np.ndarray:
    """Every cell contribution of one room: uint64 [layers, pages, segments]."""
    contents = room_contents(buffers, physical_pages, n_tokens, layout)
    cells = np.zeros_like(contents)
    for li, layer_id in enumerate(layer_ids[: len(buffers)]):
        n_pages = contents.shape[1]
        cells[li] = cell_contributions(contents[li], [layer_id] * n_pages, np.arange(n_pages))
    return cells


@lru_cache(maxsize=None)
def zero_content_digest(layout: RowLayout, segment: int, frozen_slots: int) -> int:
    """The content digest of an all-zero cell: segment `segment` (its index in
    `layout.segments`, the last axis of a contents array) of a row of zero bytes with
    `frozen_slots` frozen slots. A page that was zeroed shows this value."""
    if not 0 <= segment < len(layout.segments):
        raise ValueError(f"layout {layout.name!r} has {len(layout.segments)} segments, no segment {segment}")
    if not 0 <= frozen_slots <= layout.slots:
        raise ValueError(f"frozen_slots must be 0..{layout.slots}, got {frozen_slots}")
    row = np.zeros((1, layout.row_bytes), dtype=np.uint8)
    return int(segment_digests(row, [frozen_slots], layout)[0, segment])


def digest_room(
    buffers: Sequence,
    physical_pages,
    n_tokens: int,
    layout: RowLayout,
    layer_ids: Sequence[int],
    key: str = "",
) -> RoomDigest:
    """Reference digest of one room.

    `buffers[i]` is layer `layer_ids[i]`'s index-K buffer, uint8 [pages, row_bytes];
    logical page k of the room is physical page `physical_pages[k]`; the room
    holds `n_tokens` tokens from the start of logical page 0.
    """
    if len(buffers) != len(layer_ids):
        raise ValueError(f"{len(buffers)} buffers for {len(layer_ids)} layer ids")
    layer_segment, page_vector = fold_cells(room_cells(buffers, physical_pages, n_tokens, layout, layer_ids))
    return RoomDigest(
        key=key,
        signature=layout_signature(layout, layer_ids),
        n_tokens=n_tokens,
        layer_ids=tuple(int(i) for i in layer_ids),
        segments=layout.segment_names,
        layer_segment=layer_segment,
        pages=page_vector,
    )
