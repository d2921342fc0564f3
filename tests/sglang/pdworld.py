"""One prefill and one decode scheduler's worth of REAL SGLang objects on CPU.

Real: ``DeepSeekV4TokenToKVPool`` (with its ``DeepSeekV4IndexerPool``),
``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool``, ``MetadataBuffers``, and
the transfer's buffer list from ``get_contiguous_buf_infos``. Stand-ins
(SimpleNamespace): the scheduler, the PD queues, KV manager and requests,
which only carry the attributes the hooks and SGLang's own methods read, shaped
for the release under test (the release matrix puts 0.5.18-0.5.22 first on
sys.path; tests/sglang_releases/).

A room: the decode side already holds one page (the decode prefix), prefill
sends the rest: two full pages and a partial tail page of 100 tokens (25
frozen C4 slots). Prefill and decode hold it in different physical pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dsv4_idxk_probe.sglang.index_k import indexer_row_buffers
from dsv4_idxk_probe.sglang.targets import installed_sglang, release_tuple

#: The SGLang release under test (the matrix puts each release first on sys.path).
RELEASE = release_tuple(installed_sglang() or "0.5.23")
#: 0.5.18 keeps req_pool_idx / cache_protected_len on the Req itself; 0.5.19+ on req.kv.
REQ_KV_NAMESPACE = RELEASE >= (0, 5, 19)
#: `req.extend_end` (0.5.22+); before, `req.extend_range.end`.
HAS_EXTEND_END = RELEASE >= (0, 5, 22)
#: `_send_kv_metadata` (0.5.21+); before, `pop_preallocated` publishes the pages inline.
HAS_SEND_KV_METADATA = RELEASE >= (0, 5, 21)
#: `_verify_kv_checksums` (0.5.21+), where enforce drops a room; before, enforce observes only.
HAS_VERIFY_KV_CHECKSUMS = RELEASE >= (0, 5, 21)


def c4_indexer(pool):
    """The C4 indexer pool: ``index_pools[4]`` (0.5.20+), ``c4_indexer_kv_pool`` before."""
    return (getattr(pool, "index_pools", None) or {}).get(4) or pool.c4_indexer_kv_pool


def extend_fields(end: int) -> dict:
    return {"extend_end": end} if HAS_EXTEND_END else {"extend_range": SimpleNamespace(start=0, end=end)}


def req_kv(**fields) -> dict:
    """The Req's KV bookkeeping fields, shaped as the release under test keeps them."""
    return {"kv": SimpleNamespace(**fields)} if REQ_KV_NAMESPACE else dict(fields)

PAGE = 256
PREFIX_TOKENS = PAGE
ROOM_TOKENS = 2 * PAGE + 100  # transferred tokens: 3 pages, the last one partial
PREFILL_PAGES = [7, 2, 5, 4]  # prefix page first (0.5.18-0.5.21 size the C4 indexer with 9 pages)
DECODE_PAGES = [3, 8, 1, 6]
COMPRESSION_RATIOS = [0, 4, 128, 4, 128, 4]  # C4 layers: 1, 3, 5
C4_LAYERS = [1, 3, 5]


def make_pool(seed: int):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    pool = DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=1024, c4_size=512, c128_size=16, c4_state_pool_size=64,
        c128_state_pool_size=64, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
        qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(COMPRESSION_RATIOS), device="cpu",
        enable_memory_saver=False, compression_ratios=COMPRESSION_RATIOS,
    )
    g = torch.Generator().manual_seed(seed)
    for buf in indexer_row_buffers(c4_indexer(pool)):
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    allocator = PagedTokenToKVPoolAllocator(
        size=8 * PAGE, page_size=PAGE, dtype=torch.float8_e4m3fn, device="cpu", kvcache=pool, need_sort=False
    )
    return pool, allocator


def kv_args_of(pool) -> SimpleNamespace:
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    # No state buffers: SGLang's send path then sends no state indices.
    return SimpleNamespace(kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=items, state_types=[])


def token_locs(pages: list[int], n_tokens: int) -> torch.Tensor:
    locs = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int32) for p in pages])
    return locs[:n_tokens]


@dataclass
class Side:
    pool: object
    allocator: object
    req_to_token_pool: object
    metadata: object
    scheduler: SimpleNamespace
    kv_args: SimpleNamespace

    @property
    def index_k(self) -> list[torch.Tensor]:
        return indexer_row_buffers(c4_indexer(self.pool))


def make_side(seed: int, pages: list[int]) -> Side:
    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool, allocator = make_pool(seed)
    r2t = ReqToTokenPool(size=4, max_context_len=4 * PAGE, device="cpu", enable_memory_saver=False)
    r2t.req_to_token[1, : PREFIX_TOKENS + ROOM_TOKENS] = token_locs(pages, PREFIX_TOKENS + ROOM_TOKENS)
    metadata = MetadataBuffers(size=4, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)
    kv_args = kv_args_of(pool)
    manager = SimpleNamespace(kv_args=kv_args, local_ip="127.0.0.1")
    scheduler = standin(
        scheduler_class(),
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=r2t,
        disagg_metadata_buffers=metadata,
        kv_checksum_computer=None,
        enable_staging=False,  # read by SGLang's real send path
        disagg_prefill_pending_chunk_rids=set(),
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=manager, gpu_id=0, token_to_kv_pool=pool),
        disagg_decode_prealloc_queue=SimpleNamespace(kv_manager=manager, token_to_kv_pool=pool),
    )
    return Side(pool, allocator, r2t, metadata, scheduler, kv_args)


