"""Properties of the definition (NumPy reference), checked with hypothesis."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_idxk_probe.digest import compare, get_layout
from dsv4_idxk_probe.digest import reference as ref

LAYOUTS = {name: get_layout(name) for name in ("fp8", "fp4", "bf16")}


@st.composite
def rooms(draw):
    """A small random pool and a room in it: (layout, buffers, pages, n_tokens, layer ids)."""
    layout = LAYOUTS[draw(st.sampled_from(sorted(LAYOUTS)))]
    n_layers = draw(st.integers(1, 3))
    n_pages = draw(st.integers(1, 3))
    pool_pages = n_pages + draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    buffers = [rng.integers(0, 256, (pool_pages, layout.row_bytes), dtype=np.uint8) for _ in range(n_layers)]
    pages = list(rng.permutation(pool_pages)[:n_pages])
    n_tokens = draw(st.integers((n_pages - 1) * 256 + 1, n_pages * 256))
    layer_ids = sorted(rng.choice(61, n_layers, replace=False).tolist())
    return layout, buffers, pages, n_tokens, layer_ids


def _frozen_bytes(layout, n_tokens, logical_page):
    n = layout.frozen_slots(n_tokens, logical_page)
    return [(s, seg.offset + i) for s, seg in enumerate(layout.segments) for i in range(n * seg.slot_bytes)]


def _unfrozen_bytes(layout, n_tokens, logical_page):
    frozen = {b for _, b in _frozen_bytes(layout, n_tokens, logical_page)}
    return [b for b in range(layout.row_bytes) if b not in frozen]


@settings(max_examples=60, deadline=None)
@given(rooms(), st.data())
def test_any_flipped_frozen_bit_is_found_and_localised_exactly(room, data):
    layout, buffers, pages, n_tokens, layer_ids = room
    before = ref.digest_room(buffers, pages, n_tokens, layout, layer_ids)
    li = data.draw(st.integers(0, len(buffers) - 1))
    lp = data.draw(st.integers(0, len(pages) - 1))
    candidates = _frozen_bytes(layout, n_tokens, lp)
    if not candidates:  # a last page with no frozen slot has nothing to flip
        return
    seg, byte = data.draw(st.sampled_from(candidates))
    bit = data.draw(st.integers(0, 7))
    buffers[li][pages[lp], byte] ^= np.uint8(1 << bit)
    after = ref.digest_room(buffers, pages, n_tokens, layout, layer_ids)
    assert after.room != before.room
    result = compare(before, after)
    assert result.verdict == "mismatch" and result.exact
    assert result.layer_segments == [(layer_ids[li], layout.segments[seg].name)]
    assert result.pages == [lp]


@settings(max_examples=40, deadline=None)
@given(rooms(), st.data())
def test_bytes_outside_frozen_slots_never_matter(room, data):
    layout, buffers, pages, n_tokens, layer_ids = room
    before = ref.digest_room(buffers, pages, n_tokens, layout, layer_ids)
    lp = len(pages) - 1  # the tail page is the only one with unfrozen slots
    for li in range(len(buffers)):
        for byte in _unfrozen_bytes(layout, n_tokens, lp):
            buffers[li][pages[lp], byte] ^= np.uint8(data.draw(st.integers(1, 255)) if byte == 0 else 0xA5)
    after = ref.digest_room(buffers, pages, n_tokens, layout, layer_ids)
    assert compare(before, after).verdict == "match"


@settings(max_examples=30, deadline=None)
@given(rooms(), st.integers(0, 2**32 - 1))
def test_relocation_gives_the_same_digest(room, seed):
    layout, buffers, pages, n_tokens, layer_ids = room
    rng = np.random.default_rng(seed)
    pool = len(pages) + 3
    moved_pages = list(rng.permutation(pool)[: len(pages)])
    moved = [rng.integers(0, 256, (pool, layout.row_bytes), dtype=np.uint8) for _ in buffers]
    for src, dst in zip(buffers, moved):
        dst[moved_pages] = src[pages]
    a = ref.digest_room(buffers, pages, n_tokens, layout, layer_ids)
    b = ref.digest_room(moved, moved_pages, n_tokens, layout, layer_ids)
    assert compare(a, b).verdict == "match" and a.room == b.room


def test_swapped_pages_and_layers_are_mismatches():
    layout = LAYOUTS["fp8"]
    rng = np.random.default_rng(7)
    buffers = [rng.integers(0, 256, (4, layout.row_bytes), dtype=np.uint8) for _ in range(2)]
    base = ref.digest_room(buffers, [0, 1], 512, layout, [0, 1])
    swapped_pages = ref.digest_room(buffers, [1, 0], 512, layout, [0, 1])
    swapped_layers = ref.digest_room(buffers[::-1], [0, 1], 512, layout, [0, 1])
    assert compare(base, swapped_pages).pages == [0, 1]
    assert compare(base, swapped_layers).layers == [0, 1]


def test_edge_rooms():
    layout = LAYOUTS["fp8"]
    buffers = [np.full((2, layout.row_bytes), 7, dtype=np.uint8)]
    empty = ref.digest_room(buffers, [], 0, layout, [5])
    assert empty.room == 0 and empty.n_pages == 0
    one_slot = ref.digest_room(buffers, [1], 4, layout, [5])  # one layer, one page, one frozen slot
    buffers[0][1, 128] ^= 1  # second payload slot: not frozen
    buffers[0][1, 8192 + 4] ^= 1  # second scale slot: not frozen
    assert ref.digest_room(buffers, [1], 4, layout, [5]).room == one_slot.room
    buffers[0][1, 3] ^= 1  # first slot: frozen
    assert ref.digest_room(buffers, [1], 4, layout, [5]).room != one_slot.room
    three_tokens = ref.digest_room(buffers, [1], 3, layout, [5])  # no complete group yet
    assert three_tokens.layer_segment.any()  # cells still salt-fold to nonzero values


def test_lane_sums_wrap_mod_2_32():
    """All-0xFF rows make the lane sums overflow 32 bits many times over."""
    layout = LAYOUTS["bf16"]
    rows = np.full((1, layout.row_bytes), 0xFF, dtype=np.uint8)
    d = int(ref.segment_digests(rows, [64], layout)[0, 0])
    words = np.arange(layout.row_bytes // 4, dtype=np.uint64)
    m = np.uint64(0xFFFFFFFF)
    x = (m ^ ((words * np.uint64(ref.SALT_MUL) + np.uint64(ref.SALT_ADD)) & m))
    a = x ^ (x >> np.uint64(16))  # fmix32
    a = (a * np.uint64(ref.MIX_A)) & m
    a ^= a >> np.uint64(13)
    a = (a * np.uint64(ref.MIX_B)) & m
    a ^= a >> np.uint64(16)
    total_a = sum(int(v) for v in a)
    assert total_a > 2**32
    assert d & 0xFFFFFFFF == total_a % 2**32


@pytest.mark.parametrize("bit", range(24, 32))
def test_the_same_high_bit_flipped_in_two_words_of_a_segment_changes_its_digest(bit):
    """The same bit flipped in two words of one segment (bit 31: the sign of two fp8 values)
    must not cancel in the lane sums: digest version 1 left a quarter of such pairs of bit 31
    unchanged (docs/digest.md, "Words"). 8,000 random fp8 rows, two random payload words each."""
    layout = LAYOUTS["fp8"]
    payload = layout.segments[0]
    n_words = layout.slots * payload.slot_words
    rng = np.random.default_rng(bit)
    n = 8_000
    rows = rng.integers(0, 256, (n, layout.row_bytes), dtype=np.uint8)
    frozen = np.full(n, layout.slots)
    before = ref.segment_digests(rows, frozen, layout)
    words = rows.view("<u4")
    first = rng.integers(0, n_words, n)
    second = (first + rng.integers(1, n_words, n)) % n_words  # another payload word of the row
    every = np.arange(n)
    words[every, payload.word_offset + first] ^= np.uint32(1 << bit)
    words[every, payload.word_offset + second] ^= np.uint32(1 << bit)
    after = ref.segment_digests(rows, frozen, layout)
    assert int((before[:, 0] == after[:, 0]).sum()) == 0
    assert (before[:, 1] == after[:, 1]).all()  # the scale segment did not change


@pytest.mark.parametrize("shape", [(3, 5, 2), (1, 1, 1), (4, 0, 2), (2, 7, 3)])
def test_fold_cells_is_the_sum_mod_2_64_along_each_axis(shape):
    rng = np.random.default_rng(sum(shape))
    block = rng.integers(0, 2**64, size=shape, dtype=np.uint64, endpoint=False)
    layers, pages, segments = shape
    by_layer, by_page = ref.fold_cells(block)
    mod = 2**64
    assert by_layer.tolist() == [[sum(int(block[l, p, s]) for p in range(pages)) % mod for s in range(segments)]
                                 for l in range(layers)]
    assert by_page.tolist() == [sum(int(block[l, p, s]) for l in range(layers) for s in range(segments)) % mod
                                for p in range(pages)]
