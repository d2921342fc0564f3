"""Coverage accounting through the real decode hooks on SGLang's real pools and metadata rows
(tests/sglang/pdworld.py): a clean room reads all its bytes verified once it finishes, and a
host-received room is counted skipped with reason host_dest and its bytes (docs/coverage.md)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import pdworld
import test_pd_hooks as hooks
from test_pd_hooks import patched  # noqa: F401  (the fixture: the pd.* targets patched on SGLang's classes)

from dsv4_idxk_probe.sglang import pd_decode

COVERAGE = "dsv4_idxk_probe_coverage_bytes_total"


def _settled(runtime) -> None:
    done = threading.Event()
    runtime.sides["decode"].monitor.engine.post(lambda _: done.set())
    assert done.wait(10)


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


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA,
                    reason="host-receive (destination=HOST) arrives with _send_kv_metadata in SGLang 0.5.21")
def test_a_host_received_room_is_counted_skipped_host_dest_with_its_bytes(worlds, patched):  # noqa: F811
    prefill, decode = worlds
    runtime, sink, registry = patched
    hooks.send_room(prefill)
    dreq = hooks._with_receiver(pdworld.decode_req(hooks.ROOM, hooks.DECODE_ROW))
    host_indices = torch.arange(40 * pdworld.PAGE, 40 * pdworld.PAGE + pdworld.ROOM_TOKENS, dtype=torch.int64)
    host = SimpleNamespace(name="HOST", value="host")  # KVTransferDestination.HOST
    pdworld.prealloc_queue(decode)._send_kv_metadata(dreq, host_indices, pdworld.PAGE, None, decode_prefix_len=0,
                                                     destination=host)
    pdworld.aux_transfer(prefill, decode, hooks.PREFILL_ROW, hooks.DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "skipped"
    _settled(runtime)
    engine = runtime.sides["decode"].monitor.engine
    frozen_slots = pdworld.ROOM_TOKENS // 4  # C4: one key per 4 tokens; fp8 rows: 128 B payload + 4 B scale per key
    assert _coverage(registry) == {("skipped", "host_dest"): frozen_slots * len(engine.layer_ids) * (128 + 4)}
