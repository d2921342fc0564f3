"""A room rebootstrapped after a retraction (0.5.18-0.5.20: `pop_preallocated`
publishes its pages): decode receives prompt + outputs, as prefill sends them,
and the probe measures the room the same way on both sides.

Runs on 0.5.23 in the parent run and on every older release through
tests/sglang_releases/test_rebootstrap_releases.py; from 0.5.21 on the pages come
through `_send_kv_metadata`, which names them itself.
"""

from __future__ import annotations

import pdworld
import pytest
import test_pd_hooks as hooks

OUTPUTS = 40  # tokens decode emitted before the retraction


@pytest.fixture
def patched(probe):
    yield from hooks._patched(probe)


def _rebootstrapped_decode_req(room: int):
    dreq = hooks._with_receiver(pdworld.decode_req(room, hooks.DECODE_ROW))
    prompt = pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS - OUTPUTS
    dreq.req.origin_input_ids = list(range(prompt))
    dreq.req.output_ids = list(range(OUTPUTS))
    dreq.req.pd_rebootstrap_in_progress = True  # what SGLang sets on a retracted room it sends again
    return dreq


def test_the_published_length_of_a_rebootstrapped_room_is_prompt_plus_outputs(worlds, patched):
    from dsv4_idxk_probe.sglang import pd_decode

    runtime, _, _ = patched
    _, decode = worlds
    queue = pdworld.prealloc_queue(decode)
    dreq = _rebootstrapped_decode_req(hooks.ROOM)
    assert pd_decode.published_len(queue, dreq.req) == pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS
    dreq.req.pd_rebootstrap_in_progress = False  # an ordinary room: the prompt
    assert pd_decode.published_len(queue, dreq.req) == pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS - OUTPUTS


def test_a_rebootstrapped_room_is_compared_not_left_not_comparable(worlds, patched):
    runtime, sink, _ = patched
    prefill, decode = worlds
    hooks.send_room(prefill)  # prefill sends prompt + outputs: PREFIX + ROOM tokens
    pdworld.transfer_index_k(prefill, decode)
    dreq = _rebootstrapped_decode_req(hooks.ROOM)
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    pdworld.aux_transfer(prefill, decode, hooks.PREFILL_ROW, hooks.DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert (record["verdict"], record["reason"]) == ("match", "")
    assert record["digest"]["n_tokens"] == pdworld.ROOM_TOKENS