def transfer_index_k(prefill: Side, decode: Side) -> None:
    """What the KV transfer does to index-K: row (layer, P[i]) -> (layer, D[i])."""
    for src, dst in zip(prefill.index_k, decode.index_k):
        dst[DECODE_PAGES[1:]] = src[PREFILL_PAGES[1:]]


def prefill_req(room: int, metadata_index: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        rid=f"req-{room}", bootstrap_room=room, bootstrap_host="10.0.0.1", disagg_decode_prefix_len=PREFIX_TOKENS,
        **extend_fields(PREFIX_TOKENS + ROOM_TOKENS), origin_input_ids=list(range(PREFIX_TOKENS + ROOM_TOKENS)),
        start_send_idx=PREFIX_TOKENS, multimodal_inputs=None,
        **req_kv(req_pool_idx=1), metadata_buffer_index=metadata_index, finished_reason=None,
        pending_bootstrap=False, prefill_attempt_count=0, output_ids=[42], cached_tokens=0,
        cached_tokens_device=0, cached_tokens_host=0, cached_tokens_storage=0, return_logprob=False,
        return_sampling_mask=False, hidden_states_tensor=None, get_mm_token_counts=lambda: (0, 0, 0),
        disagg_kv_sender=SimpleNamespace(curr_idx=0, num_kv_indices=3, conclude_state=None),
    )


class DecodeReq(SimpleNamespace):
    def finished(self) -> bool:
        return self.finished_reason is not None


def decode_req(room: int, metadata_index: int = 1, peer: str = "127.0.0.1") -> SimpleNamespace:
    req = DecodeReq(
        rid=f"req-{room}", bootstrap_room=room, bootstrap_host="10.0.0.1", origin_input_ids=list(range(PREFIX_TOKENS + ROOM_TOKENS)),
        **req_kv(req_pool_idx=1, cache_protected_len=PREFIX_TOKENS), finished_reason=None, output_ids=[],
        return_logprob=False, return_sampling_mask=False, time_stats=SimpleNamespace(set_wait_queue_entry_time=lambda: None),
    )
    receiver = SimpleNamespace(
        bootstrap_infos=[{"rank_ip": peer, "rank_port": 1, "is_dummy": False}], clear=lambda: None
    )
    return SimpleNamespace(req=req, kv_receiver=receiver, metadata_buffer_index=metadata_index, is_rebootstrap=False)


def aux_transfer(prefill: Side, decode: Side, prefill_index: int, decode_index: int) -> None:
    """What the last chunk's aux send does to the metadata row (bootstrap_room included)."""
    decode.metadata.bootstrap_room[decode_index].copy_(prefill.metadata.bootstrap_room[prefill_index])
    decode.metadata.output_ids[decode_index].copy_(prefill.metadata.output_ids[prefill_index])


def standin(cls, **attributes):
    """An instance of SGLang's `cls` made without its __init__, holding only `attributes`:
    methods are SGLang's own (and the probe's wrappers on them), state is the test's.
    A class with abstract methods (CommonKVSender before 0.5.23) is instantiated
    through a subclass that only lifts the abstract check: its methods stay SGLang's."""
    if getattr(cls, "__abstractmethods__", None):
        cls = type(cls.__name__, (cls,), {})
        cls.__abstractmethods__ = frozenset()
    obj = object.__new__(cls)
    obj.__dict__.update(attributes)
    return obj


def scheduler_class():
    """A Scheduler stand-in class: SGLang's real PD mixins, nothing else."""
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    return type("StandInScheduler", (SchedulerDisaggregationPrefillMixin, SchedulerDisaggregationDecodeMixin), {})


def prealloc_queue(decode: Side):
    """A DecodePreallocQueue for SGLang's real `_send_kv_metadata`."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    index = iter(range(1, 100))
    return standin(
        DecodePreallocQueue,
        scheduler=decode.scheduler,
        req_to_token_pool=decode.req_to_token_pool,
        token_to_kv_pool_allocator=decode.allocator,
        req_to_metadata_buffer_idx_allocator=SimpleNamespace(alloc=lambda: next(index)),
        transfer_queue=SimpleNamespace(enable_staging=False),
        _num_published_destinations=0,
    )


def publish_pages(runtime, decode: Side, dreq, kv_indices, page_size: int = PAGE, **metadata_kwargs) -> None:
    """Decode publishes the room's pages to prefill: SGLang's real `_send_kv_metadata`
    (0.5.21+), or before 0.5.21 what `pop_preallocated` leaves for the probe (the
    metadata row index; the pages in req_to_token) with the probe's hook on it
    run around a stand-in pop (the real one needs a whole scheduler)."""
    from dsv4_idxk_probe.sglang import pd_decode

    queue = prealloc_queue(decode)
    if HAS_SEND_KV_METADATA:
        queue._send_kv_metadata(dreq, kv_indices, page_size, None, **metadata_kwargs)
        return
    dreq.metadata_buffer_index = queue.req_to_metadata_buffer_idx_allocator.alloc()
    pd_decode.make_preallocated_wrapper(runtime)(lambda *a, **k: ([dreq], []), queue, (), {})


def transfer_queue(decode: Side):
    """A DecodeTransferQueue with what `_commit_transfer_to_req` reads."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    return standin(
        DecodeTransferQueue,
        scheduler=SimpleNamespace(
            kv_checksum_computer=None,
            server_args=SimpleNamespace(disaggregation_transfer_backend="nixl"),  # read by 0.5.18-0.5.20
            batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None),
            disagg_decode_prealloc_queue=decode.scheduler.disagg_decode_prealloc_queue,
        ),
        metadata_buffers=decode.metadata,
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
        _commit_hicache_local_restore_to_req=lambda decode_req: None,
    )
