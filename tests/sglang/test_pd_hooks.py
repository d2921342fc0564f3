"""Prefill and decode hooks over real SGLang objects on CPU (0.5.23, and each
older release in the release matrix, tests/sglang_releases/).

The probe's wrappers are installed on SGLang's real classes from the shipped
target table (wrapt route), and SGLang's own ``send_kv_chunk`` (with
``_send_kv_chunk`` from 0.5.21), the NIXL sender's ``send``,
``_send_kv_metadata`` (0.5.21+) and ``_commit_transfer_to_req`` run on stand-in
scheduler/queue/request objects that hold real pools and MetadataBuffers
(tests/sglang/pdworld.py). The transfer itself is simulated by copying the
room's index-K rows and the metadata row, as the transfer engine would.
"""

from __future__ import annotations

import importlib
import inspect
import time
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

import sglang.srt.disaggregation.common.conn  # noqa: F401
import sglang.srt.disaggregation.decode  # noqa: F401  (the table's modules, imported before patching)
import sglang.srt.disaggregation.mooncake.conn  # noqa: F401  (the senders the prefill flow runs)
import sglang.srt.disaggregation.nixl.conn  # noqa: F401
import sglang.srt.disaggregation.prefill as prefill_module
import sglang.srt.managers.schedule_batch  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401  (its abort frees decode rooms: a release target)
import sglang.srt.managers.scheduler_components.batch_result_processor  # noqa: F401
from dsv4_idxk_probe.exchange.client import WAITED_STRIKES
from dsv4_idxk_probe.pd import InbandDigest
from dsv4_idxk_probe.sglang import pd_decode, pd_prefill
from dsv4_idxk_probe.sglang.accessors import metadata_row, row_slot_plan
from dsv4_idxk_probe.sglang.patcher import Patcher
from dsv4_idxk_probe.sglang.targets import load_targets

import pdworld
from pd_testkit import collected, make_runtime

ROOM = 4242
PREFILL_ROW, DECODE_ROW = 2, 1


@pytest.fixture
def patched(probe):
    yield from _patched(probe)


@pytest.fixture
def patched_diagnosing():
    """`patched` with diagnosis on (it is off by default)."""
    runtime, sink, registry = make_runtime(diagnosis={"enabled": True})
    yield from _patched((runtime, sink, registry))
    runtime.close()


def _patched(probe):
    runtime, sink, registry = probe
    targets = [t for t in load_targets(["sglang"]) if t.name.startswith("pd.")]
    patcher = Patcher(runtime, targets, route="wrapt")
    runtime.patcher = patcher
    status = patcher.patch()
    assert {name for name, (s, _) in status.items() if s != "patched"} == set(), status
    yield runtime, sink, registry
    patcher.unpatch()


@contextmanager
def _enforcing():
    """A runtime in enforce mode with the PD hooks on SGLang's classes, taken off after."""
    runtime, sink, registry = make_runtime(mode="enforce")
    patcher = Patcher(runtime, [t for t in load_targets(["sglang"]) if t.name.startswith("pd.")], route="wrapt")
    runtime.patcher = patcher
    patcher.patch()
    try:
        yield runtime, sink
    finally:
        patcher.unpatch()
        runtime.close()


#: The backends whose real sender the prefill flow runs: (module, manager, sender).
BACKENDS = {
    "nixl": ("sglang.srt.disaggregation.nixl.conn", "NixlKVManager", "NixlKVSender"),
    "mooncake": ("sglang.srt.disaggregation.mooncake.conn", "MooncakeKVManager", "MooncakeKVSender"),
}


class TransferManager:
    """Stand-in KV manager: records what each send enqueues, and the metadata
    row as it is when the aux data is enqueued (the last chunk). Each call is
    bound to the real manager's `add_transfer_request` signature (the backend's,
    in the release under test), so a call the real manager would refuse fails here."""

    kv_shard_size = 1
    enable_all_cp_ranks_for_transfer = False
    is_dummy_cp_rank = False
    _dcp_pack_max_tokens = None  # 0.5.22+: no DCP relayout, so one segment per send

    def __init__(self, metadata, manager_class):
        self.metadata = metadata
        self.aux_rows: list[np.ndarray] = []
        self._signature = inspect.signature(manager_class.add_transfer_request)

    def prepare_send_state_indices(self, state_indices):
        return state_indices

    def add_transfer_request(self, *args, **kwargs):
        call = self._signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        if call.arguments["is_last_chunk"]:
            self.aux_rows.append(self.metadata.bootstrap_room[call.arguments["aux_index"]].numpy().copy())


def real_sender(metadata, room: int, aux_index: int, num_pages: int, backend: str = "nixl"):
    """SGLang's real sender of `backend` without a transfer engine behind it. Before
    0.5.23 each backend has its own `send` (CommonKVSender.send is empty); from
    0.5.23 they go through CommonKVSender.send. The state is what any of them reads."""
    from sglang.srt.observability.trace import TraceNullContext  # tracing off, as by default

    module, manager, sender = BACKENDS[backend]
    module = importlib.import_module(module)
    return pdworld.standin(
        getattr(module, sender),
        kv_mgr=TransferManager(metadata, getattr(module, manager)), bootstrap_room=room, aux_index=aux_index,
        conclude_state=None, curr_idx=0, num_kv_indices=num_pages, _transfer_start_time=None,
        _early_send_wait_event=None, _transfer_num_kv_indices=0, _transfer_num_state_indices=0,
        _send_failed=False, chunk_id=0, has_sent=False, trace_ctx=TraceNullContext(),
    )


