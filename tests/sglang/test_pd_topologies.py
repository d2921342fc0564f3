"""Production topologies at the hook level (issue 31): where the prefill endpoint comes
from when the metadata row has no slot for it, enforce without a blocking fetch on the
scheduler thread, and prefill PP stages whose digests decode combines.

Real SGLang objects on CPU (tests/sglang/pdworld.py) and the shipped target table, as
in test_pd_hooks.py; the exchange is real (loopback).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest

import pdworld
from pd_testkit import make_runtime
from test_pd_hooks import DECODE_ROW, PREFILL_ROW, ROOM, _slow_digests, _with_receiver, send_room

from dsv4_idxk_probe.pd import InbandDigest, RoomId
from dsv4_idxk_probe.pd.assembly import PrefillAssembly
from dsv4_idxk_probe.sglang import accessors, pd_decode
from dsv4_idxk_probe.sglang.patcher import Patcher
from dsv4_idxk_probe.sglang.targets import load_targets


def _patch(runtime):
    patcher = Patcher(runtime, [t for t in load_targets(["sglang"]) if t.name.startswith("pd.")], route="wrapt")
    runtime.patcher = patcher
    status = patcher.patch()
    assert {name for name, (s, _) in status.items() if s != "patched"} == set(), status
    return patcher


@pytest.fixture
def sglang_room_slots(monkeypatch):
    """Install a stand-in `sglang.srt.disaggregation.kv_checksum` that claims the given
    bootstrap_room slots (upstream after 0.5.23 names 1-3 ``ROOM_SLOT_*``), with the
    probe's slot plans recomputed."""

    def install(*slots: int):
        module = types.ModuleType(accessors.KV_CHECKSUM_MODULE)
        for i, slot in enumerate(slots):
            setattr(module, f"ROOM_SLOT_USED_{i}", slot)
        monkeypatch.setitem(sys.modules, accessors.KV_CHECKSUM_MODULE, module)
        monkeypatch.setattr(accessors, "_PLANS", {})

    return install


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(runtime, worlds, dreq=None, corrupt=None):
    """Decode's half of the flow: the KV lands (with `corrupt` applied), the aux row lands,
    SGLang commits the room through the probe's hooks."""
    prefill, decode = worlds
    pdworld.transfer_index_k(prefill, decode)
    if corrupt is not None:
        corrupt(decode)
    dreq = dreq or _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    return dreq


# %% fixes 1 and 3: the endpoint reaches decode where the row has no slot for it


def test_kv_checksum_slots_leave_no_endpoint_slot_yet_a_late_digest_room_is_verified(worlds, monkeypatch, sglang_room_slots):
    """An SGLang whose kv_checksum.py takes slots 1-3: the digest moves to 4-7 and no slot is
    left for the endpoint. With a Mooncake-like send (digest not ready when the aux data
    leaves) decode has no in-band digest: it must still find prefill's exchange (the port
    in the digest's header, at the bootstrap's rank_ip) and reach a real verdict."""
    sglang_room_slots(1, 2, 3)
    runtime, sink, _ = make_runtime()
    patcher = _patch(runtime)
    try:
        prefill, _ = worlds
        made = _slow_digests(monkeypatch, runtime, prefill)
        req = send_room(prefill)  # no blocking copy: the digest is not ready at the send
        (row,) = req.disagg_kv_sender.kv_mgr.aux_rows
        plan = accessors.row_slot_plan(row)
        assert (plan.digest, plan.endpoint) == (slice(4, 8), None)
        assert made[0].waited == 0 and InbandDigest.from_slots(row[4:8]) is None
        _receive(runtime, worlds)
        record = sink.wait_for(1, stage="decode_recv")[0]
        port = runtime.sides["prefill"].server.port
        assert (record["verdict"], (record.get("extra") or {}).get("prefill_endpoint")) == ("match", f"127.0.0.1:{port}")
    finally:
        patcher.unpatch()
        runtime.close()


