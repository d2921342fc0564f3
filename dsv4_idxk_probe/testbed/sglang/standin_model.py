"""The one stand-in of the SGLang rig: a weightless DeepSeek-V4 whose forward
writes index-K through the pool's own store and picks a fixed next token.

SGLang's real ``DeepseekV4ForCausalLM`` cannot run here (no GPU kernels on
CPU, and no weights). This module keeps what the scheduler, the pools and
the transfer see of a model: per forward, for every token completing a C4
slot (position % 4 == 3), every C4 layer's slot is stored with
``token_to_kv_pool.set_index_k_scale_buffer(layer, loc // 4, index_k,
index_k_scale)`` (fp8 payload, float32 scale), the call the real indexer
makes; the bytes are `truth.slot_bytes`. Logits put all mass on
`truth.next_token` of each sequence's last token, so greedy decoding is
deterministic and never ends early.

A DeepSeek-V4.1-shaped config (``launch.MODEL_CONFIG_V41``) also has ratio-1 and
ratio-2 kv_source layers: for each, every token completing a slot of its ratio
(position % ratio == ratio - 1) gets a 68-byte fp4 slot (the first 64 bytes of
`truth.slot_bytes` and its scale) written straight into the pool's
``index_pools[ratio]`` page rows, at the places SGLang's fp4 store uses (payload
at 64 * slot, scale at 64 * page_slots + 4 * slot, in index page slot //
page_slots; SGLang's fp4 store kernel does not run on CPU). With
`ENV_POOL_FAULT` set to a ratio, decode flips one payload byte of that pool
(layer 0, the first slot of the first room it decodes), once per process: the
fault a V4.1 rig test expects the probe to find in that pool.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from ...vocabulary import C4_RATIO as C4
from . import truth

#: Called with the ForwardBatch before each forward writes (the rig's decode-side faults).
BEFORE_FORWARD: list = []
#: Decode flips one byte of this low-ratio index pool (a ratio: "1" or "2") once; unset: never.
ENV_POOL_FAULT = "DSV4_IDXK_RIG_POOL_FAULT"
FP4_PAYLOAD = 64
FP4_SCALE = 4
_pool_fault_done = False


def pipeline_stage(n_layers: int) -> tuple[int, int, bool]:
    """(first layer, end layer, last stage?) of this process's pipeline stage (all layers without PP)."""
    try:
        from sglang.srt.distributed import get_pp_indices
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().pp_group
        size, rank = int(group.world_size), int(group.rank_in_group)
    except Exception:  # no parallel state (a unit test builds the model alone)
        return 0, n_layers, True
    if size == 1:
        return 0, n_layers, True
    start, end = get_pp_indices(n_layers, rank, size)
    return int(start), int(end), rank == size - 1


