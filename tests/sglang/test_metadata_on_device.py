"""Metadata rows on a device (NPU; CUDA with Mooncake's intra-node NVLink pool): the
probe does not read them (that would synchronise the serving thread), so a room with
no other way to prefill's digest is counted unverified with reason
metadata_on_device, and the log says why once."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pdworld
import torch

from dsv4_idxk_probe.pd import RoomId
from dsv4_idxk_probe.sglang import pd_decode
from dsv4_idxk_probe.sglang.accessors import ATTR_DEST
from dsv4_idxk_probe.sglang.index_k import decode_room_pages
from dsv4_idxk_probe.sglang.sides import build_side

ROOM = 515


def _coverage(registry, reason):
    return sum(s.value for m in registry.collect() for s in m.samples
               if s.name == "dsv4_idxk_probe_coverage_bytes_total" and s.labels.get("path") == "pd"
               and s.labels.get("outcome") == "unverified" and s.labels.get("reason") == reason)


def _commit(runtime, decode, room):
    dreq = pdworld.decode_req(room, 1)
    kv = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    setattr(dreq, ATTR_DEST, decode_room_pages(kv, pdworld.PAGE, {"decode_prefix_len": pdworld.PREFIX_TOKENS}))
    # the rows as SGLang keeps them there: on a device ("meta" stands in: no CPU copy of it exists)
    queue = SimpleNamespace(metadata_buffers=SimpleNamespace(bootstrap_room=torch.zeros(4, 8, device="meta")),
                            scheduler=None)
    seen = pd_decode.before_commit(queue, dreq)
    pd_decode.after_commit(runtime, queue, dreq, seen)


def test_rooms_behind_device_metadata_rows_are_counted_unverified_with_the_reason(worlds, probe, monkeypatch, caplog):
    runtime, sink, registry = probe
    _, decode = worlds
    monkeypatch.setattr(pd_decode, "_said_metadata_on_device", False)
    build_side(runtime, "decode", decode.allocator, decode.kv_args)
    with caplog.at_level(logging.WARNING, logger="dsv4_idxk_probe"):
        for room in (ROOM, ROOM + 1):
            _commit(runtime, decode, room)
            record = sink.wait_for(1, stage="decode_recv", room=str(room))[0]
            assert record["verdict"] == "unverified"
            assert record["extra"]["unverified_reason"] == "metadata_on_device"
            runtime.sides["decode"].monitor.room_skipped(RoomId(room), "aborted")  # no longer tracked: counted
            sink.wait_for(1, verdict="skipped", room=str(room))
    said = [r for r in caplog.records if "metadata rows live on a device" in r.getMessage()]
    assert len(said) == 1
    assert _coverage(registry, "metadata_on_device") > 0
    assert _coverage(registry, "no_exchange") == 0
