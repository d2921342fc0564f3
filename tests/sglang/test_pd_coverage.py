"""Coverage accounting through the real decode hooks on SGLang's real pools and metadata rows
(tests/sglang/pdworld.py): a clean room reads all its bytes verified once it finishes, and a
host-received room is counted skipped with reason host_dest and its bytes (docs/coverage.md)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pdworld
from pd_testkit import collected
import test_pd_hooks as hooks
from test_pd_hooks import patched  # noqa: F401  (the fixture: the pd.* targets patched on SGLang's classes)

from dsv4_idxk_probe.pd.coverage import estimated_bytes
from dsv4_idxk_probe.sglang import pd_decode

COVERAGE = "dsv4_idxk_probe_coverage_bytes_total"


def _settled(runtime) -> None:
    collected(runtime.sides["decode"].monitor.engine, timeout_s=10)


def _coverage(registry) -> dict[tuple[str, str], float]:
    return {(s.labels["outcome"], s.labels["reason"]): s.value for f in registry.collect() for s in f.samples
            if s.name == COVERAGE and s.labels["path"] == "pd" and s.value}


def test_a_clean_room_reads_all_its_bytes_verified_once_it_finishes(worlds, patched):  # noqa: F811
    runtime, sink, registry = patched
    dreq = hooks._decode_flow(worlds, patched)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "match"
    _settled(runtime)
    assert _coverage(registry) == {}  # counted when the room ends
    dreq.req.finished_reason = "FINISH_LENGTH"
    pd_decode.make_prebuilt_result_wrapper(runtime)(lambda *a, **k: None, None, (SimpleNamespace(reqs=[dreq.req]),), {})
    assert sink.wait_for(1, stage="decode_finish")[0]["verdict"] == "match"
    _settled(runtime)
    received = sum(s.value for f in registry.collect() for s in f.samples
                   if s.name == "dsv4_idxk_probe_digest_bytes_total" and s.labels["stage"] == "decode_recv")
    assert received > 0
    assert _coverage(registry) == {("verified", "none"): received}


def _host_received(prefill, decode):
    """A room sent by prefill whose decode published host pages (destination=HOST) for it."""
    hooks.send_room(prefill)
    dreq = hooks._with_receiver(pdworld.decode_req(hooks.ROOM, hooks.DECODE_ROW))
    host_indices = torch.arange(40 * pdworld.PAGE, 40 * pdworld.PAGE + pdworld.ROOM_TOKENS, dtype=torch.int64)
    host = SimpleNamespace(name="HOST", value="host")  # KVTransferDestination.HOST
    pdworld.prealloc_queue(decode)._send_kv_metadata(dreq, host_indices, pdworld.PAGE, None, decode_prefix_len=0,
                                                     destination=host)
    return dreq


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA,
                    reason="host-receive (destination=HOST) arrives with _send_kv_metadata in SGLang 0.5.21")
def test_a_host_received_room_is_counted_skipped_host_dest_with_its_bytes(worlds, patched):  # noqa: F811
    prefill, decode = worlds
    runtime, sink, registry = patched
    dreq = _host_received(prefill, decode)
    pdworld.aux_transfer(prefill, decode, hooks.PREFILL_ROW, hooks.DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "skipped"
    _settled(runtime)
    engine = runtime.sides["decode"].monitor.engine
    frozen_slots = pdworld.ROOM_TOKENS // 4  # C4: one key per 4 tokens; fp8 rows: 128 B payload + 4 B scale per key
    assert _coverage(registry) == {("skipped", "host_dest"): frozen_slots * len(engine.layer_ids) * (128 + 4)}


def _raises(*_a, **_k):
    raise RuntimeError("a probe defect")


@pytest.mark.parametrize("failing", ["before_commit", "prefill_endpoint"])
def test_a_room_whose_commit_hook_fails_is_counted_skipped_probe_error_with_its_bytes(worlds, patched, monkeypatch,
                                                                                       failing):  # noqa: F811
    """The probe's own read of the metadata row (`before_commit`), or its receipt before the
    monitor took the room (`after_commit`, here where it works out prefill's endpoint), raises:
    SGLang's commit goes on, and the room's bytes are counted, not left out of the coverage."""
    runtime, sink, registry = patched
    monkeypatch.setattr(pd_decode, failing, _raises)
    dreq = hooks._decode_flow(worlds, patched)
    assert dreq.req.output_ids == [42]  # SGLang's commit ran
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert record["verdict"] == "skipped" and record["reason"].startswith("probe error")
    _settled(runtime)
    engine = runtime.sides["decode"].monitor.engine
    frozen_slots = pdworld.ROOM_TOKENS // 4  # as in the host-receive test above
    assert _coverage(registry) == {("skipped", "probe_error"): frozen_slots * len(engine.layer_ids) * (128 + 4)}


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA,
                    reason="host-receive (destination=HOST) arrives with _send_kv_metadata in SGLang 0.5.21")
def test_a_host_received_room_aborted_before_its_commit_is_counted_skipped_aborted(worlds, patched):  # noqa: F811
    """SGLang releases a host-staged room whose request was aborted at `KVPoll.Success`
    without committing it (`_release_request`): its bytes moved all the same."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    prefill, decode = worlds
    runtime, sink, registry = patched
    dreq = _host_received(prefill, decode)
    dreq.host_staged = True  # as SGLang's host admission sets it
    dreq.req.finished_reason = FINISH_ABORT("client gone")
    if hasattr(dreq.req, "kv"):  # 0.5.23: what `discard_kv_cache_backup` reads
        dreq.req.kv.retraction_backup = None
    queue = pdworld.transfer_queue(decode)
    queue.__dict__.update(enable_host_receive=True, tree_cache=None)
    queue.scheduler.enable_hisparse = False
    queue._release_request(dreq)
    queue._release_request(dreq)  # released twice (a deferred release resolving): counted once
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert (record["verdict"], record["reason"]) == ("skipped", "aborted")
    _settled(runtime)
    engine = runtime.sides["decode"].monitor.engine
    frozen_slots = pdworld.ROOM_TOKENS // 4
    assert _coverage(registry) == {("skipped", "aborted"): frozen_slots * len(engine.layer_ids) * (128 + 4)}


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA, reason="`_release_request` arrives in SGLang 0.5.21")
def test_a_room_counted_at_its_commit_counts_nothing_more_when_the_queue_releases_it(worlds, patched):  # noqa: F811
    """The commit found the request aborted (its metadata row carries another room): counted
    there, `skipped`/`aborted`; the transfer queue's release of it right after adds nothing."""
    prefill, decode = worlds
    runtime, sink, registry = patched
    hooks.send_room(prefill)
    dreq = hooks._with_receiver(pdworld.decode_req(hooks.ROOM + 1, hooks.DECODE_ROW))
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    pdworld.aux_transfer(prefill, decode, hooks.PREFILL_ROW, hooks.DECODE_ROW)
    queue = pdworld.transfer_queue(decode)
    queue._commit_transfer_to_req(dreq)
    assert sink.wait_for(1, stage="decode_recv")[0]["reason"] == "aborted"
    _settled(runtime)
    counted = _coverage(registry)
    assert list(counted) == [("skipped", "aborted")]
    pd_decode.on_transfer_release(runtime, queue, dreq)  # what the wrapped `_release_request` runs first
    _settled(runtime)
    assert _coverage(registry) == counted


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA, reason="`_send_kv_metadata` arrives in SGLang 0.5.21")
def test_a_rebootstrapped_room_whose_transfer_fails_counts_the_tokens_it_published(worlds, patched):  # noqa: F811
    """A room rebootstrapped after a retraction publishes, and is sent, its prompt and its
    outputs (SGLang's `_rebootstrap_prefill_len`): a failed transfer counts those bytes
    `skipped`, not the prompt's alone."""
    prefill, decode = worlds
    runtime, sink, registry = patched
    outputs = 100
    dreq = hooks._with_receiver(pdworld.decode_req(hooks.ROOM, hooks.DECODE_ROW))
    dreq.req.output_ids = list(range(outputs))
    published = pdworld.ROOM_TOKENS + outputs
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + published]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    pd_decode.on_transfer_failed(runtime, pdworld.transfer_queue(decode), dreq)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "skipped"
    _settled(runtime)
    engine = runtime.sides["decode"].monitor.engine
    assert _coverage(registry) == {("skipped", "transfer_failed"): estimated_bytes(engine, published)}


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA, reason="decode HiCache's restore status arrives in SGLang 0.5.23")
def test_a_room_failed_for_its_decode_hicache_restore_is_counted_aborted_with_that_reason(worlds, patched):  # noqa: F811
    """SGLang turns a completed transfer into a failed one when decode's HiCache could not
    restore the prefix it promised prefill (its restore status FAILED): the reason says so,
    not "transfer failed" (no failure record says why then)."""
    mixin = pytest.importorskip("sglang.srt.disaggregation.decode_hicache_mixin")
    prefill, decode = worlds
    runtime, sink, registry = patched
    dreq = hooks._with_receiver(pdworld.decode_req(hooks.ROOM, hooks.DECODE_ROW))
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    dreq.hicache_restore_status = mixin.HiCacheRestoreResult.FAILED
    pd_decode.on_transfer_failed(runtime, pdworld.transfer_queue(decode), dreq)
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert record["verdict"] == "skipped" and "HiCache restore" in record["reason"], record
    _settled(runtime)
    engine = runtime.sides["decode"].monitor.engine
    assert _coverage(registry) == {("skipped", "aborted"): estimated_bytes(engine, pdworld.ROOM_TOKENS)}


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA, reason="`_release_request` arrives in SGLang 0.5.21")
@pytest.mark.parametrize("message, reason", [
    ("Decode transfer failed for request rank=0 decode_req.req.rid='r' with exception boom", "transfer_failed"),
    ("client gone", "aborted"),
])
def test_a_room_sglang_aborts_and_releases_for_a_failed_transfer_is_counted_transfer_failed(worlds, patched, message,
                                                                                            reason):  # noqa: F811
    """Before 0.5.22 SGLang aborts a room whose transfer failed and its transfer queue releases
    it, with no hook of the failure's own: the abort's message names the failure, and the
    room's bytes are counted `transfer_failed`, a client's abort `aborted`."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    prefill, decode = worlds
    runtime, sink, registry = patched
    dreq = hooks._with_receiver(pdworld.decode_req(hooks.ROOM, hooks.DECODE_ROW))
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    dreq.req.finished_reason = FINISH_ABORT(message)
    pd_decode.on_transfer_release(runtime, pdworld.transfer_queue(decode), dreq)
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert record["verdict"] == "skipped" and record["reason"].startswith(
        "transfer failed" if reason == "transfer_failed" else "aborted"), record["reason"]
    _settled(runtime)
    engine = runtime.sides["decode"].monitor.engine
    assert _coverage(registry) == {("skipped", reason): estimated_bytes(engine, pdworld.ROOM_TOKENS)}
