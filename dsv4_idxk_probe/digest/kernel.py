"""Triton kernel: digest many rooms' index-K rows in one launch.

One program digests ROWS consecutive (room, layer, logical page) rows: it
finds each row through its layer's base address and its room's page table
(all ROWS look-ups at once, so their latency is paid once), hashes the
frozen words of each segment into two 32-bit lane sums, turns each segment digest
into its cell contribution, and adds that into the room's (layer, segment)
matrix and page vector with relaxed 64-bit atomics (only atomicity is needed: results are read
after the kernel). Sums mod 2^32 / 2^64 do not
depend on tiling or on the order programs run in, which is what lets this
kernel agree bit for bit with `reference.py`.

The same code reads device memory and pinned host memory (through the
pointer the GPU can address), and runs under ``TRITON_INTERPRET=1`` on CPU
tensors, which is how CI checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref

# %% kernel

_SALT_MUL = tl.constexpr(ref.SALT_MUL)
_SALT_ADD = tl.constexpr(ref.SALT_ADD)
_MIX_A = tl.constexpr(ref.MIX_A)
_MIX_B = tl.constexpr(ref.MIX_B)
_CELL_LAYER = tl.constexpr(ref.CELL_LAYER)
_CELL_PAGE = tl.constexpr(ref.CELL_PAGE)
_CELL_SEGMENT = tl.constexpr(ref.CELL_SEGMENT)
_FMIX_1 = tl.constexpr(ref.FMIX_1)
_FMIX_2 = tl.constexpr(ref.FMIX_2)

WORK_COLUMNS = 4  # room slot, layer index, logical page, frozen slots
ROOM_COLUMNS = 3  # page-table address, (layer, segment) block offset, page block offset
LAYER_COLUMNS = 2  # buffer base address, global layer id
SEGMENT_COLUMNS = 2  # word offset in the row, words per slot


@triton.jit
def _fmix64(k):
    k = k ^ (k >> 33)
    k = k * _FMIX_1
    k = k ^ (k >> 33)
    k = k * _FMIX_2
    return k ^ (k >> 33)


@triton.jit(do_not_specialize=["n_items"])  # one compiled kernel whatever the batch size
def _digest_rows_kernel(
    work_ptr,  # int32 [n_items, 4]: room slot, layer index, logical page, frozen slots
    room_ptr,  # int64 [n_rooms, 3]: address of the room's int64 physical pages, LS offset, page offset
    layer_ptr,  # int64 [n_layers, 2]: address of the layer's uint8 buffer, global layer id
    segment_ptr,  # int32 [n_segments, 2]: word offset in row, words per slot
    out_ptr,  # uint64 flat: every room's (layer, segment) matrix and page vector, zeroed
    cells_ptr,  # uint64 [n_items, n_segments]: raw segment digests (only if WRITE_CELLS)
    n_items,  # work items in the list
    row_words,  # 32-bit words per row (the row stride)
    slots,  # slots per row: bounds each segment's loop
    NUM_SEGMENTS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program: amortises the table look-ups' latency
    BLOCK: tl.constexpr,  # words per row per step
    WRITE_CELLS: tl.constexpr,
):
    items = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    valid = items < n_items
    # Lanes past the end re-read the last item, so every load is in bounds and
    # needs no mask; only their stores and atomics are masked off.
    item = tl.minimum(items, n_items - 1)
    room = tl.load(work_ptr + item * 4 + 0).to(tl.int64)
    layer = tl.load(work_ptr + item * 4 + 1).to(tl.int64)
    logical_page = tl.load(work_ptr + item * 4 + 2).to(tl.int64)
    frozen = tl.load(work_ptr + item * 4 + 3)

    page_table = tl.load(room_ptr + room * 3 + 0).to(tl.pointer_type(tl.int64))
    ls_offset = tl.load(room_ptr + room * 3 + 1)
    page_offset = tl.load(room_ptr + room * 3 + 2)
    base = tl.load(layer_ptr + layer * 2 + 0).to(tl.pointer_type(tl.uint32))
    layer_id = tl.load(layer_ptr + layer * 2 + 1).to(tl.uint64)
    physical_page = tl.load(page_table + logical_page)
    rows = base + physical_page * row_words  # [ROWS] pointers

    lanes = tl.arange(0, BLOCK)
    page_sum = tl.zeros([ROWS], dtype=tl.uint64)
    for s in tl.static_range(NUM_SEGMENTS):
        word_offset = tl.load(segment_ptr + s * 2 + 0)
        slot_words = tl.load(segment_ptr + s * 2 + 1)
        n_words = frozen * slot_words  # [ROWS]
        acc_a = tl.zeros([ROWS, BLOCK], dtype=tl.uint32)
        acc_b = tl.zeros([ROWS, BLOCK], dtype=tl.uint32)
        for start in range(0, slots * slot_words, BLOCK):
            idx = start + lanes
            # Whole rows are read (unfrozen words of a tail row too: they are in
            # bounds); only frozen words are summed.
            mask = idx[None, :] < n_words[:, None]
            j = word_offset + idx  # word position in the row
            w = tl.load(rows[:, None] + j[None, :])
            x = w ^ (j.to(tl.uint32) * _SALT_MUL + _SALT_ADD)[None, :]
            a = x * _MIX_A
            a = a ^ (a >> 16)
            b = (x ^ (x >> 15)) * _MIX_B
            acc_a += tl.where(mask, a, 0)
            acc_b += tl.where(mask, b, 0)
        sum_a = tl.sum(acc_a, axis=1).to(tl.uint64) & 0xFFFFFFFF
        sum_b = tl.sum(acc_b, axis=1).to(tl.uint64) & 0xFFFFFFFF
        digest = (sum_b << 32) | sum_a
        if WRITE_CELLS:
            tl.store(cells_ptr + items * NUM_SEGMENTS + s, digest, mask=valid)
        segment_no = tl.full([ROWS], s + 1, dtype=tl.uint64)
        salt = layer_id * _CELL_LAYER + logical_page.to(tl.uint64) * _CELL_PAGE + segment_no * _CELL_SEGMENT
        cell = _fmix64(digest ^ salt)
        tl.atomic_add(out_ptr + ls_offset + layer * NUM_SEGMENTS + s, cell, mask=valid, sem="relaxed")
        page_sum += cell
    tl.atomic_add(out_ptr + page_offset + logical_page, page_sum, mask=valid, sem="relaxed")


# %% launcher


def launch_digest(
    work: torch.Tensor,
    rooms: torch.Tensor,
    layers: torch.Tensor,
    segments: torch.Tensor,
    out: torch.Tensor,
    row_words: int,
    *,
    cells: torch.Tensor | None = None,
    slots: int,
    block: int = 256,
    rows: int = 4,
    num_warps: int = 4,
) -> None:
    """Check the tables, then launch on the current stream; never synchronises.

    `out` must be zeroed (the kernel accumulates into it) and sized for every
    room's blocks. Results are valid once the stream reaches this point.
    """
    assert work.dtype == torch.int32 and work.dim() == 2 and work.shape[1] == WORK_COLUMNS, "work: int32 [n, 4]"
    assert rooms.dtype == torch.int64 and rooms.shape[1:] == (ROOM_COLUMNS,), "rooms: int64 [n, 3]"
    assert layers.dtype == torch.int64 and layers.shape[1:] == (LAYER_COLUMNS,), "layers: int64 [n, 2]"
    assert segments.dtype == torch.int32 and segments.shape[1:] == (SEGMENT_COLUMNS,), "segments: int32 [n, 2]"
    assert out.dtype == torch.uint64, "out: uint64"
    assert block & (block - 1) == 0 and rows & (rows - 1) == 0, "block and rows must be powers of two"
    n_items = work.shape[0]
    if n_items == 0:
        return
    write_cells = cells is not None
    if write_cells:
        assert cells.dtype == torch.uint64 and cells.shape == (n_items, segments.shape[0]), "cells: uint64 [n, segments]"
    _digest_rows_kernel[(triton.cdiv(n_items, rows),)](
        work,
        rooms,
        layers,
        segments,
        out,
        cells if write_cells else out,
        n_items,
        row_words,
        slots,
        NUM_SEGMENTS=segments.shape[0],
        ROWS=rows,
        BLOCK=block,
        WRITE_CELLS=write_cells,
        num_warps=num_warps,
    )
