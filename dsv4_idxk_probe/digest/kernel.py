"""Triton kernel: digest many rooms' index-K rows in one launch.

The grid is (room, layer, block of ROWS logical pages). A program reads its
room's entry in the room table (where the page table is, how many pages and
tokens the room has, where its cells go), finds each row through its
layer's buffer and the room's page table, hashes the frozen words of
each segment into two 32-bit lane sums, and either stores each (layer,
page, segment) cell contribution (the host then folds them) or, with FOLD,
adds it into its room's fold on the device: the (layer, segment) matrix and
the page vector (sums mod 2^64, as `reference.py` defines them) and a count
of rows not read, so only the folds cross PCIe (a 43 x 1024-page fp8 room:
9 KB instead of 750 KB; the engine's device outputs). Beside them, when asked
(CONTENTS: decode's diagnosis reads them), it stores the cell's segment
digest (its content digest, docs/digest.md "Content digests"). Programs past
a room's last page return at once.
Cells, contents and flags are each stored exactly once, so they need no
zeroing; the folds are relaxed atomic adds into memory the engine keeps at
zero between batches (the collector zeroes what a batch wrote before its
buffer is reused, `collector.py`). A fold's atomics are one per program and
segment into the room's (layer, segment) entry and one per row into its page
entry, spread over the kernel's run; the count of rows not read is added
only by a program that has one (added by every program, one address would
take tens of thousands of serialised atomics).

Why it reads at the memory's rate (bench/RESULTS.md):
the layout is compiled in (segment offsets and sizes are constants), so each
segment of a row is one tile loaded in one go, every segment's loads are
issued before any word is hashed, and a row holds no masked tail; loads are
16 bytes wide where the buffers are 16-byte aligned from the layer table (a
pointer argument; see `layer_table`). Rows whose slots are all frozen (all
but a room's last page) take a branch with no masks at all. One warp per
program for rows up to 8448 B needs no cross-warp reduction. Where the GPU
has them, launches are programmatic dependent launches (`DigestKernel`).

Page ids are checked on the device against the page count of each layer's
buffer: a row whose id is out of range is never read; its cells are stored
as 0 and its flag (one byte per (layer, page) row, beside the cells) is set,
so the engine counts it and never lets such a room match (docs/digest.md).

The room table and the outputs are passed as plain addresses and the layer
table is the pool's own, so a launch hands Triton five integers and nothing to
inspect. The engine
passes device memory by default (its staging buffer's device twin: stores
straight into pinned host memory, `digest.outputs: pinned`, cross PCIe as
small writes, which take several times the kernel's own time on fp8 and fp4
rooms, bench/RESULTS.md); the same code runs under
``TRITON_INTERPRET=1`` on CPU tensors, which is how CI checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # grid dependency control: Triton 3.3 and later
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # an older Triton: plain launches only (`dependent_launches_on`)
    gdc_wait = None

from . import reference as ref
from .launch import FOLD_SLICES
from .room_table import ROOM_COLUMNS

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

_ROOM_COLUMNS = tl.constexpr(ROOM_COLUMNS)
_FOLD_SLICES = tl.constexpr(FOLD_SLICES)
LAYER_COLUMNS = 3  # int64: buffer address minus the table's own, global layer id, pages in the buffer
_LAYER_COLUMNS = tl.constexpr(LAYER_COLUMNS)
MAX_SEGMENTS = 4  # segments a layout may have for this kernel (index-K layouts have 1 or 2)


@triton.jit
def _fmix64(k):
    k = k ^ (k >> 33)
    k = k * _FMIX_1
    k = k ^ (k >> 33)
    k = k * _FMIX_2
    return k ^ (k >> 33)


@triton.jit
def _salt(OFFSET: tl.constexpr, TILE: tl.constexpr):
    """Each word's position salt, uint32 [TILE]: j * SALT_MUL + SALT_ADD, j its word in the row."""
    return (OFFSET + tl.arange(0, TILE)).to(tl.uint32) * _SALT_MUL + _SALT_ADD


