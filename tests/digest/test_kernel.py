"""The Triton kernel agrees with the reference bit for bit.

Without a GPU these run under TRITON_INTERPRET=1 (tests/conftest.py); on a
GPU the same tests run the compiled kernel.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, compare, get_layout
from dsv4_idxk_probe.digest import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engines(layout, layer_ids, buffers, rows=4):
    buffers = [b.to(DEVICE) for b in buffers]
    return (
        DigestEngine(layout, layer_ids, buffers, backend="triton", rows=rows),
        DigestEngine(layout, layer_ids, [b.cpu() for b in buffers], backend="reference"),
    )


def _kernel_cells(layout, buffers, layer_ids, rooms, by_value=False, **shape):
    """Launch the kernel directly on `rooms`: (cells uint64 [n_cells, segments], contents
    (the same shape), flags uint8 [n_cells], plan). Every output starts as a sentinel,
    so an unwritten entry shows. `by_value`: one room, passed by value (the table
    then holds a sentinel the kernel must not read)."""
    from dsv4_idxk_probe.digest.kernel import DigestKernel, layer_table
    from dsv4_idxk_probe.digest.room_table import plan_cells

    plan = plan_cells(rooms, len(buffers))
    room_table = torch.tensor(
        [[r.pages.data_ptr(), r.pages.element_size(), r.n_pages, r.n_tokens, first]
         for r, first in zip(rooms, plan.first_cells)], dtype=torch.int64, device=DEVICE)
    table, base_align = layer_table(buffers, layer_ids, DEVICE)
    cells = torch.full((plan.n_cells, len(layout.segments)), 0x5A5A5A5A, dtype=torch.int64, device=DEVICE)
    contents = torch.full_like(cells, 0x3C3C3C3C)
    flags = torch.full((plan.n_cells,), 0x5A, dtype=torch.uint8, device=DEVICE)
    kernel = DigestKernel(table, len(buffers), layout, base_align=base_align, **shape)
    one_room = None
    if by_value:
        (room,) = rooms
        one_room = (room.pages.data_ptr(), room.pages.element_size(), room.n_pages, room.n_tokens)
        room_table.fill_(-1)  # a page table at address -1 of -1 pages: reading it would fault or show
    kernel.launch(room_table.data_ptr(), cells.data_ptr(), contents.data_ptr(), flags.data_ptr(), len(rooms),
                  plan.max_pages, one_room=one_room)
    return cells.cpu().numpy().view(np.uint64), contents.cpu().numpy().view(np.uint64), flags.cpu().numpy(), plan


def _reference_cells(layout, buffers, layer_ids, rooms, plan):
    """What the kernel must store: cells, contents and flags by the engine's checked reference."""
    from dsv4_idxk_probe.digest.launch import checked_room_cells, flag_block

    cells = np.zeros((plan.n_cells, len(layout.segments)), dtype=np.uint64)
    contents = np.zeros_like(cells)
    flags = np.zeros(plan.n_cells, dtype=np.uint8)
    host = [b.cpu() for b in buffers]
    for slot, room in enumerate(rooms):
        checked_room_cells(host, room.pages.cpu().numpy(), room.n_tokens, layout, layer_ids,
                           plan.block(cells, slot), flag_block(plan, flags, slot), plan.block(contents, slot))
    return cells, contents, flags


def _assert_same(kernel_digests, reference_digests):
    for k, r in zip(kernel_digests, reference_digests, strict=True):
        assert k.key == r.key
        assert np.array_equal(k.layer_segment, r.layer_segment), k.key
        assert np.array_equal(k.pages, r.pages), k.key
        assert k.room == r.room and k.signature == r.signature


def _ragged_rooms(n_pool_pages, seed):
    rng = np.random.default_rng(seed)
    specs = [(3, 3 * 256), (2, 256 + 37), (1, 1), (1, 255), (0, 0), (2, 2 * 256 - 4)]
    rooms = []
    for i, (n_pages, n_tokens) in enumerate(specs):
        pages = rng.choice(n_pool_pages, n_pages, replace=False).tolist()
        rooms.append(RoomRequest(f"r{i}", torch.tensor(pages, dtype=torch.int64, device=DEVICE), n_tokens))
    return rooms


def test_every_layout_matches_reference_on_ragged_rooms(layout, random_buffers):
    layer_ids = [1, 4, 9]
    buffers = random_buffers(layout, len(layer_ids), 8, seed=11)
    kernel, reference = _engines(layout, layer_ids, buffers)
    rooms = _ragged_rooms(8, seed=3)
    _assert_same(kernel.digest_now(rooms), reference.digest_now(rooms))