class StandInDeepseekV4(nn.Module):
    def __init__(self, config, quant_config=None, **_kwargs):
        super().__init__()
        self.config = config
        self.vocab_size = int(config.vocab_size)
        ratios = list(getattr(config, "compress_ratios", []) or [])
        self.start_layer, self.end_layer, self.last_stage = pipeline_stage(int(config.num_hidden_layers))
        # a pipeline stage holds (and stores index-K of) its own layers only, as the real model
        self.c4_layers = [layer for layer, ratio in enumerate(ratios)
                          if ratio == C4 and self.start_layer <= layer < self.end_layer]
        self.hidden_size = int(config.hidden_size)
        sources = [int(layer) for layer in (getattr(config, "kv_source_layer_ids", None) or ())]
        # V4.1: (layer, ratio) of each kv_source layer of ratio 1 or 2 in this stage (it owns its index-K rows)
        self.low_ratio_sources = [(layer, ratios[layer]) for layer in sources
                                  if self.start_layer <= layer < min(self.end_layer, len(ratios))
                                  and ratios[layer] in (1, 2)]
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)  # a model with no parameter confuses loaders

    def load_weights(self, weights):
        for _ in weights:
            pass

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, **_kwargs):
        # `pp_proxy_tensors` in the signature is how SGLang tells a model that can run in pipeline stages
        ids = input_ids.detach().cpu().numpy().astype(np.int64)
        pos = positions.detach().cpu().numpy().astype(np.int64)
        for hook in BEFORE_FORWARD:
            hook(forward_batch)
        self.store_index_k(forward_batch, ids, pos)
        if self.low_ratio_sources:
            self.store_low_ratio_index_k(forward_batch, ids, pos)
            if not _pool_fault_done and os.environ.get(ENV_POOL_FAULT) and forward_batch.forward_mode.is_decode():
                self.flip_pool_byte(forward_batch, int(os.environ[ENV_POOL_FAULT]))
        if not self.last_stage:  # what the real model hands the next stage: the hidden states
            from sglang.srt.model_executor.forward_batch_info import PPProxyTensors

            return PPProxyTensors({"hidden_states": torch.zeros((len(ids), self.hidden_size), dtype=torch.bfloat16)})
        return self.logits(forward_batch, ids)

    def store_index_k(self, forward_batch, ids: np.ndarray, pos: np.ndarray) -> None:
        completing = np.nonzero(pos % truth.TOKENS_PER_SLOT == truth.TOKENS_PER_SLOT - 1)[0]
        if completing.size == 0 or not self.c4_layers:
            return
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        pool = get_token_to_kv_pool()
        locs = forward_batch.out_cache_loc.detach().cpu()[torch.from_numpy(completing)]
        slot_locs = (locs.to(torch.int64) // truth.TOKENS_PER_SLOT).contiguous()
        for layer in self.c4_layers:
            rows = truth.slot_bytes(layer, pos[completing], ids[completing])
            index_k = torch.from_numpy(np.ascontiguousarray(rows[:, : truth.PAYLOAD])).view(torch.float8_e4m3fn)
            scale = torch.from_numpy(np.ascontiguousarray(rows[:, truth.PAYLOAD :])).view(torch.float32)
            pool.set_index_k_scale_buffer(layer, slot_locs, index_k, scale.reshape(-1, 1))

    def store_low_ratio_index_k(self, forward_batch, ids: np.ndarray, pos: np.ndarray) -> None:
        """Each V4.1 kv_source layer's fp4 slots, at the bytes SGLang's fp4 store writes."""
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        pool = get_token_to_kv_pool()
        locs_all = forward_batch.out_cache_loc.detach().cpu().to(torch.int64)
        for layer, ratio in self.low_ratio_sources:
            completing = np.nonzero(pos % ratio == ratio - 1)[0]
            if completing.size == 0:
                continue
            indexer = pool.index_pools[ratio]
            buf = indexer.index_k_with_scale_buffer[pool.sources_by_ratio[ratio].index(layer)]
            page_slots = int(indexer.page_size)
            slots = locs_all[torch.from_numpy(completing)] // ratio
            page, off = slots // page_slots, slots % page_slots
            rows = truth.slot_bytes(layer, pos[completing], ids[completing])
            payload = torch.from_numpy(np.ascontiguousarray(rows[:, :FP4_PAYLOAD]))
            scale = torch.from_numpy(np.ascontiguousarray(rows[:, truth.PAYLOAD : truth.PAYLOAD + FP4_SCALE]))
            cols = off.unsqueeze(-1) * FP4_PAYLOAD + torch.arange(FP4_PAYLOAD)
            buf[page.unsqueeze(-1), cols] = payload
            cols = page_slots * FP4_PAYLOAD + off.unsqueeze(-1) * FP4_SCALE + torch.arange(FP4_SCALE)
            buf[page.unsqueeze(-1), cols] = scale

    def flip_pool_byte(self, forward_batch, ratio: int) -> None:
        """Decode only: one payload byte of the first room's first slot in the pool of `ratio`."""
        global _pool_fault_done
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        from .env import ENV_ROLE

        if os.environ.get(ENV_ROLE) != "decode" or ratio not in {r for _, r in self.low_ratio_sources}:
            return
        from .rooms import Rooms

        rooms = Rooms.live  # a room of the test's plan (not a health check nor a warm-up request)
        planned = [int(i) for i in forward_batch.req_pool_indices.tolist()
                   if rooms is not None and getattr(rooms.by_pool_idx.get(int(i)), "rig_room", None) is not None]
        if not planned:
            return
        _pool_fault_done = True
        pool = get_token_to_kv_pool()
        req_pool_idx = planned[0]
        loc0 = int(get_req_to_token_pool().req_to_token[req_pool_idx, 0])
        indexer = pool.index_pools[ratio]
        slot = loc0 // ratio
        page_slots = int(indexer.page_size)
        indexer.index_k_with_scale_buffer[0][slot // page_slots, (slot % page_slots) * FP4_PAYLOAD + 5] ^= 0x20
        print(f"dsv4-idxk-probe rig: flipped a byte of index pool {ratio}, row {slot // page_slots}, "
              f"slot {slot % page_slots}", flush=True)

    def logits(self, forward_batch, ids: np.ndarray):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        mode = forward_batch.forward_mode
        if mode.is_idle() or ids.size == 0:
            last = np.zeros(0, dtype=np.int64)
        elif mode.is_extend():
            lens = forward_batch.extend_seq_lens_cpu
            lens = list(lens) if lens is not None else forward_batch.extend_seq_lens.cpu().tolist()
            last = ids[np.cumsum(lens) - 1]
        else:
            last = ids
        logits = torch.full((len(last), self.vocab_size), -1e4, dtype=torch.float32)
        chosen = [truth.next_token(int(t), self.vocab_size) for t in last]
        if chosen:
            logits[torch.arange(len(chosen)), torch.tensor(chosen)] = 1e4
        return LogitsProcessorOutput(next_token_logits=logits)