def send_chunk(prefill: pdworld.Side, req, last_chunk=True, on_blocking_copy=lambda: None) -> None:
    """SGLang's real `send_kv_chunk` (and `_send_kv_chunk` where the release splits it).
    `on_blocking_copy` runs where NIXL's page list blocks on the stream
    (`kv_to_page_indices`' .cpu()), before `sender.send`."""
    real_page_indices = prefill_module.kv_to_page_indices

    def blocking_page_indices(kv_indices, page_size):
        on_blocking_copy()
        return real_page_indices(kv_indices, page_size)

    with mock.patch.object(prefill_module, "kv_to_page_indices", blocking_page_indices):
        prefill.scheduler.send_kv_chunk(req, last_chunk=last_chunk)


def send_room(prefill: pdworld.Side, room: int = ROOM, backend: str = "nixl", **kwargs):
    req = pdworld.prefill_req(room, PREFILL_ROW)
    req.disagg_kv_sender = real_sender(prefill.metadata, room, PREFILL_ROW, num_pages=3, backend=backend)
    send_chunk(prefill, req, **kwargs)
    return req


def _with_receiver(dreq):
    """`_send_kv_metadata` hands the pages to the receiver; nothing to send here."""
    dreq.kv_receiver.send_metadata = lambda *a, **k: None
    dreq.req.time_stats.set_decode_transfer_queue_entry_time = lambda: None
    return dreq


# %% prefill: in-band slots


def test_prefill_hook_fills_inband_slots_before_aux_leaves(worlds, patched):
    prefill, _ = worlds
    runtime, sink, _ = patched
    req = send_room(prefill)
    (row,) = req.disagg_kv_sender.kv_mgr.aux_rows  # the row as the aux send saw it
    assert int(row[0]) == ROOM  # SGLang's own slot untouched
    inband = InbandDigest.from_slots(row[1:5])
    record = sink.wait_for(1, stage="prefill_send")[0]
    assert inband is not None
    assert f"{inband.room_digest:016x}" == record["digest"]["room"]
    assert inband.n_tokens == pdworld.ROOM_TOKENS
    assert inband.signature == runtime.sides["prefill"].signature
    assert int(row[5]) == runtime.sides["prefill"].endpoint_slot != 0


def test_prefill_puts_no_digest_of_rows_it_could_not_read_in_band(worlds, patched):
    """A page id past the index-K buffers (a probe fault) makes the room's digest a random
    value, so that it matches nothing: in band, with the side's signature, a clean room would
    have been dropped by decode's enforce (found by review). The slots keep the port alone."""
    prefill, _ = worlds
    runtime, sink, _ = patched
    last = slice(pdworld.PREFIX_TOKENS + 2 * pdworld.PAGE, pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS)
    prefill.req_to_token_pool.req_to_token[1, last] += 40 * pdworld.PAGE  # page ids past the 12-page buffers
    req = send_room(prefill)
    (row,) = req.disagg_kv_sender.kv_mgr.aux_rows
    record = sink.wait_for(1, stage="prefill_send")[0]
    assert record["digest"] is not None  # digested (its unread rows counted), yet nothing in band
    inband = InbandDigest.from_slots(row[1:5])
    assert inband is None or inband.room_digest == 0, inband


def test_prefill_clears_stale_slots_for_skipped_rooms(worlds, patched):
    prefill, _ = worlds
    prefill.metadata.bootstrap_room[PREFILL_ROW, 1:6] = 77  # a previous room's leftovers
    req = pdworld.prefill_req(ROOM, PREFILL_ROW)
    req.rid = "HEALTH_CHECK_123"
    req.disagg_kv_sender = real_sender(prefill.metadata, ROOM, PREFILL_ROW, num_pages=3)
    send_chunk(prefill, req)
    (row,) = req.disagg_kv_sender.kv_mgr.aux_rows
    assert row[1:6].tolist() == [0, 0, 0, 0, 0]


def test_non_last_chunk_is_not_digested(worlds, patched):
    prefill, _ = worlds
    runtime, sink, _ = patched
    req = pdworld.prefill_req(ROOM, PREFILL_ROW)
    req.disagg_kv_sender = real_sender(prefill.metadata, ROOM, PREFILL_ROW, num_pages=6)  # more to come
    send_chunk(prefill, req, last_chunk=False)
    assert req.disagg_kv_sender.kv_mgr.aux_rows == []
    assert runtime.sides.get("prefill") is None or runtime.sides["prefill"].monitor.recent.get(f"{ROOM}/0") is None


@pytest.mark.parametrize("how", ["dummy_cp_rank", "every_decode_rank_dummy", "every_decode_rank_dummy_by_method"])
def test_a_prefill_rank_that_sends_nothing_does_not_digest_the_room(worlds, patched, how):
    """A CP rank past 0, or a rank every decode rank registered as dummy (prefill's attention
    TP above decode's), moves no KV: decode never asks for its digest, so it takes none."""
    prefill, _ = worlds
    runtime, sink, _ = patched
    req = pdworld.prefill_req(ROOM, PREFILL_ROW)
    req.disagg_kv_sender = real_sender(prefill.metadata, ROOM, PREFILL_ROW, num_pages=3)
    manager = req.disagg_kv_sender.kv_mgr
    if how == "dummy_cp_rank":
        manager.is_dummy_cp_rank = True
        manager.update_status = lambda *_a: None  # SGLang marks such a room sent at once
    elif how == "every_decode_rank_dummy":
        manager.transfer_infos = {ROOM: {"decode-0": SimpleNamespace(is_dummy=True),
                                         "decode-1": SimpleNamespace(is_dummy=True)}}
    else:  # NIXL's TransferInfo of 0.5.18-0.5.19: a method, whose answer may be a NumPy bool
        manager.transfer_infos = {ROOM: {"decode-0": SimpleNamespace(is_dummy=lambda: np.bool_(True))}}
    send_chunk(prefill, req)
    other = send_room(prefill, room=ROOM + 1)  # a room this rank does send, after it
    sink.wait_for(1, stage="prefill_send")
    assert [r["room"] for r in sink.records if r.get("stage") == "prefill_send"] == [str(ROOM + 1)]
    assert runtime.sides["prefill"].monitor.recent.get(f"{ROOM}/0") is None
    assert other.disagg_kv_sender.kv_mgr.aux_rows


