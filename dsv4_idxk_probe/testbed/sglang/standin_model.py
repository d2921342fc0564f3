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
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ...vocabulary import C4_RATIO as C4
from . import truth

#: Called with the ForwardBatch before each forward writes (the rig's decode-side faults).
BEFORE_FORWARD: list = []


class StandInDeepseekV4(nn.Module):
    def __init__(self, config, quant_config=None, **_kwargs):
        super().__init__()
        self.config = config
        self.vocab_size = int(config.vocab_size)
        ratios = list(getattr(config, "compress_ratios", []) or [])
        self.start_layer = 0
        self.end_layer = int(config.num_hidden_layers)
        self.c4_layers = [layer for layer, ratio in enumerate(ratios) if ratio == C4]
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)  # a model with no parameter confuses loaders

    def load_weights(self, weights):
        for _ in weights:
            pass

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, **_kwargs):
        ids = input_ids.detach().cpu().numpy().astype(np.int64)
        pos = positions.detach().cpu().numpy().astype(np.int64)
        for hook in BEFORE_FORWARD:
            hook(forward_batch)
        self.store_index_k(forward_batch, ids, pos)
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