@triton.jit
def _load_segment(rows, n_frozen, readable, OFFSET: tl.constexpr, SLOT_WORDS: tl.constexpr, TILE: tl.constexpr,
                  SLOTS: tl.constexpr, MASKED: tl.constexpr):
    """The segment's words of each row, uint32 [ROWS, TILE].
    MASKED: only the frozen words of readable rows are read (a tail page, an
    out-of-range id); otherwise every row is whole and every word is read.
    A word not read is replaced by its own position salt, so it hashes to
    x = 0, whose lane terms are both 0: it adds nothing to either sum, and no
    mask is needed after the load."""
    WORDS: tl.constexpr = SLOTS * SLOT_WORDS  # TILE: the power of two at or above it
    idx = tl.arange(0, TILE)
    pointers = rows[:, None] + (OFFSET + idx)[None, :]
    if MASKED:
        mask = (idx[None, :] < (n_frozen * SLOT_WORDS)[:, None]) & readable[:, None]
        return tl.load(pointers, mask=mask, other=_salt(OFFSET, TILE)[None, :], eviction_policy="evict_first")
    elif TILE != WORDS:
        return tl.load(pointers, mask=(idx < WORDS)[None, :], other=_salt(OFFSET, TILE)[None, :],
                       eviction_policy="evict_first")
    else:
        return tl.load(pointers, eviction_policy="evict_first")


@triton.jit
def _segment_digest(w, OFFSET: tl.constexpr, TILE: tl.constexpr):
    """d = (sum_b << 32) | sum_a over the words `_load_segment` read (docs/digest.md,
    "Words"); the words it did not read are their salt, so x = 0 adds nothing.
    Lane b is summed before its multiplication: sum(v * MIX_B) = sum(v) * MIX_B
    mod 2^32, so each row multiplies once, not once per word (less integer work;
    no change measured on the H200, bench/RESULTS.md)."""
    x = w ^ _salt(OFFSET, TILE)[None, :]
    a = x ^ (x >> 16)  # lane A: fmix32(x), MurmurHash3's 32-bit finaliser
    a = a * _MIX_A
    a = a ^ (a >> 13)
    a = a * _MIX_B
    a = a ^ (a >> 16)
    sum_a = tl.sum(a, axis=1)  # uint32: mod 2^32, as the definition sums
    sum_b = tl.sum(x ^ (x >> 15), axis=1) * _MIX_B
    return (sum_b.to(tl.uint64) << 32) | sum_a.to(tl.uint64)


@triton.jit
def _row_digests(rows, n_frozen, readable, SLOTS: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                 S0_OFFSET: tl.constexpr, S0_SLOT_WORDS: tl.constexpr, S0_TILE: tl.constexpr,
                 S1_OFFSET: tl.constexpr, S1_SLOT_WORDS: tl.constexpr, S1_TILE: tl.constexpr,
                 S2_OFFSET: tl.constexpr, S2_SLOT_WORDS: tl.constexpr, S2_TILE: tl.constexpr,
                 S3_OFFSET: tl.constexpr, S3_SLOT_WORDS: tl.constexpr, S3_TILE: tl.constexpr,
                 MASKED: tl.constexpr):
    """Each segment's digest of each row, uint64 [ROWS] x 4 (unused segments: 0).
    Every segment's loads come before any hashing, so a row costs one round trip."""
    w0 = _load_segment(rows, n_frozen, readable, S0_OFFSET, S0_SLOT_WORDS, S0_TILE, SLOTS, MASKED)
    if NUM_SEGMENTS > 1:
        w1 = _load_segment(rows, n_frozen, readable, S1_OFFSET, S1_SLOT_WORDS, S1_TILE, SLOTS, MASKED)
    if NUM_SEGMENTS > 2:
        w2 = _load_segment(rows, n_frozen, readable, S2_OFFSET, S2_SLOT_WORDS, S2_TILE, SLOTS, MASKED)
    if NUM_SEGMENTS > 3:
        w3 = _load_segment(rows, n_frozen, readable, S3_OFFSET, S3_SLOT_WORDS, S3_TILE, SLOTS, MASKED)
    d0 = _segment_digest(w0, S0_OFFSET, S0_TILE)
    d1 = tl.zeros_like(d0)
    d2 = tl.zeros_like(d0)
    d3 = tl.zeros_like(d0)
    if NUM_SEGMENTS > 1:
        d1 = _segment_digest(w1, S1_OFFSET, S1_TILE)
    if NUM_SEGMENTS > 2:
        d2 = _segment_digest(w2, S2_OFFSET, S2_TILE)
    if NUM_SEGMENTS > 3:
        d3 = _segment_digest(w3, S3_OFFSET, S3_TILE)
    return d0, d1, d2, d3