@pytest.mark.parametrize("rows, num_warps", [(1, 1), (2, 8), (4, 2), (8, 1)])
def test_tiling_does_not_change_the_cells(rows, num_warps, layout, random_buffers):
    """Every (rows per program, warps) the benchmark sweeps stores the reference's
    cells, for whole and tail pages."""
    buffers = [b.to(DEVICE) for b in random_buffers(layout, 2, 5, seed=rows)]
    rooms = [RoomRequest("a", torch.tensor([4, 0, 2], device=DEVICE), 2 * 256 + 9),
             RoomRequest("b", torch.tensor([1, 3, 2, 0, 4], device=DEVICE), 5 * 256),
             RoomRequest("c", torch.tensor([3], dtype=torch.int32, device=DEVICE), 7)]
    cells, contents, flags, plan = _kernel_cells(layout, buffers, [0, 7], rooms, rows=rows, num_warps=num_warps)
    want_cells, want_contents, want_flags = _reference_cells(layout, buffers, [0, 7], rooms, plan)
    assert np.array_equal(cells, want_cells) and np.array_equal(flags, want_flags) and not flags.any()
    assert np.array_equal(contents, want_contents)


@pytest.mark.parametrize("rows, num_warps", [(1, 1), (2, 4)])
def test_a_room_passed_by_value_stores_what_the_table_gives(rows, num_warps, layout, random_buffers):
    """A launch of one room takes its fields by value, not from the room table: the
    same cells, contents and out-of-range flags, whole and tail pages, int32 ids."""
    buffers = [b.to(DEVICE) for b in random_buffers(layout, 2, 5, seed=rows + 20)]
    rooms = [RoomRequest("whole", torch.tensor([4, 0, 2], device=DEVICE), 3 * 256),
             RoomRequest("tail", torch.tensor([1, 3], dtype=torch.int32, device=DEVICE), 256 + 9),
             RoomRequest("out of range", torch.tensor([2, 5, -1], device=DEVICE), 3 * 256)]
    for room in rooms:
        cells, contents, flags, plan = _kernel_cells(layout, buffers, [0, 7], [room], by_value=True, rows=rows,
                                                     num_warps=num_warps)
        want_cells, want_contents, want_flags = _reference_cells(layout, buffers, [0, 7], [room], plan)
        assert np.array_equal(cells, want_cells) and np.array_equal(contents, want_contents), room.key
        assert np.array_equal(flags, want_flags), room.key
    assert want_flags.sum() == 2 * 2  # the last room: two ids out of range in each of two layers


@pytest.mark.parametrize("by_value", [False, True])
def test_without_contents_the_cells_are_the_same_and_the_contents_untouched(by_value, layout, random_buffers):
    """CONTENTS off (diagnosis off): the same cells and flags; the contents buffer is
    never written (it keeps its sentinel)."""
    buffers = [b.to(DEVICE) for b in random_buffers(layout, 2, 5, seed=31)]
    rooms = [RoomRequest("a", torch.tensor([4, 0, 9], device=DEVICE), 2 * 256 + 9)]  # 9: out of range
    if not by_value:
        rooms.append(RoomRequest("b", torch.tensor([1, 3], dtype=torch.int32, device=DEVICE), 2 * 256))
    cells, contents, flags, plan = _kernel_cells(layout, buffers, [0, 7], rooms, by_value=by_value, rows=2,
                                                 contents=False)
    want_cells, _, want_flags = _reference_cells(layout, buffers, [0, 7], rooms, plan)
    assert np.array_equal(cells, want_cells) and np.array_equal(flags, want_flags) and want_flags.sum() == 2
    assert (contents == 0x3C3C3C3C).all()


def test_split_across_launches_gives_the_same_digests(random_buffers):
    layout = get_layout("fp4")
    buffers = random_buffers(layout, 2, 6, seed=8)
    kernel, _ = _engines(layout, [3, 5], buffers)
    rooms = _ragged_rooms(6, seed=9)
    together = kernel.digest_now(rooms)
    apart = [d for r in rooms for d in kernel.digest_now([r])]
    _assert_same(together, apart)