#: What a decode rank sends a prefill rank it takes no KV from (its receiver's registration):
#: no KV indices; Mooncake: no aux index either; NIXL: the dummy flag (msg[9]).
DUMMY_REGISTRATION = {
    "nixl": [str(ROOM).encode(), b"10.0.0.2", b"5000", b"decode-agent", b"", b"3", b"1", b"", b"", b"1"],
    "mooncake": [str(ROOM).encode(), b"10.0.0.2", b"5000", b"decode-session", b"", b"", b"", b"1"],
}


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_rank_registered_as_dummy_in_the_release_s_own_transfer_info_does_not_digest(worlds, patched, backend):
    """The release's own ``TransferInfo`` of `backend` from a dummy registration: its flag is a
    field, or a method (NIXL, 0.5.18-0.5.19), which read as a flag never said dummy. Sent through
    NIXL's sender (Mooncake's needs CUDA for its pinned indices from 0.5.23): the registration is
    the manager's, whichever sender reads it."""
    prefill, _ = worlds
    _runtime, sink, _ = patched
    info = importlib.import_module(BACKENDS[backend][0]).TransferInfo.from_zmq(DUMMY_REGISTRATION[backend])
    req = pdworld.prefill_req(ROOM, PREFILL_ROW)
    req.disagg_kv_sender = real_sender(prefill.metadata, ROOM, PREFILL_ROW, num_pages=3)
    req.disagg_kv_sender.kv_mgr.transfer_infos = {ROOM: {"decode-0": info}}
    send_chunk(prefill, req)
    send_room(prefill, room=ROOM + 1)
    sink.wait_for(1, stage="prefill_send")
    assert [r["room"] for r in sink.records if r.get("stage") == "prefill_send"] == [str(ROOM + 1)]


def test_a_prefill_rank_one_decode_rank_registered_for_real_digests_the_room(worlds, patched):
    prefill, _ = worlds
    _runtime, sink, _ = patched
    req = pdworld.prefill_req(ROOM, PREFILL_ROW)
    req.disagg_kv_sender = real_sender(prefill.metadata, ROOM, PREFILL_ROW, num_pages=3)
    req.disagg_kv_sender.kv_mgr.transfer_infos = {ROOM: {"decode-0": SimpleNamespace(is_dummy=True),
                                                         "decode-1": SimpleNamespace(is_dummy=False)}}
    send_chunk(prefill, req)
    (record,) = sink.wait_for(1, stage="prefill_send")
    assert record["room"] == str(ROOM)


class _NotYetReady:
    """A submitted digest whose stream has not passed the kernel until `passed` is set
    (what a GPU digest looks like right after submit)."""

    def __init__(self, pending):
        self.pending = pending
        self.passed = False
        self.waited = 0
        self.done = SimpleNamespace(synchronize=self._wait)

    def _wait(self):
        self.waited += 1
        self.passed = True

    def ready(self):
        return self.passed

    def wait(self):
        self.done.synchronize()
        return True

    @property
    def room_digests(self):
        assert self.passed, "read before the stream passed the digest"
        return self.pending.room_digests

    def whole_room_digest(self, i=0):
        assert self.passed, "read before the stream passed the digest"
        return self.pending.whole_room_digest(i)


def _slow_digests(monkeypatch, runtime, prefill):
    """Make the prefill side's digests 'not ready' until the stream passes."""
    pd_prefill.prefill_side(runtime, prefill.scheduler)
    monitor = runtime.sides["prefill"].monitor
    made = []
    real = monitor.room_sent

    def room_sent(*args, **kwargs):
        made.append(_NotYetReady(real(*args, **kwargs)))
        return made[-1]

    monkeypatch.setattr(monitor, "room_sent", room_sent)
    return made


# From 0.5.23 Mooncake's page list is a pinned async copy, never a blocking one (the
# no-blocking-copy tests below cover it): its case exists only on the older releases.
BLOCKING_BACKENDS = ["nixl"] + (["mooncake"] if pdworld.RELEASE < (0, 5, 23) else [])


@pytest.mark.parametrize("backend", BLOCKING_BACKENDS)
def test_blocking_copy_path_writes_inband_without_waiting(worlds, patched, monkeypatch, backend):
    """NIXL (and Mooncake before 0.5.23): the send path blocks on the stream before
    sender.send; the hook in the backend's send then finds the digest ready and
    writes it, without a wait of its own."""
    prefill, _ = worlds
    runtime, sink, _ = patched
    made = _slow_digests(monkeypatch, runtime, prefill)

    def blocking_copy():
        made[0].passed = True

    req = send_room(prefill, backend=backend, on_blocking_copy=blocking_copy)
    (row,) = req.disagg_kv_sender.kv_mgr.aux_rows
    assert made[0].waited == 0
    assert InbandDigest.from_slots(row[1:5]).room_digest == int(made[0].pending.room_digests[0])


def test_send_hook_asks_no_event_before_the_sender_sends(worlds, patched, monkeypatch):
    """The digest launched at the last chunk cannot have run a line later: the hook leaves
    its event alone (a driver call on the scheduler thread) and the sender's send asks,
    once, after the transfer's blocking copy."""
    prefill, _ = worlds
    runtime, sink, _ = patched
    made = _slow_digests(monkeypatch, runtime, prefill)
    asked = []

    def blocking_copy():
        asked.append("copy")
        made[0].passed = True

    def ready(self=None):
        asked.append("ready")
        return made[0].passed

    monkeypatch.setattr(_NotYetReady, "ready", ready)
    req = send_room(prefill, on_blocking_copy=blocking_copy)
    (row,) = req.disagg_kv_sender.kv_mgr.aux_rows
    assert asked == ["copy", "ready"]
    assert InbandDigest.from_slots(row[1:5]).room_digest == int(made[0].pending.room_digests[0])