@triton.jit
def _store_cell(out, content_out, fold_entry, d, readable, valid, layer_id, page, SEGMENT: tl.constexpr,
                CONTENTS: tl.constexpr, FOLD: tl.constexpr):
    """c = fmix64(d ^ salt(layer id, logical page, segment)): with FOLD added into the room's
    (layer, segment) entry `fold_entry` (one atomic), else stored into the cells; with
    CONTENTS d itself (the content digest) into the contents; both 0 for a row not read.
    Returns c ([ROWS], 0 on lanes past the room's last page) for the page vector."""
    salt = layer_id * _CELL_LAYER + page.to(tl.uint64) * _CELL_PAGE + SEGMENT * _CELL_SEGMENT
    cell = tl.where(readable & valid, _fmix64(d ^ salt), 0)
    if FOLD:
        tl.atomic_add(fold_entry + (SEGMENT - 1), tl.sum(cell, axis=0), sem="relaxed")
    else:
        tl.store(out + (SEGMENT - 1), cell, mask=valid)
    if CONTENTS:
        tl.store(content_out + (SEGMENT - 1), tl.where(readable, d, 0), mask=valid)
    return cell


@triton.jit(do_not_specialize=["room_table", "cells", "contents", "flags", "one_pages", "one_id_bytes", "one_n_pages",
                               "one_n_tokens"])  # per layout and CONTENTS, two compiled kernels: ONE_ROOM or not