def test_int32_page_tables_and_host_page_lists_are_accepted(random_buffers):
    layout = get_layout("fp8")
    buffers = random_buffers(layout, 1, 4, seed=2)
    kernel, reference = _engines(layout, [0], buffers)
    rooms = [RoomRequest("i32", torch.tensor([3, 1], dtype=torch.int32, device=DEVICE), 300), RoomRequest("list", [2], 256)]
    _assert_same(kernel.digest_now(rooms), reference.digest_now(rooms))


@pytest.mark.parametrize("as_given", [list, tuple, lambda p: range(p[0], p[0] + len(p)),
                                      lambda p: np.array(p, dtype=np.int32), lambda p: np.array(p, dtype=np.uint64)])
def test_host_page_tables_of_any_integer_sequence_are_copied_in_place(random_buffers, as_given):
    """Page tables that live on the host are written into the staging buffer as given,
    next to a device one, in one batch: the kernel reads each from its own address."""
    layout = get_layout("fp8")
    buffers = random_buffers(layout, 2, 8, seed=4)
    kernel, reference = _engines(layout, [0, 3], buffers)
    rooms = [RoomRequest("host-a", as_given([2, 3, 4]), 3 * 256 - 5),
             RoomRequest("device", torch.tensor([7, 1], device=DEVICE), 300),
             RoomRequest("host-b", as_given([5, 6]), 2 * 256)]
    _assert_same(kernel.digest_now(rooms), reference.digest_now(rooms))


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    flip_layer=st.integers(0, 1),
    flip_page=st.integers(0, 1),
    flip_byte=st.integers(0, 8447),
    rows=st.sampled_from([1, 4]),
)
def test_kernel_localises_a_flipped_bit_like_the_reference(seed, flip_layer, flip_page, flip_byte, rows):
    layout = get_layout("fp8")
    g = torch.Generator().manual_seed(seed)
    buffers = [torch.randint(0, 256, (3, layout.row_bytes), dtype=torch.uint8, generator=g) for _ in range(2)]
    room = [RoomRequest("x", torch.tensor([2, 0], device=DEVICE), 2 * 256)]
    kernel, _ = _engines(layout, [10, 20], buffers, rows=rows)
    before = kernel.digest_now(room)[0]
    page = [2, 0][flip_page]
    kernel.buffers[flip_layer][page, flip_byte] ^= 0x80
    after = kernel.digest_now(room)[0]
    result = compare(before, after)
    segment = "payload" if flip_byte < 8192 else "scale"
    assert result.exact and result.layer_segments == [([10, 20][flip_layer], segment)] and result.pages == [flip_page]


@pytest.mark.parametrize("bit", [31, 30])
def test_kernel_finds_the_same_high_bit_flipped_in_two_words_of_a_row(bit):
    """Digest version 1 let such a pair cancel in both lane sums a quarter of the time (bit 31)
    (docs/digest.md, "Words"): the kernel, like the reference, finds every one of these."""
    layout = get_layout("fp8")
    g = torch.Generator().manual_seed(bit)
    pages = 16
    buffers = [torch.randint(0, 256, (pages, layout.row_bytes), dtype=torch.uint8, generator=g)]
    rooms = [RoomRequest(f"r{page}", torch.tensor([page], device=DEVICE), 256) for page in range(pages)]
    kernel, _ = _engines(layout, [10], buffers)
    before = kernel.digest_now(rooms)
    words = kernel.buffers[0].view(torch.int32)
    first = torch.randint(0, 2048, (pages,), generator=g)  # payload words (bytes 0-8191)
    pairs = zip(first.tolist(), ((first + torch.randint(1, 2048, (pages,), generator=g)) % 2048).tolist())
    for page, (first, second) in enumerate(pairs):
        words[page, first] ^= -(1 << 31) if bit == 31 else 1 << bit
        words[page, second] ^= -(1 << 31) if bit == 31 else 1 << bit
    after = kernel.digest_now(rooms)
    for b, a in zip(before, after, strict=True):
        result = compare(b, a)
        assert result.verdict == "mismatch" and result.layer_segments == [(10, "payload")], result