@pytest.mark.parametrize("mode", ["observe", "enforce"])
def test_no_blocking_copy_defers_and_never_waits_on_the_scheduler_thread(worlds, monkeypatch, mode):
    """Mooncake-like path: nothing blocks before the last send. The hook runs on the
    scheduler thread, already behind the next forward: it must not wait for the
    digest there, in enforce mode either (decode takes it from the exchange)."""
    prefill, _ = worlds
    runtime, sink, _ = make_runtime(mode=mode)
    targets = [t for t in load_targets(["sglang"]) if t.name in ("pd.send_kv_chunk", "pd.sender_send")]
    patcher = Patcher(runtime, targets, route="wrapt")
    patcher.patch()
    try:
        made = _slow_digests(monkeypatch, runtime, prefill)
        req = send_room(prefill)
        (row,) = req.disagg_kv_sender.kv_mgr.aux_rows
        side = runtime.sides["prefill"]
        assert (made[0].waited, side.inband_deferred, InbandDigest.from_slots(row[1:5])) == (0, 1, None)
        assert int(row[5]) == side.endpoint_slot  # decode can still ask the exchange
    finally:
        patcher.unpatch()
        runtime.close()


def test_enforce_leaves_the_inband_slot_empty_when_the_digest_failed(worlds, monkeypatch):
    """A digest whose event could not be recorded never gets its cells: enforce must not
    write them in band (decode would judge garbage); decode asks the exchange instead."""
    prefill, _ = worlds
    runtime, sink, _ = make_runtime(mode="enforce")
    targets = [t for t in load_targets(["sglang"]) if t.name in ("pd.send_kv_chunk", "pd.sender_send")]
    patcher = Patcher(runtime, targets, route="wrapt")
    patcher.patch()
    try:
        made = _slow_digests(monkeypatch, runtime, prefill)
        monkeypatch.setattr(_NotYetReady, "wait", lambda self: False)  # what a failed batch answers
        req = send_room(prefill)
        (row,) = req.disagg_kv_sender.kv_mgr.aux_rows
        side = runtime.sides["prefill"]
        assert (made[0].passed, made[0].waited, side.inband_deferred) == (False, 0, 1)
        assert InbandDigest.from_slots(row[1:5]) is None
    finally:
        patcher.unpatch()
        runtime.close()


# %% decode: reading back, verdicts, localisation


def _decode_flow(worlds, patched, corrupt=None):
    prefill, decode = worlds
    runtime, sink, registry = patched
    send_room(prefill)
    pdworld.transfer_index_k(prefill, decode)
    if corrupt is not None:
        corrupt(decode)
    dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    return dreq


def test_decode_hook_reads_inband_back_and_matches(worlds, patched):
    runtime, sink, registry = patched
    dreq = _decode_flow(worlds, patched)
    record = sink.wait_for(1, stage="decode_recv")[0]
    prefill_record = sink.wait_for(1, stage="prefill_send")[0]
    assert (record["verdict"], record["expected_room"]) == ("match", prefill_record["digest"]["room"])
    assert dreq.req.output_ids == [42]  # SGLang's commit ran: first token from the metadata row
    assert dreq.kv_receiver is None
    assert dreq.metadata_buffer_index == DECODE_ROW


@pytest.mark.parametrize(
    "layer_index, logical_page, offset, segment",
    [(0, 0, 5, "payload"), (1, 2, 8192 + 3 * 4 + 1, "scale"), (2, 1, 64 * 128 - 1, "payload"), (2, 2, 24 * 128, "payload")],
)
def test_flipped_byte_is_reported_at_receipt_with_its_cell(worlds, patched, layer_index, logical_page, offset, segment):
    runtime, sink, registry = patched

    def corrupt(decode):
        decode.index_k[layer_index][pdworld.DECODE_PAGES[1 + logical_page], offset] ^= 0x01

    _decode_flow(worlds, patched, corrupt)
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert (record["verdict"], record["first_divergence"]) == ("mismatch", "decode_recv")
    loc = record["localisation"]
    assert loc["layer_segments"] == [[pdworld.C4_LAYERS[layer_index], segment]]
    assert loc["pages"] == [logical_page]


def test_unfrozen_tail_bytes_do_not_count(worlds, patched):
    runtime, sink, _ = patched

    def corrupt(decode):  # slot 25 of the tail page: written later by decode steps
        decode.index_k[0][pdworld.DECODE_PAGES[3], 25 * 128] ^= 0xFF
        decode.index_k[0][pdworld.DECODE_PAGES[3], 8192 + 25 * 4] ^= 0xFF

    _decode_flow(worlds, patched, corrupt)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "match"