def test_kv_checksum_slots_with_a_ready_digest_still_localise_a_corrupt_byte(worlds, sglang_room_slots):
    """Same SGLang, NIXL-like send (digest in band, slots 4-7): a flipped byte must be
    localised, which takes prefill's vectors from the exchange the header names."""
    sglang_room_slots(1, 2, 3)
    runtime, sink, _ = make_runtime()
    patcher = _patch(runtime)
    try:
        prefill, _ = worlds
        send_room(prefill)

        def corrupt(decode):
            decode.index_k[2][pdworld.DECODE_PAGES[2], 7] ^= 0x10  # layer 5, logical page 1

        _receive(runtime, worlds, corrupt=corrupt)
        record = sink.wait_for(1, stage="decode_recv")[0]
        assert record["verdict"] == "mismatch"
        assert record["localisation"] is not None
        assert (record["localisation"]["layer_segments"], record["localisation"]["pages"]) == ([[5, "payload"]], [1])
    finally:
        patcher.unpatch()
        runtime.close()


def test_no_probe_slot_at_all_rebuilds_the_endpoint_by_the_port_rule(worlds, monkeypatch, sglang_room_slots):
    """An SGLang that uses every slot of the row: neither digest nor endpoint travels in
    band. With ``exchange.port_offset`` prefill listens on its KV manager's rank_port plus
    the offset, and decode rebuilds that from the bootstrap info (rank_ip, rank_port)."""
    sglang_room_slots(1, 2, 3, 4, 5, 6, 7)
    offset = 1000
    port = _free_port()
    rank_port = port - offset
    runtime, sink, _ = make_runtime(exchange={"bind": "127.0.0.1", "timeout_ms": 500, "port_offset": offset})
    patcher = _patch(runtime)
    try:
        prefill, _ = worlds
        prefill.scheduler.disagg_prefill_bootstrap_queue.kv_manager.rank_port = rank_port
        send_room(prefill)
        assert runtime.sides["prefill"].server.port == port
        dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
        dreq.kv_receiver.bootstrap_infos[0]["rank_port"] = rank_port
        _receive(runtime, worlds, dreq=dreq)
        record = sink.wait_for(1, stage="decode_recv")[0]
        assert (record["verdict"], (record.get("extra") or {}).get("prefill_endpoint")) == ("match", f"127.0.0.1:{port}")
    finally:
        patcher.unpatch()
        runtime.close()


# %% fix 2: enforce never fetches on the scheduler thread


@pytest.mark.skipif(not pdworld.HAS_VERIFY_KV_CHECKSUMS,
                    reason="no `_verify_kv_checksums` before SGLang 0.5.21: enforce observes only there (docs/releases.md)")
def test_enforce_holds_a_room_whose_digest_is_still_being_fetched_and_drops_it_later(worlds, monkeypatch):
    """Mooncake-like send (no in-band digest) of a room corrupted in flight, enforce on.
    The first prebuilt batch must neither drop nor keep the room on a blocking fetch: it is
    held (back in the waiting queue) while the exchange answers on a worker thread; a later
    batch drops it. No exchange fetch ever runs on the scheduler thread."""
    # a deadline far beyond the test's steps: the fetch cannot end before the gate opens
    runtime, sink, _ = make_runtime(mode="enforce", exchange={"bind": "127.0.0.1", "timeout_ms": 20_000})
    patcher = _patch(runtime)
    gate = threading.Event()
    try:
        prefill, _ = worlds
        _slow_digests(monkeypatch, runtime, prefill)
        send_room(prefill)
        server = runtime.sides["prefill"].server
        lookup = server.lookup

        def slow_lookup(key):  # prefill answers once the gate opens (a slow or far peer)
            gate.wait(30)
            return lookup(key)

        monkeypatch.setattr(server, "lookup", slow_lookup)

        def corrupt(decode):
            decode.index_k[0][pdworld.DECODE_PAGES[1], 3] ^= 0x04

        side = pd_decode.decode_side(runtime, worlds[1].scheduler)
        fetch_threads = []
        real_fetch = side.client.fetch

        def recording_fetch(*args, **kwargs):
            fetch_threads.append(threading.current_thread())
            return real_fetch(*args, **kwargs)

        monkeypatch.setattr(side.client, "fetch", recording_fetch)  # before the room lands: every fetch seen
        dreq = _receive(runtime, worlds, corrupt=corrupt)
        aborted = []
        scheduler = pdworld.standin(
            pdworld.scheduler_class(), kv_checksum_computer=None, attn_tp_cpu_group=None, waiting_queue=[],
            _handle_kv_checksum_mismatch=lambda req, msg: aborted.append(req.rid),
        )

        def prebuilt_batch(reqs):
            kept = []
            batch = SimpleNamespace(reqs=list(reqs), filter_batch=lambda keep_indices: kept.append(keep_indices))
            scheduler._verify_kv_checksums(batch)
            return kept

        kept = prebuilt_batch([dreq.req])
        assert (aborted, kept, scheduler.waiting_queue) == ([], [[]], [dreq.req])  # held, not judged
        gate.set()
        deadline = time.monotonic() + 10
        while scheduler.waiting_queue and not aborted and time.monotonic() < deadline:
            reqs, scheduler.waiting_queue[:] = list(scheduler.waiting_queue), []
            prebuilt_batch(reqs)
            time.sleep(0.05)
        assert aborted == [dreq.req.rid]
        assert fetch_threads and threading.main_thread() not in fetch_threads
    finally:
        gate.set()
        patcher.unpatch()
        runtime.close()