def test_kernel_stores_every_cell_of_every_room_once(random_buffers):
    """Called directly: each (layer, page, segment) cell the kernel stores equals
    reference.room_cells, for int32 and int64 page tables in one launch, and no cell
    or flag of the output is left unwritten (both start as a sentinel)."""
    layout = get_layout("fp8")
    buffers = [b.to(DEVICE) for b in random_buffers(layout, 2, 5, seed=4)]
    rooms = [
        RoomRequest("a", torch.tensor([1, 2], dtype=torch.int64, device=DEVICE), 256 + 20),
        RoomRequest("b", torch.tensor([4, 0, 3], dtype=torch.int32, device=DEVICE), 2 * 256 + 3),
    ]
    cells, contents, flags, plan = _kernel_cells(layout, buffers, [10, 20], rooms, rows=2)
    host = [b.cpu() for b in buffers]
    for slot, room in enumerate(rooms):
        expected = ref.room_cells(host, room.pages.cpu().numpy(), room.n_tokens, layout, [10, 20])
        assert np.array_equal(plan.block(cells, slot), expected), room.key
        expected = ref.room_contents(host, room.pages.cpu().numpy(), room.n_tokens, layout)
        assert np.array_equal(plan.block(contents, slot), expected), room.key
    assert np.array_equal(flags, np.zeros(plan.n_cells, dtype=np.uint8))