def test_change_after_receipt_is_found_at_next_stage(worlds, patched):
    runtime, sink, _ = patched
    prefill, decode = worlds
    dreq = _decode_flow(worlds, patched)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "match"
    decode.index_k[1][pdworld.DECODE_PAGES[1], 100] ^= 0x80  # layer 3, logical page 0
    step = pd_decode.make_decode_step_wrapper(runtime)
    batch = SimpleNamespace(reqs=[dreq.req])
    for _ in range(runtime.config.step_interval):
        step(lambda *a, **k: "result", None, (batch, None), {})
    bad = sink.wait_for(1, stage="decode_step")[0]
    assert (bad["verdict"], bad["first_divergence"], bad["step"]) == ("mismatch", "decode_step", 2)
    assert bad["localisation"]["layer_segments"] == [[3, "payload"]]
    assert bad["localisation"]["pages"] == [0]
    dreq.req.finished_reason = "FINISH_LENGTH"  # finished in the next batch
    assert step(lambda *a, **k: "result", None, (batch, None), {}) == "result"
    step(lambda *a, **k: "result", None, (batch, None), {})  # overlap's overshoot tick: no second record
    last = sink.wait_for(1, stage="decode_finish")[0]
    assert (last["verdict"], last["first_divergence"]) == ("mismatch", "decode_step")
    assert runtime.sides["decode"].monitor.tracked() == 0
    assert len([r for r in sink.records if r["stage"] == "decode_finish"]) == 1


def test_the_hooks_journal_the_rooms_pages_and_a_zeroed_page_is_diagnosed(worlds, patched_diagnosing):
    """docs/diagnosis.md through SGLang's own hook points: `_send_kv_metadata` journals the
    pages as allocated, the commit as landed; a page zeroed after receipt reads `zeroed`."""
    patched = patched_diagnosing
    runtime, sink, registry = patched
    prefill, decode = worlds
    dreq = _decode_flow(worlds, patched)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "match"
    room = f"{ROOM}/0"
    page = pdworld.DECODE_PAGES[2]  # logical page 1
    assert [(e["event"], e["room"]) for e in runtime.journal.events_for(page)] == [
        ("allocated", room), ("transfer_landed", room)]
    if not pdworld.HAS_SEND_KV_METADATA:  # journalled after pop_preallocated: too late for a snapshot
        assert runtime.sides["decode"].monitor.diagnosis.index.before_content(room) is None
    decode.index_k[0][page].zero_()
    step = pd_decode.make_decode_step_wrapper(runtime)
    batch = SimpleNamespace(reqs=[dreq.req])
    for _ in range(runtime.config.step_interval):
        step(lambda *a, **k: "result", None, (batch, None), {})
    bad = sink.wait_for(1, stage="decode_step")[0]
    assert {(c["layer"], c["page"], c["segment"], c["kind"], c["physical_page"]) for c in bad["diagnosis"]} == {
        (pdworld.C4_LAYERS[0], 1, "payload", "zeroed", page), (pdworld.C4_LAYERS[0], 1, "scale", "zeroed", page)}


def test_the_pages_bytes_before_the_transfer_are_read_before_prefill_can_write(worlds, patched_diagnosing):
    """A fast prefill writes as soon as decode's metadata is out (inside `send_metadata`):
    the snapshot of what the pages held must be the bytes from before that write (decode's
    own random bytes here), not the landed room, or every bad cell would read
    `previous_occupant`."""
    if not pdworld.HAS_SEND_KV_METADATA:
        pytest.skip("before 0.5.21 no snapshot is taken (no `_send_kv_metadata`)")
    runtime, sink, _ = patched_diagnosing
    prefill, decode = worlds
    send_room(prefill)
    dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
    dreq.kv_receiver.send_metadata = lambda *a, **k: pdworld.transfer_index_k(prefill, decode)
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    assert sink.wait_for(1, stage="decode_recv")[0]["verdict"] == "match"
    diagnosis = runtime.sides["decode"].monitor.diagnosis
    before, landed = diagnosis.index.before_content(f"{ROOM}/0"), diagnosis.index.held_content(f"{ROOM}/0")
    assert before is not None and landed is not None  # landed: the receipt matched, its content is verified
    frozen = before.frozen > 0
    assert (before.content[:, frozen, :] != landed.content[:, frozen, :]).all()


def test_dead_prefill_exchange_makes_a_corrupt_room_unlocalised_not_stuck(worlds, patched):
    runtime, sink, _ = patched

    def prefill_gone_and_a_byte_flipped(decode):
        runtime.sides["prefill"].server.close()  # the prefill rank is gone before decode asks
        decode.index_k[0][pdworld.DECODE_PAGES[1], 0] ^= 1

    _decode_flow(worlds, patched, corrupt=prefill_gone_and_a_byte_flipped)
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert record["verdict"] == "mismatch" and record["localisation"] is None
    # asked again after each short backoff, until the peer failed WAITED_STRIKES times in a row
    assert runtime.sides["decode"].client.failures.get("timeout") == WAITED_STRIKES


def test_room_aborted_by_commit_is_skipped(worlds, patched):
    runtime, sink, _ = patched
    prefill, decode = worlds
    send_room(prefill)
    dreq = _with_receiver(pdworld.decode_req(ROOM + 1, DECODE_ROW))  # the row carries another room
    kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
    pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
    pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert (record["verdict"], record["reason"]) == ("skipped", "aborted")


@pytest.mark.skipif(not pdworld.HAS_VERIFY_KV_CHECKSUMS,
                    reason="no `_verify_kv_checksums` before SGLang 0.5.21: enforce observes only there (docs/releases.md)")
