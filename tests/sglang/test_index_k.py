"""Finding a room's index-K rows in SGLang's real DeepSeek-V4 pools (CPU)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pdworld
import pytest
import torch
from pd_testkit import make_runtime

from dsv4_idxk_probe.config import parse_config
from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, shipped_layouts
from dsv4_idxk_probe.sglang.index_k import (
    IndexKError, RoomPages, choose_layout, decode_room_pages, dsv4_pool, index_k_geometry, page_ids_of,
    prefill_room_pages,
)
from dsv4_idxk_probe.sglang.sides import InactiveSide, build_side

ROOM_PAGES = pdworld.PREFILL_PAGES[1:]


@pytest.fixture
def prefill(published):
    return pdworld.make_side(seed=3, pages=pdworld.PREFILL_PAGES)


def test_geometry_of_the_real_pool(prefill):
    geometry = index_k_geometry(dsv4_pool(prefill.allocator), prefill.kv_args)
    assert geometry.layer_ids == tuple(pdworld.C4_LAYERS)
    assert (geometry.page_size, geometry.slots, geometry.row_bytes, geometry.fp4) == (256, 64, 64 * 132, False)
    n4, n128 = pdworld.COMPRESSION_RATIOS.count(4), pdworld.COMPRESSION_RATIOS.count(128)
    # wire order [C4 KV x n4, C4 indexer x n4, C128 KV x n128] (reference 3.1)
    assert geometry.wire == tuple(range(n4, 2 * n4))
    assert len(prefill.kv_args.kv_data_ptrs) == 2 * n4 + n128
    assert choose_layout(geometry, "auto", shipped_layouts()).name == "fp8"


@pytest.mark.skipif(pdworld.RELEASE < (0, 5, 22), reason="the fp4 indexer with a global page size arrives in SGLang 0.5.22")
def test_fp4_indexer_pool_picks_the_fp4_layout(published):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool

    indexer = DeepSeekV4IndexerPool(
        size=512, page_size=64, dtype=torch.bfloat16, index_head_dim=128, layer_num=2, device="cpu",
        enable_memory_saver=False, use_fp4_indexer=True, global_page_size=256,
    )
    pool = SimpleNamespace(index_pools={4: indexer}, compression_ratios=[4, 128, 4], page_size=256)
    geometry = index_k_geometry(pool)
    assert (geometry.layer_ids, geometry.row_bytes, geometry.fp4) == ((0, 2), 64 * 68, True)
    assert choose_layout(geometry, "auto", shipped_layouts()).name == "fp4"


def test_room_pages_with_decode_prefix_and_partial_tail(prefill):
    """Prefill's table is the room's token indices from the decode prefix on, page size
    entries per page (its engine reads each page's first); as page ids, the room's pages."""
    req = pdworld.prefill_req(11)
    pages = prefill_room_pages(prefill.scheduler, req, None)
    assert (pages.stride, len(pages.pages)) == (pdworld.PAGE, pdworld.ROOM_TOKENS)
    assert pages.page_ids().tolist() == ROOM_PAGES
    assert (pages.start, pages.n_tokens) == (pdworld.PREFIX_TOKENS, pdworld.ROOM_TOKENS)


@pytest.mark.parametrize("kind", ["tensor", "ndarray", "list"])
def test_page_ids_of_a_token_table_are_each_pages_first_index_over_the_page_size(kind):
    tokens = [5 * 4 + i for i in range(4)] + [1 * 4 + i for i in range(4)] + [9 * 4, 9 * 4 + 1]  # a short tail
    table = {"tensor": torch.tensor(tokens, dtype=torch.int32), "ndarray": np.array(tokens), "list": tokens}[kind]
    ids = page_ids_of(table, 4)
    assert list(map(int, ids)) == [5, 1, 9]
    assert RoomPages(table, 10, 0, 4).page_ids() is not table and RoomPages(table, 10, 0).page_ids() is table


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_prefill_engine_reads_the_token_indices_as_a_page_id_engine_reads_the_pages(prefill, backend):
    """The send's table goes to the engine as SGLang's request table holds it (int32 token
    indices, 256 per page, the last page partial), in prefill's engine form: the room digest,
    its page vector and its bytes are those of an engine reading the page ids. Fails if the
    kernel (here under the interpreter) or the reference read the entries without the stride."""
    geometry = index_k_geometry(dsv4_pool(prefill.allocator), prefill.kv_args)
    layout = choose_layout(geometry, "auto", shipped_layouts())
    options = DigestEngine.role_options(parse_config({}), "prefill")
    pages = prefill_room_pages(prefill.scheduler, pdworld.prefill_req(11), None)
    assert pages.pages.dtype == torch.int32
    strided = DigestEngine(layout, geometry.layer_ids, geometry.buffers, backend=backend,
                           page_id_stride=pages.stride, **options)
    plain = DigestEngine(layout, geometry.layer_ids, geometry.buffers, backend="reference")
    got: list = []
    delivered = threading.Event()
    try:
        strided.submit_room("11/0", pages.pages, pages.n_tokens, lambda batch: (got.append(batch), delivered.set()))
        (want,) = plain.digest_now([RoomRequest("11/0", pages.page_ids(), pages.n_tokens)])
        assert delivered.wait(60), "the collector delivered nothing"
    finally:
        strided.close()
        plain.close()
    (batch,) = got
    (digest,) = batch.digests
    assert digest.room == want.room and (digest.pages == want.pages).all() and len(digest.pages) == len(ROOM_PAGES)
    assert batch.out_of_range == (0,) and batch.room_bytes[0] > 0


def test_unaligned_prefix_is_refused_with_a_reason(prefill):
    req = pdworld.prefill_req(11)
    req.disagg_decode_prefix_len = 100
    assert prefill_room_pages(prefill.scheduler, req, None) == "decode prefix 100 is not page aligned"


def test_decode_pages_from_the_published_destination(published):
    decode = pdworld.make_side(seed=4, pages=pdworld.DECODE_PAGES)
    kv = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pages = decode_room_pages(kv, pdworld.PAGE, {"decode_prefix_len": pdworld.PREFIX_TOKENS})
    assert (pages.pages.tolist(), pages.n_tokens) == (pdworld.DECODE_PAGES[1:], pdworld.ROOM_TOKENS)


def _room_digest(side, engine):
    pages = prefill_room_pages(side.scheduler, pdworld.prefill_req(11), None)
    return engine.digest_now([RoomRequest("11/0", pages.page_ids(), pages.n_tokens)])[0]


@pytest.mark.parametrize("where, counts", [
    ("room page, first byte", True),
    ("room tail page, last frozen slot's scale", True),
    ("room tail page, first unfrozen slot", False),
    ("decode prefix page", False),
    ("page of no room", False),
])
def test_digest_covers_exactly_the_rooms_frozen_rows(prefill, where, counts):
    geometry = index_k_geometry(dsv4_pool(prefill.allocator), prefill.kv_args)
    engine = DigestEngine(choose_layout(geometry, "auto", shipped_layouts()), geometry.layer_ids, geometry.buffers)
    before = _room_digest(prefill, engine)
    frozen_tail = (pdworld.ROOM_TOKENS - 2 * pdworld.PAGE) // 4  # 25 slots
    page, offset = {
        "room page, first byte": (ROOM_PAGES[0], 0),
        "room tail page, last frozen slot's scale": (ROOM_PAGES[2], 8192 + (frozen_tail - 1) * 4 + 3),
        "room tail page, first unfrozen slot": (ROOM_PAGES[2], frozen_tail * 128),
        "decode prefix page": (pdworld.PREFILL_PAGES[0], 17),
        "page of no room": (0, 17),
    }[where]
    for layer in geometry.buffers:
        layer[page, offset] ^= 0x40
    after = _room_digest(prefill, engine)
    assert (after.room != before.room) is counts
    engine.close()


def test_side_is_inactive_with_a_reason_when_the_pool_cannot_be_read(prefill):
    runtime, _, _ = make_runtime(layout="fp4")
    side = build_side(runtime, "prefill", prefill.allocator, prefill.kv_args, host=None)
    assert isinstance(side, InactiveSide)
    assert "layout 'fp4' has 64 slots x 4352 B rows; the pool has 64 x 8448 B" in side.reason
    other, _, _ = make_runtime()
    assert "not a DeepSeek-V4 pool" in build_side(other, "decode", SimpleNamespace(), None).reason
    with pytest.raises(IndexKError, match="no C4 indexer pool"):
        index_k_geometry(SimpleNamespace(index_pools={}, c4_indexer_kv_pool=None))
    runtime.close()
    other.close()


# %% finding 6: row orders no layout describes are refused by name


def test_rocm_preshuffled_fp8_rows_are_refused_with_the_reason(monkeypatch):
    import sys

    from dsv4_idxk_probe.sglang.index_k import PRESHUFFLE_MODULE

    pool, _ = pdworld.make_pool(seed=1)
    # what SGLang's store module decides on ROCm with aiter's preshuffled paged MQA
    monkeypatch.setitem(sys.modules, PRESHUFFLE_MODULE, SimpleNamespace(_use_aiter_preshuffle=True))
    with pytest.raises(IndexKError, match="preshuffled in 16-slot tiles"):
        index_k_geometry(pool)


def test_aiter_page8_rows_are_refused_with_the_reason():
    pool, _ = pdworld.make_pool(seed=1)
    pdworld.c4_indexer(pool).index_k_page8 = True
    with pytest.raises(IndexKError, match="page-8"):
        index_k_geometry(pool)


# %% index-K of any dtype, viewed as its bytes


class _Bf16Indexer:
    """The bf16 index-K deployment patch: one bf16 [pages, 64, 128] buffer per C4 layer."""

    page_size = 64
    use_fp4_indexer = False

    def __init__(self, buffers):
        self.index_k_with_scale_buffer = buffers
        self._buffers = buffers

    def contiguous_page_row_buffers(self):
        return list(self._buffers)


def test_bf16_index_k_buffer_is_digested_like_the_same_bytes_as_uint8_rows():
    gen = torch.Generator().manual_seed(18)
    bf16 = [torch.randn((6, 64, 128), generator=gen).to(torch.bfloat16) for _ in range(2)]
    pool = SimpleNamespace(index_pools={4: _Bf16Indexer(bf16)}, compression_ratios=[4, 128, 4], page_size=256)
    geometry = index_k_geometry(pool)
    assert geometry.row_bytes == 64 * 128 * 2 == 16384
    assert all(b.dtype == torch.uint8 and b.data_ptr() == o.data_ptr() for b, o in zip(geometry.buffers, bf16))
    layout = choose_layout(geometry, "auto", shipped_layouts())
    assert layout.name == "bf16"
    rows = [torch.from_numpy(b.view(torch.int16).numpy().view("uint8").reshape(6, -1).copy()) for b in bf16]  # copied bytes
    pages, n_tokens = torch.tensor([4, 1, 5]), 2 * 256 + 100
    viewed = DigestEngine(layout, geometry.layer_ids, geometry.buffers).digest_now([RoomRequest("1/0", pages, n_tokens)])[0]
    copied = DigestEngine(layout, geometry.layer_ids, rows).digest_now([RoomRequest("1/0", pages, n_tokens)])[0]
    assert int(viewed.room) == int(copied.room)
    assert viewed.pages.tolist() == copied.pages.tolist() and viewed.layer_segment.tolist() == copied.layer_segment.tolist()
    # and a change of one bf16 element's bytes on a room page is seen
    bf16[1][5, 0, 0] = bf16[1][5, 0, 0] + 1
    changed = DigestEngine(layout, geometry.layer_ids, geometry.buffers).digest_now([RoomRequest("1/0", pages, n_tokens)])[0]
    assert int(changed.room) != int(viewed.room)


def test_index_k_buffer_whose_pages_are_not_contiguous_rows_is_refused():
    strided = torch.zeros((128, 64, 6), dtype=torch.bfloat16).permute(2, 1, 0)  # [6, 64, 128], not contiguous
    pool = SimpleNamespace(index_pools={4: _Bf16Indexer([strided, strided])}, compression_ratios=[4, 4], page_size=256)
    with pytest.raises(IndexKError, match="not contiguous page rows"):
        index_k_geometry(pool)
