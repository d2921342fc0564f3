"""Index-K buffers made by SGLang's own `DeepSeekV4IndexerPool`, for the local rig.

Why: the rig should move the very buffers SGLang allocates (same dtype,
shape, page count and zero fill), so a difference between the rig and
production cannot hide in the allocation. Only the layouts SGLang ships
(fp8, fp4) can be built this way; the built-in rig falls back to its own identical
allocation for the rest and when SGLang is not importable.
"""

from __future__ import annotations

import warnings
from typing import Any

#: rig layout name -> use_fp4_indexer
_SGLANG_LAYOUTS = {"fp8": False, "fp4": True}
from ...vocabulary import INDEX_HEAD_DIM, PAGE_TOKENS as FULL_PAGE_TOKENS, SLOTS_PER_PAGE as C4_SLOTS_PER_PAGE


def supports(layout_name: str) -> bool:
    return layout_name in _SGLANG_LAYOUTS


def build_indexer_buffers(layout_name: str, n_layers: int, n_pages: int, device: str) -> list[Any]:
    """`n_layers` uint8 [>= n_pages, row_bytes] buffers from DeepSeekV4IndexerPool.

    Raises ImportError when SGLang (or its DSV4 pool) cannot be imported and
    ValueError for a layout SGLang does not have.
    """
    if layout_name not in _SGLANG_LAYOUTS:
        raise ValueError(f"SGLang's DeepSeekV4IndexerPool has no {layout_name!r} layout")
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool

    # The pool sizes itself as ceil((size + global page) / page) pages; invert that.
    size = max(C4_SLOTS_PER_PAGE, n_pages * C4_SLOTS_PER_PAGE - FULL_PAGE_TOKENS)
    pool = DeepSeekV4IndexerPool(
        size=size,
        page_size=C4_SLOTS_PER_PAGE,
        dtype=torch.uint8,
        index_head_dim=INDEX_HEAD_DIM,
        layer_num=n_layers,
        device=device,
        enable_memory_saver=False,
        use_fp4_indexer=_SGLANG_LAYOUTS[layout_name],
        global_page_size=FULL_PAGE_TOKENS,
    )
    return list(pool.contiguous_page_row_buffers())
