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
  does, kept on the device (no host sync). Prefill hands the token indices
  themselves to an engine that reads each page's first (`RoomPages.stride`):
  no device op of ours on the serving thread.

DeepSeek-V4.1 (``compression_ratios`` with ratios 1 and 2) adds one
low-ratio indexer pool per ratio to ``pool.index_pools`` (SGLang 0.5.23:
fp4, ``DSV41_INDEX_PAGE_SIZE`` = 64 (128 with DeepGEMM's paged kernel) slots
per index page, 4352 B rows at 64 slots, round-to-nearest-even quantisation
``index_k_rne``, optional aiter row-group ``index_k_page8`` on ROCm). Its layers
are ``pool.sources_by_ratio[ratio]`` (the kv_source layers; the other layers of
that ratio read their source's rows), and one FULL page p is index pages
``p * k .. p * k + k - 1`` with k = page_size // (ratio * slots): the wire
entry's item is those k rows (`get_contiguous_buf_infos`). `index_pools`
lists every pool with its geometry and layout, or why it cannot be read.

Nothing here imports SGLang: objects are read by attribute, so the functions
also work on stand-ins (the sync audit on a GPU machine without SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..vocabulary import C4_RATIO as C4
from .accessors import extend_end, req_pool_idx


class IndexKError(Exception):
    """This pool cannot be probed; the message says why (logged once, probe side off).

    `code` is the low-cardinality word the status metric and the coverage counter
    carry: ``layout_unknown`` (a pool the probe cannot read) or ``not_dsv4``."""

    def __init__(self, message: str, code: str = "layout_unknown"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class IndexKGeometry:
    buffers: tuple[Any, ...]  # torch.uint8 [num_pages, row_bytes], one per C4 layer
    layer_ids: tuple[int, ...]  # global layer id of each buffer
    wire: tuple[int, ...] | None  # position of each buffer in kv_args.kv_data_ptrs
    page_size: int  # tokens per (full) page: 256 for DeepSeek-V4
    slots: int  # compressed slots per index-K row: page_size // 4
    row_bytes: int
    fp4: bool
    ratio: int = C4  # the index pool's compression ratio (its key in ``index_pools``)
    rows_per_page: int = 1  # index-K rows per full (allocator) page: 1 for C4, 256 // (ratio * slots) below

    @property
    def tokens_per_slot(self) -> int:
        return self.page_size // self.slots

    def room_bytes(self, n_tokens: int) -> int:
        """Index-K bytes this pool moves for a room of `n_tokens` (whole rows, every layer)."""
        rows = -(-max(0, int(n_tokens)) // self.page_size)
        return rows * self.row_bytes * len(self.buffers)


@dataclass(frozen=True)
class IndexPool:
    """One entry of a DeepSeek-V4 pool's ``index_pools``, as the probe reads it:
    its geometry and row layout, or the reason it cannot be read (then both None)."""

    ratio: int
    geometry: IndexKGeometry | None
    layout: Any = None  # digest.layout.RowLayout
    reason: str = ""
    code: str = ""  # IndexKError.code when unreadable
    bytes_per_page: int = 0  # index-K bytes of one full page, all layers (readable or not)

    @property
    def readable(self) -> bool:
        return self.geometry is not None and self.layout is not None

    def describe(self) -> str:
        """One line for logs: "pool 1: fp4_r1 (4352 B rows, layers [4])" or the reason."""
        if not self.readable:
            return f"pool {self.ratio}: not read ({self.reason})"
        g = self.geometry
        return f"pool {self.ratio}: {self.layout.name} ({g.row_bytes} B rows, layers {list(g.layer_ids)})"


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
    return pool_geometry(pool, C4, indexer, kv_args)


def pool_geometry(pool: Any, ratio: int, indexer: Any, kv_args: Any = None) -> IndexKGeometry:
    """The geometry of `pool`'s indexer pool of compression `ratio`; IndexKError when unusable."""
    name = "C4" if ratio == C4 else f"ratio-{ratio}"
    if getattr(indexer, "index_k_with_scale_buffer", None) is None:
        raise IndexKError(f"the {name} indexer keeps payload and scales in separate buffers (HIP fp4); not supported")
    reason = row_layout_refusal(indexer)
    if reason:
        raise IndexKError(reason)
    buffers = tuple(page_rows_as_bytes(buf, i) for i, buf in enumerate(indexer_row_buffers(indexer)))
    layer_ids = pool_layer_ids(pool, ratio)
    start = getattr(pool, "_stage_start", 0)
    end = getattr(pool, "_stage_end", len(list(pool.compression_ratios)))
    if len(layer_ids) != len(buffers):
        what = "C4 layers" if ratio == C4 else f"ratio-{ratio} kv_source layers"
        raise IndexKError(f"{len(buffers)} index-K buffers for {len(layer_ids)} {what} in [{start}, {end})")
    if not buffers:
        raise IndexKError("no index-K buffers")
    page_size = int(pool.page_size)
    slots = int(indexer.page_size)
    if ratio == C4:
        if slots <= 0 or page_size % slots:
            raise IndexKError(f"index page of {slots} slots does not tile a {page_size}-token page")
        row_tokens, rows_per_page = page_size, 1
    else:  # a low-ratio row is one index page of `slots` slots of `ratio` tokens each
        row_tokens = slots * int(ratio)
        if slots <= 0 or page_size % row_tokens:
            raise IndexKError(f"ratio-{ratio} index pages of {slots} slots do not tile a {page_size}-token page")
        rows_per_page = page_size // row_tokens
    return IndexKGeometry(
        buffers=buffers,
        layer_ids=layer_ids,
        wire=wire_positions(buffers, kv_args, rows_per_page) if kv_args is not None else None,
        page_size=row_tokens,
        slots=slots,
        row_bytes=int(buffers[0].shape[1]),
        fp4=bool(getattr(indexer, "use_fp4_indexer", False)),
        ratio=int(ratio),
        rows_per_page=rows_per_page,
    )


def pool_layer_ids(pool: Any, ratio: int) -> tuple[int, ...]:
    """Global layer ids of the index pool of `ratio` in this PP stage, in buffer order: the
    stage's layers of that ratio (4, 128), or its kv_source layers (1, 2: ``sources_by_ratio``)."""
    ratios = list(pool.compression_ratios)
    start = getattr(pool, "_stage_start", 0)
    end = getattr(pool, "_stage_end", len(ratios))
    if ratio in (1, 2):
        sources = (getattr(pool, "sources_by_ratio", None) or {}).get(ratio, [])
        return tuple(int(layer) for layer in sources if start <= layer < end)
    return tuple(layer for layer in range(start, end) if ratios[layer] == ratio)


def index_pools(pool: Any, layouts: Mapping[str, Any], kv_args: Any = None, wanted: str = "auto") -> list[IndexPool]:
    """Every index pool of a DeepSeek-V4 pool, C4 first, then by ratio: each with its
    geometry and row layout, or the reason it cannot be read.

    `wanted` (the probe config's ``layout``) names the C4 pool's layout; the other
    pools take the one layout that fits (``auto``). A pool whose buffers are not
    among `kv_args`'s transfer entries keeps its geometry without wire positions
    (digested anyway: a missing index-K transfer is a finding). Used by the PD sides
    and by the HiCache paths (which digest host copies per pool)."""
    found = dict(getattr(pool, "index_pools", None) or {})
    if not found and getattr(pool, "c4_indexer_kv_pool", None) is not None:
        found = {C4: pool.c4_indexer_kv_pool}
    out = []
    for ratio in sorted(found, key=lambda r: (r != C4, r)):
        indexer = found[ratio]
        if indexer is None:
            continue
        size = pool_bytes_per_page(pool, ratio, indexer)
        try:
            try:
                geometry = pool_geometry(pool, ratio, indexer, kv_args)
            except IndexKError:
                if kv_args is None:
                    raise
                geometry = pool_geometry(pool, ratio, indexer)  # no wire: digested anyway
            layout = choose_layout(geometry, wanted if ratio == C4 else "auto", layouts)
        except IndexKError as exc:
            out.append(IndexPool(ratio, None, None, str(exc), exc.code, size))
            continue
        except Exception as exc:  # an indexer of another shape: not readable, with the reason
            out.append(IndexPool(ratio, None, None, f"{type(exc).__name__}: {exc}", "layout_unknown", size))
            continue
        out.append(IndexPool(ratio, geometry, layout, "", "", size))
    return out


def pool_bytes_per_page(pool: Any, ratio: int, indexer: Any) -> int:
    """Index-K bytes one full page holds in this indexer pool (every layer), whatever its
    layout: what the transfer moves per page, counted when the probe cannot read it."""
    try:
        rows = [buf[0].numel() * buf.element_size() for buf in indexer_row_buffers(indexer)] if getattr(
            indexer, "index_k_with_scale_buffer", None) is not None else [
            buf[0].numel() * buf.element_size() for buf in indexer.contiguous_page_row_buffers()]
        per_row = sum(int(n) for n in rows)
        if ratio == C4:
            return per_row
        slots = int(indexer.page_size)
        return per_row * max(1, int(pool.page_size) // (slots * int(ratio)))
    except Exception:
        return 0


def room_pool_pages(pages: Any, rows_per_page: int) -> Any:
    """A room's full pages as the index pages of a pool with `rows_per_page` rows per
    page (full page p: rows p*k .. p*k+k-1, in order), computed on the pages' device
    with no host sync; the pages themselves when k is 1."""
    k = int(rows_per_page)
    if k == 1:
        return pages
    if hasattr(pages, "unsqueeze"):
        import torch

        offsets = torch.arange(k, device=pages.device, dtype=pages.dtype)
        return (pages.unsqueeze(-1) * k + offsets).reshape(-1)
    return [int(p) * k + j for p in pages for j in range(k)]


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

    if getattr(indexer, "has_npu_storage", False):
        # NPUDeepSeekV4IndexerPool: the packed rows stay allocated (the transfer registers
        # them) but the model writes its own PA_ND int8/fp8 + scale buffers: the rows the
        # probe would read hold zeros on both sides, a match that verifies nothing
        return ("the NPU indexer keeps index-K in its own PA_ND buffers (index_k_buffer, index_scale_buffer); "
                "the packed rows stay unwritten and no layout describes the NPU ones: not supported")
    if getattr(sys.modules.get(PRESHUFFLE_MODULE), "_use_aiter_preshuffle", False):
        return ("fp8 index-K is stored preshuffled in 16-slot tiles (ROCm, aiter_can_use_preshuffle_paged_mqa); "
                "no layout describes it: not supported")
    if getattr(indexer, "index_k_page8", False):
        return "fp8 index-K uses aiter's row-group page-8 order (index_k_page8); no layout describes it: not supported"
    return None


def wire_positions(buffers: Sequence[Any], kv_args: Any, rows_per_item: int = 1) -> tuple[int, ...]:
    """Position of each buffer among the transferred KV entries, matched by data_ptr
    (each item is `rows_per_item` rows: a full page of a low-ratio pool)."""
    ptrs = [int(p) for p in kv_args.kv_data_ptrs]
    lens = [int(n) for n in kv_args.kv_item_lens]
    positions = []
    for buf in buffers:
        try:
            w = ptrs.index(buf.data_ptr())
        except ValueError:
            raise IndexKError("an index-K buffer is not among the PD transfer buffers (kv_data_ptrs)") from None
        row = buf[0].numel() * buf.element_size() * int(rows_per_item)
        if lens[w] != row:
            what = "one index-K row" if rows_per_item == 1 else f"{rows_per_item} index-K rows"
            raise IndexKError(f"transfer item length {lens[w]} B at wire entry {w} is not {what} ({row} B)")
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
    """A room's pages as a table the digest engine reads: `stride` entries per page, page k
    being entry k * stride over the stride (`DigestEngine(page_id_stride=stride)`)."""

    pages: Any  # device tensor: page ids (stride 1), or the room's token indices (stride = page size)
    n_tokens: int  # transferred tokens, from the start of logical page 0
    start: int  # first transferred token (page-aligned decode prefix)
    stride: int = 1  # entries of `pages` per page

    def page_ids(self) -> Any:
        """The table as page ids (stride 1): one strided view and one division on the
        table's device where it holds token indices, no read-back."""
        return page_ids_of(self.pages, self.stride)


def page_ids_of(tokens: Any, page_size: int) -> Any:
    """Page ids of a token-index table, as the pool addresses its pages: each page's first
    token index over the page size (a tensor, a NumPy array or a list); a table of page size
    1 is its own page ids, returned as it is."""
    if page_size == 1:
        return tokens
    if isinstance(tokens, list):
        return [int(t) // page_size for t in tokens[::page_size]]
    return tokens[::page_size] // page_size


def prefill_room_pages(scheduler: Any, req: Any, end_idx: int | None) -> RoomPages | str:
    """The pages a last-chunk send covers, or a reason string when it cannot be digested:
    the room's token indices as SGLang's request table holds them (a view, no device op of
    ours), page size entries per page; the prefill engine reads each page's first itself."""
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
    return RoomPages(tokens, end - start, start, page_size)


def decode_room_pages(kv_indices: Any, page_size: int, metadata_kwargs: Mapping[str, Any],
                      room_end: int | None = None, device_page_size: int | None = None) -> RoomPages | str:
    """The destination pages decode publishes in `_send_kv_metadata`.

    With HiSparse (`device_kv_indices` given) `kv_indices` are the host rows of the C4 KV,
    a quarter of the room's tokens, and index-K goes to the device pages named beside them,
    one per logical page of ``[decode prefix, room_end)``: the room's length is `room_end`
    (where the pages it published end), never `len(kv_indices)`."""
    start = int(metadata_kwargs.get("decode_prefix_len", 0) or 0)
    device_pages = metadata_kwargs.get("device_kv_indices")
    if device_pages is not None:
        return _hisparse_room_pages(device_pages, start, room_end, device_page_size)
    n_tokens = len(kv_indices)
    if n_tokens <= 0:
        return "nothing to receive"
    return RoomPages(page_ids_of(kv_indices, page_size), n_tokens, start)


def _hisparse_room_pages(device_pages: Any, start: int, room_end: int | None,
                         device_page_size: int | None) -> RoomPages | str:
    """HiSparse's index-K destination, or why it cannot be digested: its device pages must
    be exactly those of the room's tokens past the decode prefix (else the pages and the
    length would name different bytes: skipped, with this reason, never judged)."""
    if room_end is None or not device_page_size:
        return "HiSparse room length not readable"
    n_tokens = room_end - start
    if n_tokens <= 0:
        return "nothing to receive"
    if len(device_pages) != -(-n_tokens // device_page_size):
        return f"HiSparse device pages ({len(device_pages)}) do not cover the room's {n_tokens} tokens"
    return RoomPages(device_pages, n_tokens, start)