@pytest.mark.parametrize("abort_raises", [False, True, "finished"], ids=["abort", "abort_raises", "abort_raises_finished"])
def test_enforce_drops_mismatching_room_and_keeps_the_rest(worlds, abort_raises):
    """A room whose SGLang abort raised (by design where SGLANG_IS_IN_CI is set) is finished by
    SGLang as an abort after this step (`to_finish`: answered with the error, freed): it was
    kept and served (and, taken out of the batch unanswered, never answered nor freed). Kept
    in the batch, it is barred from the prefix cache: SGLang's prebuilt step checkpoints each
    room of the batch into it, and later rooms matching that prefix would reuse the corrupt
    bytes unjudged (found by review). An abort that raised after finishing the room takes it
    out of the batch (SGLang's step would assert on checkpointing a finished room)."""
    with _enforcing() as (runtime, sink):
        prefill, decode = worlds
        good = _decode_flow(worlds, (runtime, sink, None))
        side = runtime.sides["decode"]
        bad = SimpleNamespace(req=SimpleNamespace(rid="other", bootstrap_room=7, skip_radix_cache_insert=False))
        bad.req.finished = lambda: getattr(bad.req, "finished_reason", None) is not None
        pending = SimpleNamespace(ready=lambda: True, wait=lambda: True, done=None,
                                  room_digests=np.array([5], dtype=np.uint64), whole_room_digest=lambda i=0: 5)
        bad.req._dsv4_idxk_recv = (pending, InbandDigest(6, side.signature, 10), 10)
        # A receipt digest whose device call failed: its cells were never written, so
        # it is not judged (kept), whatever they hold.
        failed = SimpleNamespace(req=SimpleNamespace(rid="failed", bootstrap_room=8))
        broken = SimpleNamespace(ready=lambda: False, wait=lambda: False, done=None,
                                 room_digests=np.array([5], dtype=np.uint64), whole_room_digest=lambda i=0: 5)
        failed.req._dsv4_idxk_recv = (broken, InbandDigest(6, side.signature, 10), 10)
        aborted, kept = [], []

        def abort(req, msg):
            aborted.append(req.rid)
            if abort_raises == "finished":
                req.finished_reason = "aborted"  # SGLang's `prepare_abort` ran, then something after it raised
            if abort_raises:
                raise RuntimeError(msg)

        scheduler = pdworld.standin(
            pdworld.scheduler_class(), kv_checksum_computer=None, attn_tp_cpu_group=None,
            _handle_kv_checksum_mismatch=abort,
        )
        batch = SimpleNamespace(reqs=[good.req, bad.req, failed.req], filter_batch=lambda keep_indices: kept.extend(keep_indices))
        scheduler._verify_kv_checksums(batch)
        finish = getattr(bad.req, "to_finish", None)
        if abort_raises == "finished":
            assert (aborted, kept, finish, bad.req.skip_radix_cache_insert) == (["other"], [0, 2], None, False)
        elif abort_raises:
            assert (aborted, kept) == (["other"], [])  # kept in the batch: every rank alike
            assert (type(finish).__name__, finish.message, int(finish.status_code)) == (
                "FINISH_ABORT", "KV checksum mismatch", 500)
            assert bad.req.skip_radix_cache_insert is True
        else:
            assert (aborted, kept, finish) == (["other"], [0, 2], None)


@pytest.mark.skipif(not pdworld.HAS_VERIFY_KV_CHECKSUMS,
                    reason="no `_verify_kv_checksums` before SGLang 0.5.21: enforce observes only there (docs/releases.md)")
def test_enforce_never_drops_a_room_whose_receipt_digest_could_not_read_its_rows(worlds):
    """A page id past decode's index-K buffers (a probe fault): the monitor records
    `not_comparable`, and enforce dropped the room on the digest's random value (found by
    review). A probe fault never aborts a request: it is kept, not judged."""
    with _enforcing() as (runtime, sink):
        prefill, decode = worlds
        send_room(prefill)
        pdworld.transfer_index_k(prefill, decode)
        dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
        kv_indices = decode.req_to_token_pool.req_to_token[
            1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS].clone()
        kv_indices[2 * pdworld.PAGE :] += 40 * pdworld.PAGE  # the last page's ids past the 12-page buffers
        pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
        pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
        pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
        aborted, kept = [], []
        scheduler = pdworld.standin(pdworld.scheduler_class(), kv_checksum_computer=None, attn_tp_cpu_group=None,
                                    waiting_queue=[], _handle_kv_checksum_mismatch=lambda req, msg: aborted.append(req.rid))
        scheduler._verify_kv_checksums(SimpleNamespace(reqs=[dreq.req], filter_batch=lambda keep_indices: kept.append(1)))
        record = sink.wait_for(1, stage="decode_recv")[0]
        assert record["verdict"] == "not_comparable"
        assert (aborted, kept, scheduler.waiting_queue) == ([], [], [])


@pytest.mark.parametrize("agreed", [True, False], ids=["agreed", "not_agreed"])
def test_enforce_prefetches_a_digest_that_did_not_ride_in_band_only_where_the_ranks_agreed(worlds, monkeypatch, agreed):
    """A rank whose group turned enforce off never reads a prefetched answer: fetching it
    anyway cost every room a second fetch (the monitor asks on its own) and filled the table."""
    runtime, sink, registry = make_runtime(mode="enforce")
    started = []
    monkeypatch.setattr(pd_decode, "prefetch", lambda side, key: started.append(key))
    targets = [t for t in load_targets(["sglang"]) if t.name.startswith("pd.")]
    runtime.patcher = patcher = Patcher(runtime, targets, route="wrapt")
    patcher.patch()
    try:
        prefill, decode = worlds
        send_room(prefill)
        pdworld.transfer_index_k(prefill, decode)
        dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
        kv_indices = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
        pdworld.publish_pages(runtime, decode, dreq, kv_indices, decode_prefix_len=pdworld.PREFIX_TOKENS)
        pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
        row = metadata_row(decode.metadata, DECODE_ROW)
        row[row_slot_plan(row).digest] = 0  # the digest was not ready when the aux data left
        runtime.sides["decode"].enforce_agreed = agreed
        pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
        assert started == ([f"{ROOM}/0"] if agreed else [])
    finally:
        patcher.unpatch()
        runtime.close()