def test_out_of_range_page_ids_are_flagged_not_read_and_stored_as_zero(layout, random_buffers):
    """Ids below 0, at and past the buffer's end, huge, in int64 and int32 tables, and an
    id in range for one layer's buffer but not the other's: exactly those (layer, page)
    rows are flagged, their cells are 0, and every other cell is the reference's."""
    big, small = random_buffers(layout, 1, 6, seed=1)[0], random_buffers(layout, 1, 4, seed=2)[0]
    buffers = [big.to(DEVICE), small.to(DEVICE)]
    rooms = [
        RoomRequest("mixed", torch.tensor([0, -1, 5, 4, 6, 1 << 40], dtype=torch.int64, device=DEVICE), 6 * 256 - 3),
        RoomRequest("i32", torch.tensor([3, -(1 << 31), 2], dtype=torch.int32, device=DEVICE), 2 * 256 + 8),
        RoomRequest("clean", torch.tensor([2, 1], device=DEVICE), 2 * 256),
    ]
    for rows in (1, 4):
        cells, contents, flags, plan = _kernel_cells(layout, buffers, [3, 8], rooms, rows=rows)
        want_cells, want_contents, want_flags = _reference_cells(layout, buffers, [3, 8], rooms, plan)
        assert np.array_equal(flags, want_flags) and np.array_equal(cells, want_cells), rows
        assert np.array_equal(contents, want_contents), rows
    from dsv4_idxk_probe.digest.launch import flag_block

    # layer 0 has 6 pages, layer 1 has 4: page 5 and 4 are in range for layer 0 only
    assert flag_block(plan, flags, 0).tolist() == [[0, 1, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert flag_block(plan, flags, 1).tolist() == [[0, 1, 0], [0, 1, 0]]
    assert not flag_block(plan, flags, 2).any()
    assert (plan.block(cells, 0)[flag_block(plan, flags, 0) == 1] == 0).all()
    assert (plan.block(contents, 0)[flag_block(plan, flags, 0) == 1] == 0).all()


@pytest.mark.parametrize("rows", [1, 2])
def test_a_layer_with_an_empty_buffer_flags_every_row(rows, layout, random_buffers):
    """A layer whose buffer has no row: its rows are flagged, never read, stored as 0."""
    buffers = [random_buffers(layout, 1, 4, seed=5)[0].to(DEVICE),
               torch.empty((0, layout.row_bytes), dtype=torch.uint8, device=DEVICE)]
    rooms = [RoomRequest("r", torch.tensor([3, 1, 0, 2], device=DEVICE), 4 * 256)]
    cells, contents, flags, plan = _kernel_cells(layout, buffers, [3, 8], rooms, rows=rows)
    want_cells, want_contents, want_flags = _reference_cells(layout, buffers, [3, 8], rooms, plan)
    assert np.array_equal(flags, want_flags) and np.array_equal(cells, want_cells)
    assert np.array_equal(contents, want_contents) and want_flags.reshape(2, 4).tolist() == [[0] * 4, [1] * 4]


_GUARD_SCRIPT = r"""
import mmap, ctypes, sys
import numpy as np, torch
from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
layout = get_layout(sys.argv[1])
n_pages, page = 4, 4096
nbytes = n_pages * layout.row_bytes
total = page + -(-nbytes // page) * page + page
region = mmap.mmap(-1, total, prot=mmap.PROT_READ | mmap.PROT_WRITE)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
guard = base + total - page
assert libc.mprotect(guard, page, 0) == 0  # the page after the buffer cannot be read
assert libc.mprotect(base, page, 0) == 0  # nor the page before it (row -1 reaches into it)
rows = np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=guard - nbytes - base).reshape(n_pages, -1)
rows[:] = 7
rooms = [RoomRequest("last", [n_pages - 1], 2 * layout.page_tokens),
         RoomRequest("outside", [-1, n_pages, 0, n_pages + 1, 1 << 40], 5 * layout.page_tokens)]
results = {}
for backend, buffer in (("triton", rows), ("reference", rows.copy())):
    engine = DigestEngine(layout, [1], [torch.from_numpy(buffer)], backend=backend)
    got = []
    engine.submit(rooms, got.append)
    engine.close()
    results[backend] = got[0]
kernel, reference = results["triton"], results["reference"]
assert kernel.out_of_range == reference.out_of_range == (0, 4), (kernel.out_of_range, reference.out_of_range)
for k, r in zip(kernel.digests, reference.digests):
    assert np.array_equal(k.layer_segment, r.layer_segment) and np.array_equal(k.pages, r.pages), k.key
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="host memory behind a guard page is read by the CPU interpreter")
@pytest.mark.parametrize("layout_name", ["fp8", "fp4", "bf16"])
def test_no_row_is_read_outside_its_buffer(layout_name):
    """The buffer lies between two unreadable pages. Its last row is digested without
    reading past it (a load past the row's frozen words would kill the process), and
    page ids -1, n_pages, n_pages + 1 and 2^40 are flagged and never read, where a read
    would fault. In a child process, so a regression fails this test, not the suite."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _GUARD_SCRIPT, layout_name], capture_output=True, text=True,
                         timeout=120, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stderr[-2000:])


_HAS_DEPENDENT_LAUNCHES = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not _HAS_DEPENDENT_LAUNCHES,
                    reason="programmatic dependent launches need a GPU of compute capability 9 or later")
def test_a_dependent_launch_reads_the_rows_the_kernel_before_it_wrote(random_buffers):
    """`pdl`: the digest's programs may start while the kernel before it still runs (this
    writer lets them, as PDL-aware kernels do), but read nothing before it has finished:
    the cells are those of the rows it wrote, launch after launch. (Measured 2026-12-02:
    with the kernel's wait deleted, this test fails.)"""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def add_to_every_byte(pool, n, step, BLOCK: tl.constexpr):
        gdc_launch_dependents()  # the next kernel may be launched at once
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        bytes_ = tl.load(pool + offsets, mask=offsets < n)
        tl.store(pool + offsets, bytes_ + step, mask=offsets < n)

    from dsv4_idxk_probe.digest.kernel import DigestKernel, layer_table
    from dsv4_idxk_probe.digest.room_table import plan_cells

    # Set up here rather than through `_kernel_cells`, which fills its outputs just before
    # its launch: here the writer must be the kernel right before each digest launch.
    layout = get_layout("fp8")
    n_layers, n_pages = 8, 2048  # 139 MB: the writer runs for tens of microseconds
    pool = torch.stack([b.to(DEVICE) for b in random_buffers(layout, n_layers, n_pages, seed=5)])
    buffers, layer_ids = list(pool.unbind(0)), list(range(n_layers))
    room = RoomRequest("room", torch.randperm(n_pages, device=DEVICE), n_pages * 256)
    plan = plan_cells([room], n_layers)
    table, base_align = layer_table(buffers, layer_ids, DEVICE)
    kernel = DigestKernel(table, n_layers, layout, base_align=base_align, rows=1, num_warps=1, pdl=True)
    cells = torch.empty((plan.n_cells, len(layout.segments)), dtype=torch.int64, device=DEVICE)
    contents, flags = torch.empty_like(cells), torch.empty(plan.n_cells, dtype=torch.uint8, device=DEVICE)
    one_room = (room.pages.data_ptr(), room.pages.element_size(), room.n_pages, room.n_tokens)
    for step in range(1, 6):
        add_to_every_byte[(triton.cdiv(pool.numel(), 4096),)](pool, pool.numel(), step, BLOCK=4096)
        kernel.launch(0, cells.data_ptr(), contents.data_ptr(), flags.data_ptr(), 1, n_pages, one_room=one_room)
        want_cells, want_contents, want_flags = _reference_cells(layout, buffers, layer_ids, [room], plan)
        assert np.array_equal(cells.cpu().numpy().view(np.uint64), want_cells), step
        assert np.array_equal(contents.cpu().numpy().view(np.uint64), want_contents), step
        assert not flags.cpu().numpy().any(), step