def _digest_rooms_kernel(
    room_table,  # address of int64 [n_rooms, 5]: page-table address, page-id bytes (4 or 8), pages, tokens, first cell
    layer_table,  # int64 [n_layers, 3]: the layer's buffer address minus the table's, global layer id, pages in it
    cells,  # address of uint64 [n_cells, n_segments]: cell contributions, room, then layer, then page; with
    # FOLD instead each room's fold, at (its first cell) / layers + room x (slices x layers x segments + 1):
    # uint64 [pages] page vector, [slices, layers, segments] matrices, [1] rows not read (all zero before);
    # slices: FOLD_SLICES for a launch of one room, else 1 (`launch.fold_words`)
    contents,  # address of uint64 [n_cells, n_segments]: each cell's segment digest d (its content digest), same order
    flags,  # address of uint8 [n_cells]: 1 where the row's page id is out of range (not read), else 0
    one_pages,  # ONE_ROOM: the room's page-table address, page-id bytes, pages and tokens, passed
    one_id_bytes,  # by value (its first cell is 0); else unused (0)
    one_n_pages,
    one_n_tokens,
    ROW_WORDS: tl.constexpr,  # 32-bit words per row (the row stride)
    SLOTS: tl.constexpr,
    TOKENS_PER_SLOT: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    S0_OFFSET: tl.constexpr,  # per segment: word offset in the row, words per slot,
    S0_SLOT_WORDS: tl.constexpr,  # and the power of two at or above its words (its tile)
    S0_TILE: tl.constexpr,
    S1_OFFSET: tl.constexpr,
    S1_SLOT_WORDS: tl.constexpr,
    S1_TILE: tl.constexpr,
    S2_OFFSET: tl.constexpr,
    S2_SLOT_WORDS: tl.constexpr,
    S2_TILE: tl.constexpr,
    S3_OFFSET: tl.constexpr,
    S3_SLOT_WORDS: tl.constexpr,
    S3_TILE: tl.constexpr,
    BASE_ALIGN: tl.constexpr,  # bytes every buffer's distance from the layer table is a multiple of
    ROWS: tl.constexpr,  # pages per program: amortises the table look-ups' latency
    ID_STRIDE: tl.constexpr,  # page-table entries per page: page k's id is entry k x ID_STRIDE over ID_STRIDE
    ONE_ROOM: tl.constexpr,  # the launch's one room comes by value: the room table is not read
    CONTENTS: tl.constexpr,  # store each cell's content digest (diagnosis reads them); else `contents` is unused
    FOLD: tl.constexpr,  # add cells into their room's fold (see `cells`) instead of storing them
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see `DigestKernel`)
):
    if PDL:
        gdc_wait()  # nothing is read before the previous kernel has finished and its writes are visible
    PAGE_TOKENS: tl.constexpr = SLOTS * TOKENS_PER_SLOT
    room = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    first_page = tl.program_id(2).to(tl.int64) * ROWS
    # Every table field is loaded before the test that ends programs past the room's
    # last page, so the loads go out together: a program waits for one round trip
    # to the tables, then one to the page table, before its rows. A launch of one
    # room passes its fields by value, which spares every program the first of
    # those round trips (and the engine the table's copy up).
    if ONE_ROOM:
        page_table, id_bytes, n_pages, n_tokens = one_pages, one_id_bytes, one_n_pages, one_n_tokens
        first_cell = 0
    else:
        entry = room_table.to(tl.pointer_type(tl.int64)) + room * _ROOM_COLUMNS
        page_table = tl.load(entry)
        id_bytes = tl.load(entry + 1)
        n_pages = tl.load(entry + 2)
        n_tokens = tl.load(entry + 3)
        first_cell = tl.load(entry + 4)
    layer_entry = layer_table + layer * _LAYER_COLUMNS
    # A buffer is found from the table's own address (a pointer argument, so the
    # compiler knows it is 16-byte aligned) plus the buffer's distance from it,
    # which the host checked is a multiple of BASE_ALIGN: written as such, the row
    # loads can be 16 bytes wide. (An address loaded from memory, or a hint on the
    # load, leaves the compiler assuming 4-byte alignment.)
    distance = tl.load(layer_entry)
    layer_id = tl.load(layer_entry + 1).to(tl.uint64)
    layer_pages = tl.load(layer_entry + 2)
    if first_page >= n_pages:
        return
    base = layer_table.to(tl.pointer_type(tl.uint32)) + (distance // BASE_ALIGN) * (BASE_ALIGN // 4)

    # Lanes past the room's last page re-read its last page, so the table loads
    # are in bounds and need no mask; only their stores are masked off.
    logical = first_page + tl.arange(0, ROWS)
    valid = logical < n_pages
    page = tl.minimum(logical, n_pages - 1)
    if id_bytes == 8:
        entry_id = tl.load(page_table.to(tl.pointer_type(tl.int64)) + page * ID_STRIDE)
    else:
        entry_id = tl.load(page_table.to(tl.pointer_type(tl.int32)) + page * ID_STRIDE).to(tl.int64)
    if ID_STRIDE > 1:  # a copy's token indices: the page is the first slot's index over the page size
        physical = tl.where(entry_id >= 0, entry_id // ID_STRIDE, -1)  # negative: never read (floored, as the pool)
    else:
        physical = entry_id
    readable = (physical >= 0) & (physical < layer_pages)  # else never read: not this layer's row
    rows = base + tl.where(readable, physical, 0) * ROW_WORDS  # [ROWS] pointers
    n_frozen = tl.minimum(tl.maximum((n_tokens - page * PAGE_TOKENS) // TOKENS_PER_SLOT, 0), SLOTS)

    # Whole rows (every lane a page of the room, every slot frozen, every id in range)
    # take the branch without masks: all a room's pages but its last.
    whole = (first_page + ROWS <= n_pages) & (n_tokens >= (first_page + ROWS) * PAGE_TOKENS)
    whole = whole & (tl.sum(readable.to(tl.int32), axis=0) == ROWS)
    if whole:
        d0, d1, d2, d3 = _row_digests(rows, n_frozen, readable, SLOTS, NUM_SEGMENTS,
                                      S0_OFFSET, S0_SLOT_WORDS, S0_TILE, S1_OFFSET, S1_SLOT_WORDS, S1_TILE,
                                      S2_OFFSET, S2_SLOT_WORDS, S2_TILE, S3_OFFSET, S3_SLOT_WORDS, S3_TILE,
                                      False)
    else:
        d0, d1, d2, d3 = _row_digests(rows, n_frozen, readable, SLOTS, NUM_SEGMENTS,
                                      S0_OFFSET, S0_SLOT_WORDS, S0_TILE, S1_OFFSET, S1_SLOT_WORDS, S1_TILE,
                                      S2_OFFSET, S2_SLOT_WORDS, S2_TILE, S3_OFFSET, S3_SLOT_WORDS, S3_TILE,
                                      True)

    row_cell = first_cell + layer * n_pages + page
    out = cells.to(tl.pointer_type(tl.uint64)) + row_cell * NUM_SEGMENTS
    content_out = contents.to(tl.pointer_type(tl.uint64)) + row_cell * NUM_SEGMENTS
    fold = out  # with FOLD: the room's fold (see `cells`); the page vector comes first
    fold_entry = out
    if FOLD:
        n_layers = tl.num_programs(1).to(tl.int64)
        slices: tl.constexpr = _FOLD_SLICES if ONE_ROOM else 1  # see `launch.FOLD_SLICES`
        fold = cells.to(tl.pointer_type(tl.uint64)) + first_cell // n_layers + room * (slices * n_layers * NUM_SEGMENTS + 1)
        fold_entry = fold + n_pages + ((first_page // ROWS) % slices * n_layers + layer) * NUM_SEGMENTS
    page_sum = _store_cell(out, content_out, fold_entry, d0, readable, valid, layer_id, page, 1, CONTENTS, FOLD)
    if NUM_SEGMENTS > 1:
        page_sum += _store_cell(out, content_out, fold_entry, d1, readable, valid, layer_id, page, 2, CONTENTS, FOLD)
    if NUM_SEGMENTS > 2:
        page_sum += _store_cell(out, content_out, fold_entry, d2, readable, valid, layer_id, page, 3, CONTENTS, FOLD)
    if NUM_SEGMENTS > 3:
        page_sum += _store_cell(out, content_out, fold_entry, d3, readable, valid, layer_id, page, 4, CONTENTS, FOLD)
    if FOLD:
        tl.atomic_add(fold + page, page_sum, mask=valid, sem="relaxed")
        unread = tl.sum((valid & (readable == 0)).to(tl.int64), axis=0)
        if unread > 0:  # rare (a wrong page table): one address, so never added by every program
            tl.atomic_add(fold + n_pages + slices * n_layers * NUM_SEGMENTS, unread.to(tl.uint64), sem="relaxed")
    tl.store(flags.to(tl.pointer_type(tl.uint8)) + row_cell, tl.where(readable, 0, 1).to(tl.uint8), mask=valid)


# %% launcher


_ARG_NAMES = (
    "room_table", "layer_table", "cells", "contents", "flags", "one_pages", "one_id_bytes", "one_n_pages", "one_n_tokens",
    "ROW_WORDS", "SLOTS", "TOKENS_PER_SLOT", "NUM_SEGMENTS",
    "S0_OFFSET", "S0_SLOT_WORDS", "S0_TILE", "S1_OFFSET", "S1_SLOT_WORDS", "S1_TILE",
    "S2_OFFSET", "S2_SLOT_WORDS", "S2_TILE", "S3_OFFSET", "S3_SLOT_WORDS", "S3_TILE", "BASE_ALIGN", "ROWS",
    "ID_STRIDE", "ONE_ROOM", "CONTENTS", "FOLD", "PDL",
)
_NOT_ONE_ROOM = (0, 0, 0, 0)  # the by-value room fields of a launch of several rooms


def layout_constants(layout, base_align: int) -> dict:
    """The kernel's compile-time constants for `layout` (one compiled kernel per layout)."""
    if len(layout.segments) > MAX_SEGMENTS:
        raise ValueError(f"layout {layout.name!r} has {len(layout.segments)} segments; the digest kernel takes "
                         f"at most {MAX_SEGMENTS}")
    meta = {"ROW_WORDS": layout.row_bytes // 4, "SLOTS": layout.slots, "TOKENS_PER_SLOT": layout.tokens_per_slot,
            "NUM_SEGMENTS": len(layout.segments)}
    for s in range(MAX_SEGMENTS):
        segment = layout.segments[s] if s < len(layout.segments) else None
        meta[f"S{s}_OFFSET"] = segment.word_offset if segment else 0
        meta[f"S{s}_SLOT_WORDS"] = segment.slot_words if segment else 1
        meta[f"S{s}_TILE"] = triton.next_power_of_2(layout.slots * segment.slot_words) if segment else 1
    meta["BASE_ALIGN"] = base_align
    return meta


def _alignment(values) -> int:
    """The largest of 16, 8, 4 that every value is a multiple of (ValueError if not even 4:
    the kernel reads whole words and would read before such a buffer)."""
    for align in (16, 8, 4):
        if all(int(v) % align == 0 for v in values):
            return align
    raise ValueError("a buffer does not start a whole number of 4-byte words from the layer table")


def layer_table(buffers, layer_ids, device) -> tuple[torch.Tensor, int]:
    """The kernel's layer table for `buffers` (layer `layer_ids[i]` in `buffers[i]`), on
    `device`, and the alignment in bytes of every buffer's distance from it: the
    kernel's row loads are as wide as that (and the layout's offsets) allow."""
    table = torch.zeros((max(1, len(buffers)), LAYER_COLUMNS), dtype=torch.int64, device=device)
    anchor = table.data_ptr()
    distances = [(b.data_ptr() - anchor + (1 << 63)) % (1 << 64) - (1 << 63) for b in buffers]  # as int64
    if buffers:
        rows = [[d, int(lid), int(b.shape[0])] for d, lid, b in zip(distances, layer_ids, buffers)]
        table.copy_(torch.tensor(rows, dtype=torch.int64))
    return table, _alignment(distances + [anchor])


class DigestKernel:
    """The kernel bound to one pool: its layer table and its layout.

    `launch` is what a submit calls on the serving thread, so it does nothing
    but compute the grid and launch on the current stream; it never
    synchronises. Cells and flags are valid once the stream reaches the launch.

    The first launch goes through Triton's JIT entry point, which binds and
    specialises the arguments on every call (tens of microseconds). The four
    addresses are integers the kernel does not specialise on, and the rest
    are this pool's constants, so the compiled kernel it returns fits every
    later launch: once its signature is checked to be exactly the arguments
    passed, later launches call it directly and skip the binding. A caller
    that names the device and stream (the engine does) gets the compiled
    kernel's own C launcher (`run`) with them, as Triton's
    `CompiledKernel[grid]` calls it, but without a closure and two more
    device and stream look-ups per launch; while a Triton launch hook is set
    (a profiler), launches keep going through `CompiledKernel[grid]`, which
    calls the hooks.

    `pdl`: each launch is a programmatic dependent launch. The GPU then starts
    its programs as soon as the previous kernel's last programs have exited,
    instead of after that kernel's completion has gone through the stream, and
    each program waits (`griddepcontrol.wait`) for the previous kernel to have
    finished and its writes to be visible before it reads anything, so it reads
    what a plain launch reads. The early start applies only when the work
    before it in the stream is a kernel. The kernel never lets the next kernel
    start early: measured, that made back-to-back fp4 launches slower
    (bench/RESULTS.md).
    """

    def __init__(self, layer_table: torch.Tensor, n_layers: int, layout, *, rows: int = 1, num_warps: int = 4,
                 base_align: int = 16, contents: bool = True, fold: bool = False, pdl: bool = False,
                 id_stride: int = 1):
        if rows < 1 or rows & (rows - 1):
            raise ValueError(f"rows ({rows}) must be a power of two")
        if id_stride < 1:
            raise ValueError(f"id_stride ({id_stride}) must be at least 1")
        self.layer_table, self.n_layers = layer_table, n_layers  # the table from `layer_table()`
        self.layer_table_address = layer_table.data_ptr()
        self.meta = {**layout_constants(layout, base_align), "ROWS": rows, "ID_STRIDE": int(id_stride)}
        self.contents = contents  # whether launches store the content digests
        self.fold = bool(fold)  # whether launches fold cells on the device (`cells` is then the folds)
        self.pdl = bool(pdl)  # programmatic dependent launches (compute capability 9 and later)
        self.num_warps = num_warps
        self.rows = rows
        self.compiled = {}  # ONE_ROOM -> the compiled kernel, launched directly once it is known to fit
        self.compiled_on = {}  # ONE_ROOM -> the device it was loaded on: another device takes the JIT path

    def launch_args(self, room_table: int, cells: int, contents: int, flags: int, one_room: tuple | None = None) -> tuple:
        """Every argument of one launch, in the kernel's order (constants last)."""
        return (room_table, self.layer_table_address, cells, contents, flags, *(one_room or _NOT_ONE_ROOM),
                *self.meta.values(), one_room is not None, self.contents, self.fold, self.pdl)

    def launch(self, room_table: int, cells: int, contents: int, flags: int, n_rooms: int, max_pages: int, *,
               one_room: tuple | None = None, device: int | None = None, stream: int | None = None) -> None:
        """Digest `n_rooms` rooms of at most `max_pages` pages each (addresses as integers:
        the room table, then the cells, contents and flags it stores), on `stream`
        (a raw CUDA stream handle of `device`; None: the current stream). `one_room`:
        for a launch of one room, its (page-table address, page-id bytes, pages,
        tokens), which the kernel then takes by value instead of reading the table."""
        if n_rooms == 0 or max_pages == 0 or self.n_layers == 0:
            return
        one_room = one_room if n_rooms == 1 else None
        grid = (n_rooms, self.n_layers, -(-max_pages // self.rows))
        if device is None or stream is None:
            device, stream = _current_device(), None
        variant = one_room is not None
        compiled = self.compiled.get(variant)
        args = self.launch_args(room_table, cells, contents, flags, one_room)
        if compiled is not None and device == self.compiled_on[variant]:
            if stream is not None and not _launch_hooks_set():
                compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
            else:
                compiled[grid](*args)
            return
        compiled = _digest_rooms_kernel[grid](room_table, self.layer_table, cells, contents, flags,
                                              *(one_room or _NOT_ONE_ROOM), **self.meta, ONE_ROOM=variant,
                                              CONTENTS=self.contents, FOLD=self.fold, PDL=self.pdl,
                                              num_warps=self.num_warps,
                                              **({"launch_pdl": True} if self.pdl else {}))
        if _fits(compiled):
            self.compiled[variant], self.compiled_on[variant] = compiled, device


def dependent_launches_on(device: torch.device) -> bool:
    """Whether kernels launched on `device` can be programmatic dependent launches:
    a GPU of compute capability 9 or later, and a Triton that has grid dependency control."""
    return gdc_wait is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _current_device():
    """The device Triton launches on now (None under the interpreter)."""
    try:
        return triton.runtime.driver.active.get_current_device()
    except Exception:
        return None


def current_stream() -> tuple[int, int]:
    """(device, raw stream handle) a launch goes to now: what Triton itself looks up."""
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    return device, driver.get_current_stream(device)


# Where this Triton keeps its launch hooks: `triton.knobs.runtime` (3.4 and later)
# or the CompiledKernel class (earlier). Looked up once; read at every launch.
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
_HOOKS = _RUNTIME_KNOBS if _RUNTIME_KNOBS is not None else triton.compiler.CompiledKernel


def _launch_hooks_set() -> bool:
    """Whether a Triton launch hook is set: a plain attribute (None when unset) or a
    chain of hooks (empty when unset). Asked at every launch, so no helper calls."""
    enter, leave = getattr(_HOOKS, "launch_enter_hook", None), getattr(_HOOKS, "launch_exit_hook", None)
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


def _fits(compiled) -> bool:
    """Whether `compiled` takes exactly this module's arguments, in this order, and has
    its C launcher loaded: then it can be called with them directly. Anything
    unexpected (another Triton, the interpreter) keeps the JIT entry point."""
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    return (isinstance(signature, dict) and tuple(signature) == _ARG_NAMES
            and callable(getattr(compiled, "__getitem__", None)) and callable(getattr(compiled, "run", None))
            and getattr(compiled, "function", None) is not None and hasattr(compiled, "packed_metadata"))