def test_retracted_room_is_skipped_and_forgotten(worlds, patched):
    runtime, sink, _ = patched
    dreq = _decode_flow(worlds, patched)
    sink.wait_for(1, stage="decode_recv")
    retract = pd_decode.make_retract_wrapper(runtime)
    result = ([dreq.req], 0.5, [])
    assert retract(lambda: result, None, (), {}) is result
    record = sink.wait_for(1, verdict="skipped")[0]
    assert (record["stage"], record["reason"]) == ("decode_step", "retracted")
    assert runtime.sides["decode"].monitor.tracked() == 0


@pytest.mark.parametrize("module", ["sglang.srt.managers.scheduler", "sglang.srt.disaggregation.decode"])
def test_room_aborted_outside_a_batch_gets_its_finish_and_is_forgotten(worlds, patched, module):
    """SGLang frees a received room outside the batch result processor when a client aborts
    it while it waits in decode's queue (the scheduler's abort) or when its KV checksum
    drops it (the transfer queue): both set the abort's finish reason, then call their own
    module's `release_kv_cache`. The room gets its finish digest there, before the free,
    and leaves the tracking table (before, it stayed until the table evicted it)."""
    runtime, sink, _ = patched
    dreq = _decode_flow(worlds, patched)
    sink.wait_for(1, stage="decode_recv")
    dreq.req.finished_reason = "FINISH_ABORT"
    try:  # through the module's own binding, as SGLang calls it; the stand-in request is not
        importlib.import_module(module).release_kv_cache(dreq.req, None, checkpoint=True)
    except Exception:  # one SGLang's release can free: what it raises after the hook is its own
        pass
    finish = sink.wait_for(1, stage="decode_finish")
    assert [r["verdict"] for r in finish] == ["match"]
    assert runtime.sides["decode"].monitor.tracked() == 0


def test_room_released_unfinished_is_retired_as_retracted_once(worlds, patched):
    """`retract_all` (generation paused with mode "retract") frees running rooms through
    schedule_batch's `release_req`, which no `retract_decode` hook sees: the release hook
    retires an unfinished room as retracted; `retract_decode`'s own hook then finds it gone."""
    runtime, sink, _ = patched
    dreq = _decode_flow(worlds, patched)
    sink.wait_for(1, stage="decode_recv")
    import sglang.srt.managers.schedule_batch as schedule_batch

    monitor = runtime.sides["decode"].monitor
    try:
        schedule_batch.release_kv_cache(dreq.req, None, checkpoint=False)
    except Exception:  # the stand-in request, as above
        pass
    _collected(monitor)
    assert monitor.tracked() == 0  # retired by the release, before any retract hook
    retract = pd_decode.make_retract_wrapper(runtime)
    retract(lambda: ([dreq.req], 0.5, []), None, (), {})
    _collected(monitor)
    skipped = [(r["stage"], r["reason"]) for r in sink.records if r.get("verdict") == "skipped"]
    assert skipped == [("decode_step", "retracted")]


def _collected(monitor) -> None:
    """Wait until the monitor's collector has done everything posted so far."""
    collected(monitor.engine, timeout_s=30)


def test_room_finished_at_once_gets_its_finish_digest(worlds, patched):
    runtime, sink, _ = patched
    dreq = _decode_flow(worlds, patched)
    dreq.req.finished_reason = "FINISH_LENGTH"  # max_new_tokens=1: done at the prebuilt batch
    prebuilt = pd_decode.make_prebuilt_result_wrapper(runtime)
    prebuilt(lambda *a, **k: None, None, (SimpleNamespace(reqs=[dreq.req]),), {})
    assert sink.wait_for(1, stage="decode_finish")[0]["verdict"] == "match"


@pytest.mark.parametrize("exchange, expect_server", [
    ({"bind": ""}, None),
    ({"bind": "127.0.0.1", "port_base": 0}, "any"),
    ({"bind": "auto"}, "any"),  # the KV manager's address (127.0.0.1 in this world)
    ({"enabled": False}, None),
])
def test_exchange_binds_only_where_configured(worlds, exchange, expect_server):
    prefill, _ = worlds
    runtime, _, _ = make_runtime(exchange={"timeout_ms": 100, **exchange})
    try:
        side = pd_prefill.prefill_side(runtime, prefill.scheduler)
        if expect_server is None:
            assert side.server is None and side.endpoint_slot == 0
        else:
            assert side.server.bind == "127.0.0.1" and side.server.port > 0
            assert side.endpoint_slot != 0
    finally:
        runtime.close()


def test_port_base_plus_gpu_id(worlds):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    prefill, _ = worlds
    prefill.scheduler.disagg_prefill_bootstrap_queue.gpu_id = 3
    runtime, _, _ = make_runtime(exchange={"bind": "127.0.0.1", "port_base": base - 3})
    try:
        assert pd_prefill.prefill_side(runtime, prefill.scheduler).server.port == base
    finally:
        runtime.close()




# %% findings of the SGLang-in-the-loop review


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA,
                    reason="host-receive (destination=HOST) arrives with _send_kv_metadata in SGLang 0.5.21")
def test_host_received_room_is_not_digested_at_host_page_ids(worlds, patched):
    """Finding 1: with host-receive, `_send_kv_metadata` names HOST pool indices
    (destination=HOST); digesting device rows at those ids reads the wrong pages,
    or past the device pool. The room is recorded as skipped, with the reason."""
    prefill, decode = worlds
    runtime, sink, _ = patched
    send_room(prefill)
    dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
    host_indices = torch.arange(40 * pdworld.PAGE, 40 * pdworld.PAGE + pdworld.ROOM_TOKENS, dtype=torch.int64)
    host = SimpleNamespace(name="HOST", value="host")  # KVTransferDestination.HOST
    pdworld.prealloc_queue(decode)._send_kv_metadata(dreq, host_indices, pdworld.PAGE, None, decode_prefix_len=0,
                                                     destination=host)
    pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    record = sink.wait_for(1, stage="decode_recv")[0]
    assert (record["verdict"], record["reason"]) == ("skipped", pd_decode.HOST_RECEIVE)
    assert runtime.sides["decode"].monitor.tracked() == 0


