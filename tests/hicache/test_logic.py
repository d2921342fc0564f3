"""The SGLang-free logic of dsv4_idxk_probe.hicache: plain facts in, decisions out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_idxk_probe.hicache import DeviceBuffer, PoolGeometry, RoundTrip, TokenRow, classify, label_sets
from dsv4_idxk_probe.hicache.branches import NO_IO_BACKEND
from dsv4_idxk_probe.hicache.geometry import token_row_mismatches
from dsv4_idxk_probe.sglang.hicache import DSV4_MLA_TOKEN_ROW, PAGE_ROUTES

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKENDS = ("kernel", "direct", "kernel_ascend")


def geometry(layout="layer_first", page_size=256, item_bytes=8448, aligned_only=False, token_row=DSV4_MLA_TOKEN_ROW):
    buf = DeviceBuffer((20, item_bytes), "uint8", True, item_bytes)
    return PoolGeometry("p", 2, item_bytes, page_size, 8, layout, aligned_only, (buf, buf), PAGE_ROUTES, token_row)


@settings(max_examples=300, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    aligned_only=st.booleans(),
    page_size=st.sampled_from([1, 64, 256]),
    host=st.one_of(st.none(), st.integers(0, 2048)),
    device=st.one_of(st.none(), st.integers(0, 2048)),
    io_backend=st.sampled_from(BACKENDS + (None,)),
    direction=st.sampled_from(("d2h", "h2d")),
)
def test_every_branch_a_call_can_take_has_a_zero_series(layout, aligned_only, page_size, host, device, io_backend, direction):
    geom = geometry(layout, page_size, aligned_only=aligned_only)
    if io_backend is None:
        direction = "d2h"  # the token-only call is a backup
    branch = classify(geom, host, device, io_backend)
    assert (direction, io_backend or NO_IO_BACKEND, branch) in set(label_sets(geom, BACKENDS))


def test_only_the_c4_latent_row_passes_the_guard():
    c4 = DeviceBuffer((20, 37440), "uint8", True, 37440)
    hisparse = PoolGeometry("c4", 2, 37440, 64, 8, "layer_first", False, (c4,), PAGE_ROUTES, DSV4_MLA_TOKEN_ROW)
    assert token_row_mismatches(hisparse) == []
    assert len(token_row_mismatches(geometry())) == 3  # item bytes, page size and device rows all differ
    other_kernel = TokenRow(slots=256, value_bytes=32, scale_bytes=1, page_bytes=8448)
    assert token_row_mismatches(geometry(token_row=other_kernel)) == []


class _Pool:
    """What RoundTrip reads from a pool state."""

    def __init__(self, key):
        self.key = key
        self.geom = geometry()


def test_roundtrip_table_is_bounded_and_counts_evictions():
    evicted = []
    table = RoundTrip(lambda *a: None, evicted.append, max_entries=5)
    pool = _Pool(1)
    for row in range(4):
        for layer in range(2):
            table._store((pool.key, row, layer), row)
    assert len(table) == 5 and sum(evicted) == 3
    assert table.invalidate(pool, [3]) == 2  # the newest row, both layers, is still there
