"""A DeepSeek-V4.1 pool on CPU: SGLang's real ``DeepSeekV4TokenToKVPool`` with
``compression_ratios=[0, 4, 128, 4, 1, 2]`` and kv_source layers 4 (ratio 1) and
5 (ratio 2), so ``index_pools`` is {4: fp8 C4, 1: fp4, 2: fp4}, every buffer
filled with random bytes.

A room: a decode prefix page, then two full pages and a tail of 100 tokens, held
in different physical pages on prefill and decode (as tests/sglang/pdworld.py).
"""

from __future__ import annotations

import torch

from dsv4_idxk_probe.sglang.index_k import indexer_row_buffers

PAGE = 256
RATIOS = [0, 4, 128, 4, 1, 2]
KV_SOURCES = [4, 5]
PREFIX_TOKENS = PAGE
ROOM_TOKENS = 2 * PAGE + 100
PREFILL_PAGES = [7, 2, 5, 4]
DECODE_PAGES = [3, 8, 1, 6]


def sent_tokens(pages: list[int], n_tokens: int) -> torch.Tensor:
    """Prefill's table of a send, as its hook passes it: the room's token indices (int32, as
    SGLang's request table holds them), `PAGE` per page."""
    locs = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int32) for p in pages])
    return locs[:n_tokens]


def make_pool(seed: int, layers: tuple[int, int] | None = None):
    """The pool, every index buffer random. `layers`: (start, end), a PP stage's pool of those
    layers only (SGLang makes a further pool only on the stages holding its layers)."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    start, end = layers if layers is not None else (None, None)
    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=1024, c4_size=512, c128_size=16, c4_state_pool_size=64,
        c128_state_pool_size=64, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
        qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(RATIOS) if layers is None else end - start,
        device="cpu", enable_memory_saver=False, compression_ratios=RATIOS, kv_source_layers=KV_SOURCES,
        full_size=8 * PAGE, start_layer=start, end_layer=end,
    )
    g = torch.Generator().manual_seed(seed)
    for indexer in pool.index_pools.values():
        for buf in indexer_row_buffers(indexer):
            buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    return pool


def kv_args_of(pool):
    from types import SimpleNamespace

    ptrs, lens, items = pool.get_contiguous_buf_infos()
    return SimpleNamespace(kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items, state_types=[])


def rows_per_page(pool, ratio: int) -> int:
    return 1 if ratio == 4 else PAGE // (ratio * pool.index_pools[ratio].page_size)


def transfer_stages(stage_pools, decode_pool) -> None:
    """`transfer` from a PP prefill's stage pools: each stage's layers of each pool go to
    the same global layers of decode's pool."""
    from dsv4_idxk_probe.sglang.index_k import pool_layer_ids

    for ratio, dst_pool in decode_pool.index_pools.items():
        k = rows_per_page(decode_pool, ratio)
        dst_layers, dst_bufs = pool_layer_ids(decode_pool, ratio), indexer_row_buffers(dst_pool)
        for stage in stage_pools:
            if ratio not in stage.index_pools:
                continue
            for layer, src in zip(pool_layer_ids(stage, ratio), indexer_row_buffers(stage.index_pools[ratio])):
                dst = dst_bufs[dst_layers.index(layer)]
                for p, d in zip(PREFILL_PAGES[1:], DECODE_PAGES[1:]):
                    dst[d * k : (d + 1) * k] = src[p * k : (p + 1) * k]


def transfer(prefill_pool, decode_pool) -> None:
    """What the KV transfer does to every index pool: full page P[i] -> D[i], each
    full page being `rows_per_page` consecutive rows of a low-ratio pool."""
    for ratio, indexer in prefill_pool.index_pools.items():
        k = rows_per_page(prefill_pool, ratio)
        dst_pool = decode_pool.index_pools[ratio]
        for src, dst in zip(indexer_row_buffers(indexer), indexer_row_buffers(dst_pool)):
            for p, d in zip(PREFILL_PAGES[1:], DECODE_PAGES[1:]):
                dst[d * k : (d + 1) * k] = src[p * k : (p + 1) * k]