def _hisparse_room(worlds, patched, device_pages):
    """Decode publishes a room as SGLang does under HiSparse (decode.py, the prealloc queue's
    publish): `kv_indices` are host rows of the C4 KV, a quarter of the room's tokens at the
    C4 page size, and index-K goes to `device_kv_indices`, the room's logical device pages."""
    prefill, decode = worlds
    runtime, sink, registry = patched
    send_room(prefill)
    pdworld.transfer_index_k(prefill, decode)
    dreq = _with_receiver(pdworld.decode_req(ROOM, DECODE_ROW))
    host_rows = torch.arange(64 * 40, 64 * 40 + pdworld.ROOM_TOKENS // 4, dtype=torch.int64)
    pdworld.prealloc_queue(decode)._send_kv_metadata(
        dreq, host_rows, 64, None, decode_prefix_len=pdworld.PREFIX_TOKENS,
        device_kv_indices=np.array(device_pages, dtype=np.int32))
    pdworld.aux_transfer(prefill, decode, PREFILL_ROW, DECODE_ROW)
    pdworld.transfer_queue(decode)._commit_transfer_to_req(dreq)
    return sink.wait_for(1, stage="decode_recv")[0], registry


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA,
                    reason="before 0.5.21 the probe reads a room's pages off req_to_token (HiSparse's logical pages)")
def test_a_hisparse_room_is_digested_over_its_whole_length_at_its_device_pages(worlds, patched):
    """HiSparse's `kv_indices` say nothing of the room's length: taken as its length, decode
    digested a quarter of the room and judged every room not_comparable."""
    record, registry = _hisparse_room(worlds, patched, pdworld.DECODE_PAGES[1:])
    assert (record["verdict"], record["digest"]["n_tokens"]) == ("match", pdworld.ROOM_TOKENS), record


@pytest.mark.skipif(not pdworld.HAS_SEND_KV_METADATA,
                    reason="before 0.5.21 the probe reads a room's pages off req_to_token (HiSparse's logical pages)")
def test_hisparse_device_pages_that_do_not_cover_the_room_are_skipped_with_the_reason(worlds, patched):
    record, _ = _hisparse_room(worlds, patched, pdworld.DECODE_PAGES[1:3])
    assert record["verdict"] == "skipped" and record["reason"].startswith("HiSparse device pages (2)"), record


def test_finish_digest_is_taken_before_release_frees_the_pages(worlds, patched):
    """Finding 2: `decode_finish` is enqueued in a before-hook on release_kv_cache,
    so a writer of the freed pages (a reused page's transfer) cannot change it."""
    prefill, decode = worlds
    runtime, sink, _ = patched
    dreq = _decode_flow(worlds, patched)
    sink.wait_for(1, stage="decode_recv")
    dreq.req.finished_reason = "FINISH_LENGTH"
    release = pd_decode.make_release_wrapper(runtime)

    def release_and_reuse(req, tree_cache):  # SGLang frees; the next room's transfer lands at once
        for buf in decode.index_k:
            buf[pdworld.DECODE_PAGES[1:]] = 0

    release(release_and_reuse, None, (dreq.req, None), {})
    step = pd_decode.make_decode_step_wrapper(runtime)
    step(lambda *a, **k: None, None, (SimpleNamespace(reqs=[dreq.req]), None), {})  # the batch hook after it
    finish = sink.wait_for(1, stage="decode_finish")
    assert [r["verdict"] for r in finish] == ["match"]


def test_retracted_rooms_digest_still_running_is_skipped_not_judged(worlds, patched, monkeypatch):
    """Finding 2, retraction: a step digest still in flight when the room is retracted
    read pages that are freed now; its verdict would be about another room's bytes."""
    runtime, sink, _ = patched
    dreq = _decode_flow(worlds, patched)
    sink.wait_for(1, stage="decode_recv")
    monitor = runtime.sides["decode"].monitor
    held = []
    real_submit = monitor.engine.submit

    def late_submit(requests, on_done):  # the digest runs only after the retraction
        pending = real_submit(requests, lambda batch: held.append((on_done, batch)))
        monkeypatch.setattr(type(pending), "ready", lambda self: False, raising=False)
        return pending

    monkeypatch.setattr(monitor.engine, "submit", late_submit)
    monitor.batch_done([], [(dreq.req._dsv4_idxk_room, 1)])
    pd_decode.make_retract_wrapper(runtime)(lambda: ([dreq.req], 0.5, []), None, (), {})
    for wait in range(200):
        if held:
            break
        time.sleep(0.01)
    on_done, batch = held[0]
    on_done(batch)
    steps = sink.wait_for(2, stage="decode_step")
    assert sorted(r["verdict"] for r in steps) == ["skipped", "skipped"]
    assert any("before this digest ran" in r["reason"] for r in steps)


def test_a_scheduler_without_the_pd_queue_is_not_applicable_not_an_error(worlds):
    """Finding 8: accessor misses are counted as "not applicable", never as probe errors."""
    from dsv4_idxk_probe import safety

    runtime, sink, _ = make_runtime()
    try:
        before = safety.error_counts()
        scheduler = SimpleNamespace(disagg_metadata_buffers=SimpleNamespace())  # no queue, no bootstrap_room rows
        req = pdworld.prefill_req(ROOM, PREFILL_ROW)
        pd_prefill.on_last_chunk(runtime, scheduler, req, None)
        assert pd_decode.decode_side(runtime, SimpleNamespace()) is None
        assert safety.error_counts() == before
        assert runtime.not_applicable_counts == {"prefill.side": 1, "decode.side": 1}
    finally:
        runtime.close()
