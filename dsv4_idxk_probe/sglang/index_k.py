"""Where a room's index-K lives in SGLang 0.5.23's DeepSeek-V4 pool.

The only code that knows the pool's attribute names
(reference: sglang-0.5.23-pd-hooks.md, section 3):

* ``pool.index_pools[4]`` (alias ``c4_indexer_kv_pool``) is the C4 indexer
  pool; ``contiguous_page_row_buffers()`` gives one uint8 [pages, row_bytes]
  buffer per C4 layer of this PP stage, in compress-layer order (0.5.18-0.5.19:
  ``index_k_with_scale_buffer``, the same tensors; a buffer of
  another dtype or shape whose pages are contiguous rows, such as a bf16
  [pages, 64, 128] patch, is viewed as those bytes: `page_rows_as_bytes`);
* the global layer id of compress layer j is the j-th layer of
  ``compression_ratios[_stage_start:_stage_end]`` with ratio 4;
* each buffer sits on the PD wire at ``kv_args.kv_data_ptrs.index(ptr)``,
  with ``kv_item_lens`` equal to one row: so the transfer's page ids address
  index-K rows directly;
* a room's pages are ``translate_kv_indices_for_transfer(req_to_token[row,
  start:end])[::page_size] // page_size``, the same computation the transfer
  does, kept on the device (no host sync).

Nothing here imports SGLang: objects are read by attribute, so the functions
also work on stand-ins (the sync audit on a GPU machine without SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..vocabulary import C4_RATIO as C4
from .accessors import extend_end, req_pool_idx


class IndexKError(Exception):
    """This pool cannot be probed; the message says why (logged once, probe side off)."""


@dataclass(frozen=True)
class IndexKGeometry:
    buffers: tuple[Any, ...]  # torch.uint8 [num_pages, row_bytes], one per C4 layer
    layer_ids: tuple[int, ...]  # global layer id of each buffer
    wire: tuple[int, ...] | None  # position of each buffer in kv_args.kv_data_ptrs
    page_size: int  # tokens per (full) page: 256 for DeepSeek-V4
    slots: int  # compressed slots per index-K row: page_size // 4
    row_bytes: int
    fp4: bool

    @property
    def tokens_per_slot(self) -> int:
        return self.page_size // self.slots


def dsv4_pool(source: Any) -> Any | None:
    """The DeepSeek-V4 KV pool behind an allocator or pool, or None if it is not one."""
    pool = source.get_kvcache() if hasattr(source, "get_kvcache") else source
    if getattr(pool, "index_pools", None) is None and getattr(pool, "c4_indexer_kv_pool", None) is None:
        return None
    return pool


def index_k_geometry(pool: Any, kv_args: Any = None) -> IndexKGeometry:
    """Index-K buffers, their layer ids and wire positions; IndexKError when unusable."""
    indexer = (getattr(pool, "index_pools", None) or {}).get(C4) or getattr(pool, "c4_indexer_kv_pool", None)
    if indexer is None:
        raise IndexKError("the pool has no C4 indexer pool (not DeepSeek-V4, or no C4 layer in this stage)")
    if getattr(indexer, "index_k_with_scale_buffer", None) is None:
        raise IndexKError("the C4 indexer keeps payload and scales in separate buffers (HIP fp4); not supported")
    reason = row_layout_refusal(indexer)
    if reason:
        raise IndexKError(reason)
    buffers = tuple(page_rows_as_bytes(buf, i) for i, buf in enumerate(indexer_row_buffers(indexer)))
    ratios = list(pool.compression_ratios)
    start = getattr(pool, "_stage_start", 0)
    end = getattr(pool, "_stage_end", len(ratios))
    layer_ids = tuple(layer for layer in range(start, end) if ratios[layer] == C4)
    if len(layer_ids) != len(buffers):
        raise IndexKError(f"{len(buffers)} index-K buffers for {len(layer_ids)} C4 layers in [{start}, {end})")
    if not buffers:
        raise IndexKError("no index-K buffers")
    page_size = int(pool.page_size)
    slots = int(indexer.page_size)
    if slots <= 0 or page_size % slots:
        raise IndexKError(f"index page of {slots} slots does not tile a {page_size}-token page")
    return IndexKGeometry(
        buffers=buffers,
        layer_ids=layer_ids,
        wire=wire_positions(buffers, kv_args) if kv_args is not None else None,
        page_size=page_size,
        slots=slots,
        row_bytes=int(buffers[0].shape[1]),
        fp4=bool(getattr(indexer, "use_fp4_indexer", False)),
    )


def indexer_row_buffers(indexer: Any) -> list:
    """The indexer's per-layer page-row buffers: ``contiguous_page_row_buffers()``
    (0.5.20+), else its fused ``index_k_with_scale_buffer`` list (0.5.18-0.5.19,
    the same uint8 [pages, row_bytes] tensors)."""
    rows = getattr(indexer, "contiguous_page_row_buffers", None)
    return list(rows()) if rows is not None else list(indexer.index_k_with_scale_buffer)


def page_rows_as_bytes(buf: Any, index: int = 0) -> Any:
    """An index-K buffer of any dtype and shape as uint8 [pages, row_bytes], a view of
    the same memory: a bf16 [pages, 64, 128] buffer (the bf16 deployment patch) is
    [pages, 16384]. The layout is then matched by row bytes. Only a buffer whose
    pages are contiguous rows qualifies; nothing is copied."""
    import torch

    if buf.dim() < 1 or buf.shape[0] < 1 or not buf.is_contiguous():
        raise IndexKError(f"index-K buffer {index} is {buf.dtype} {tuple(buf.shape)}, not contiguous page rows")
    if buf.dtype == torch.uint8 and buf.dim() == 2:
        return buf
    flat = buf.reshape(buf.shape[0], -1)  # a view: the buffer is contiguous
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


#: Where SGLang decides that ROCm stores fp8 index-K preshuffled (aiter paged MQA).
PRESHUFFLE_MODULE = "sglang.kernels.ops.kvcache.dsa_index_k_cache"


def row_layout_refusal(indexer: Any) -> str | None:
    """Why this fp8 pool's rows do not follow "slot k at byte 128 k", or None.

    On ROCm with aiter's preshuffled paged MQA, SetKAndS stores each page in
    16-slot tiles interleaved by column, and with ``index_k_page8`` in aiter's
    row-group page-8 order: the payload of one slot is spread over the page,
    so the frozen-slot rule would read decode's later writes as corruption.
    No layout describes those orders yet; the side is refused with this reason.
    """
    import sys

    if getattr(sys.modules.get(PRESHUFFLE_MODULE), "_use_aiter_preshuffle", False):
        return ("fp8 index-K is stored preshuffled in 16-slot tiles (ROCm, aiter_can_use_preshuffle_paged_mqa); "
                "no layout describes it: not supported")
    if getattr(indexer, "index_k_page8", False):
        return "fp8 index-K uses aiter's row-group page-8 order (index_k_page8); no layout describes it: not supported"
    return None


def wire_positions(buffers: Sequence[Any], kv_args: Any) -> tuple[int, ...]:
    """Position of each buffer among the transferred KV entries, matched by data_ptr."""
    ptrs = [int(p) for p in kv_args.kv_data_ptrs]
    lens = [int(n) for n in kv_args.kv_item_lens]
    positions = []
    for buf in buffers:
        try:
            w = ptrs.index(buf.data_ptr())
        except ValueError:
            raise IndexKError("an index-K buffer is not among the PD transfer buffers (kv_data_ptrs)") from None
        row = buf[0].numel() * buf.element_size()
        if lens[w] != row:
            raise IndexKError(f"transfer item length {lens[w]} B at wire entry {w} is not one index-K row ({row} B)")
        positions.append(w)
    return tuple(positions)


def choose_layout(geometry: IndexKGeometry, wanted: str, layouts: Mapping[str, Any]):
    """The RowLayout for these buffers: `wanted` by name, or the one that fits ("auto")."""
    if wanted != "auto":
        layout = layouts.get(wanted)
        if layout is None:
            raise IndexKError(f"layout {wanted!r} is not defined; known: {sorted(layouts)}")
        if layout.row_bytes != geometry.row_bytes or layout.slots != geometry.slots:
            raise IndexKError(
                f"layout {wanted!r} has {layout.slots} slots x {layout.row_bytes} B rows; "
                f"the pool has {geometry.slots} x {geometry.row_bytes} B"
            )
        return layout
    fits = [
        layout for layout in layouts.values()
        if layout.row_bytes == geometry.row_bytes and layout.slots == geometry.slots
        and layout.tokens_per_slot == geometry.tokens_per_slot
    ]
    if len(fits) != 1:
        names = sorted(layout.name for layout in fits)
        raise IndexKError(
            f"{'no' if not fits else 'more than one'} layout fits {geometry.slots}-slot rows of "
            f"{geometry.row_bytes} B ({names}); set `layout` in the probe config"
        )
    return fits[0]


# %% a room's pages


@dataclass(frozen=True)
class RoomPages:
    pages: Any  # device tensor of page ids, logical page k -> physical page
    n_tokens: int  # transferred tokens, from the start of logical page 0
    start: int  # first transferred token (page-aligned decode prefix)


def prefill_room_pages(scheduler: Any, req: Any, end_idx: int | None) -> RoomPages | str:
    """The pages a last-chunk send covers, or a reason string when it cannot be digested."""
    allocator = scheduler.token_to_kv_pool_allocator
    page_size = int(allocator.page_size)
    start = int(req.disagg_decode_prefix_len or 0)
    end = int(end_idx) if end_idx is not None else min(extend_end(req), len(req.origin_input_ids))
    if start % page_size:
        return f"decode prefix {start} is not page aligned"
    if end <= start:
        return "nothing to transfer"
    rows = scheduler.req_to_token_pool.req_to_token[req_pool_idx(req), start:end]
    tokens = allocator.translate_kv_indices_for_transfer(rows)
    return RoomPages(tokens[::page_size] // page_size, end - start, start)


def decode_room_pages(kv_indices: Any, page_size: int, metadata_kwargs: Mapping[str, Any]) -> RoomPages | str:
    """The destination pages decode publishes in `_send_kv_metadata`."""
    start = int(metadata_kwargs.get("decode_prefix_len", 0) or 0)
    n_tokens = len(kv_indices)
    if n_tokens <= 0:
        return "nothing to receive"
    device_pages = metadata_kwargs.get("device_kv_indices")
    if device_pages is not None:  # HiSparse: KV goes to host rows, index-K stays in device pages
        return RoomPages(device_pages, n_tokens, start)
    return RoomPages(kv_indices[::page_size] // page_size, n_tokens, start)