@pytest.mark.skipif(not pdworld.HAS_VERIFY_KV_CHECKSUMS,
                    reason="no `_verify_kv_checksums` before SGLang 0.5.21: enforce observes only there (docs/releases.md)")
def test_enforce_keeps_a_clean_rebootstrapped_room_whose_first_fetch_was_never_read(worlds, monkeypatch):
    """Mooncake-like sends, enforce on. The room lands (its fetch starts), is retracted
    before its first prebuilt batch (`pause_generation(retract)`: never judged, its fetch
    never read), and is sent again under the same room id and length with other bytes
    (recomputed under new weights), landing intact. Enforce judged it by the first
    transfer's fetch and dropped it (found by review)."""
    runtime, sink, _ = make_runtime(mode="enforce", exchange={"bind": "127.0.0.1", "timeout_ms": 5_000})
    patcher = _patch(runtime)
    try:
        prefill, _ = worlds
        _slow_digests(monkeypatch, runtime, prefill)
        send_room(prefill)
        sink.wait_for(1, stage="prefill_send")
        first = _receive(runtime, worlds)
        assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "match"
        pd_decode.on_retract(runtime, [first.req])
        for buf in prefill.index_k:  # the same tokens, recomputed: other bytes
            buf[pdworld.PREFILL_PAGES[1:]] ^= 0x01
        send_room(prefill)
        sink.wait_for(2, stage="prefill_send")
        again = _receive(runtime, worlds, dreq=_with_receiver(pdworld.decode_req(ROOM, DECODE_ROW)))
        assert sink.wait_for(2, stage="decode_recv")[1]["verdict"] == "match"
        aborted = []
        scheduler = pdworld.standin(
            pdworld.scheduler_class(), kv_checksum_computer=None, attn_tp_cpu_group=None, waiting_queue=[],
            _handle_kv_checksum_mismatch=lambda req, msg: aborted.append(req.rid),
        )
        deadline = time.monotonic() + 10
        reqs = [again.req]
        while reqs and time.monotonic() < deadline:  # held while its fetch runs, then judged
            scheduler._verify_kv_checksums(SimpleNamespace(reqs=reqs, filter_batch=lambda keep_indices: None))
            reqs, scheduler.waiting_queue[:] = list(scheduler.waiting_queue), []
            time.sleep(0.05)
        assert aborted == [] and reqs == []
    finally:
        patcher.unpatch()
        runtime.close()


# %% fix 4: prefill PP 2 -> decode PP 1


def _stage(runtime, worlds, layout, layers: list[int], port: int) -> PrefillAssembly:
    """One prefill PP stage: the prefill world's buffers of `layers` only, digested and
    served as that stage's own scheduler would (global layer ids)."""
    prefill, _ = worlds
    picks = [pdworld.C4_LAYERS.index(layer) for layer in layers]
    return PrefillAssembly(layout, layers, [prefill.index_k[i] for i in picks], runtime.config, runtime.emit,
                           bind="127.0.0.1", port=port, require_exchange=True)


@pytest.mark.parametrize("corrupt_layer", [None, 1, 5])
def test_pp_stages_digests_are_combined_into_a_real_verdict(worlds, corrupt_layer):
    """Prefill PP 2 (stage 0: layers 1 and 3, stage 1: layer 5) -> decode PP 1. Each stage
    sends its aux into the same row (here stage 1's in-band digest, covering layer 5 only).
    Decode must combine both stages' digests: a clean room matches, a flipped byte is
    found at its layer and page; never `not_comparable`."""
    offset = 1000
    ports = [_free_port(), _free_port()]
    runtime, sink, _ = make_runtime(exchange={"bind": "127.0.0.1", "timeout_ms": 500, "port_offset": offset})
    patcher = _patch(runtime)
    stages = []
    try:
        prefill, decode = worlds
        pd_decode.decode_side(runtime, decode.scheduler)  # decode PP 1: every C4 layer
        layout = runtime.sides["decode"].layout
        stages = [_stage(runtime, worlds, layout, [1, 3], ports[0]), _stage(runtime, worlds, layout, [5], ports[1])]
        pages = np.array(pdworld.PREFILL_PAGES[1:])
        digests = [stage.monitor.room_sent(RoomId(ROOM), pages, pdworld.ROOM_TOKENS) for stage in stages]
        assert all(d.wait() for d in digests)
        last = digests[1]
        prefill.metadata.bootstrap_room[PREFILL_ROW, 0] = ROOM
        row = accessors.metadata_row(prefill.metadata, PREFILL_ROW)
        row[1:5] = np.array(InbandDigest(int(last.room_digests[0]), stages[1].signature, pdworld.ROOM_TOKENS).to_slots(),
                            dtype=np.uint64)
        dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
        dreq.kv_receiver.bootstrap_infos = [
            {"rank_ip": "127.0.0.1", "rank_port": ports[1] - offset, "is_dummy": False, "pp_rank": 1},
            {"rank_ip": "127.0.0.1", "rank_port": ports[0] - offset, "is_dummy": False, "pp_rank": 0},
        ]

        def corrupt(decode):
            if corrupt_layer is not None:
                decode.index_k[pdworld.C4_LAYERS.index(corrupt_layer)][pdworld.DECODE_PAGES[3], 11] ^= 0x01

        _receive(runtime, worlds, dreq=dreq, corrupt=corrupt)
        record = sink.wait_for(1, stage="decode_recv")[0]
        if corrupt_layer is None:
            assert record["verdict"] == "match", record
        else:
            assert record["verdict"] == "mismatch", record
            assert record["localisation"]["layer_segments"] == [[corrupt_layer, "payload"]]
            assert record["localisation"]["pages"] == [2]
    finally:
        for stage in stages:
            stage.close()
        patcher.unpatch()
        runtime.close()


def test_pp_stages_without_the_port_rule_are_unverified_for_want_of_the_stages(worlds):
    """No ``port_offset``: decode cannot reach every stage, and one stage's in-band digest
    does not describe the room: `unverified`, never a verdict on part of the room."""
    runtime, sink, _ = make_runtime()
    patcher = _patch(runtime)
    try:
        prefill, decode = worlds
        send_room(prefill)  # the row as one stage (all layers here) left it
        dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
        dreq.kv_receiver.bootstrap_infos = [
            {"rank_ip": "127.0.0.1", "rank_port": 1, "is_dummy": False, "pp_rank": 0},
            {"rank_ip": "127.0.0.1", "rank_port": 2, "is_dummy": False, "pp_rank": 1},
        ]
        _receive(runtime, worlds, dreq=dreq)
        record = sink.wait_for(1, stage="decode_recv")[0]
        assert record["verdict"] == "unverified"
    finally:
        patcher.unpatch()
        runtime.close()
