"""What differs between SGLang releases, against the release under test (the CI
matrix runs this module on each of 0.5.18-0.5.23): the table chosen for it,
decode's pages before `_send_kv_metadata` existed, a commit that reports "not
ready", and in-band slots that step aside from SGLang's own.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

import pdworld
from pd_testkit import make_runtime

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, shipped_layouts
from dsv4_idxk_probe.pd import InbandDigest
from dsv4_idxk_probe.sglang import accessors, pd_decode, pd_prefill
from dsv4_idxk_probe.sglang.index_k import choose_layout, dsv4_pool, index_k_geometry
from dsv4_idxk_probe.sglang.targets import (
    TargetFileError, installed_sglang, parse_target_table, release_tuple, resolve, select_table,
)

ROOM, DECODE_ROW = 5150, 1


# %% the table for each release


def test_the_installed_release_gets_its_own_entries_and_all_resolve():
    selection = select_table("sglang")
    assert selection.release == installed_sglang() and selection.tested
    names = [t.name for t in selection.targets]
    assert len(names) == len(set(names))
    assert all(resolve(t).ok for t in selection.targets), [(t.name, resolve(t).detail) for t in selection.targets]


#: Before 0.5.23 every backend's own `send` starts with `_prepare_send_indices`
#: (CommonKVSender.send is empty there); from 0.5.23 they all go through CommonKVSender.send.
OLD_SENDER = ("CommonKVSender._prepare_send_indices", 3)


@pytest.mark.parametrize("release, has, lacks, sender", [
    ("0.5.18", {"pd.preallocated"}, {"pd.send_kv_metadata", "pd.verify_kv_checksums", "hicache.backup_tokens"}, OLD_SENDER),
    ("0.5.20", {"pd.preallocated"}, {"pd.send_kv_metadata", "pd.verify_kv_checksums", "hicache.backup_tokens"}, OLD_SENDER),
    ("0.5.21", {"pd.send_kv_metadata", "pd.verify_kv_checksums"}, {"pd.preallocated", "hicache.backup_tokens"}, OLD_SENDER),
    ("0.5.22", {"pd.send_kv_metadata", "pd.verify_kv_checksums"}, {"pd.preallocated", "hicache.backup_tokens"}, OLD_SENDER),
    ("0.5.23", {"pd.send_kv_metadata", "hicache.backup_tokens"}, {"pd.preallocated"}, ("CommonKVSender.send", 5)),
])
def test_each_release_table_chooses_its_hook_points(release, has, lacks, sender):
    for name in (f"sglang@{release}", f"sglang-{release}"):
        selection = select_table(name)
        names = {t.name for t in selection.targets}
        assert has <= names and not (lacks & names), (release, names)
        (send,) = [t for t in selection.targets if t.name == "pd.sender_send"]
        assert (send.qualname, len(send.params)) == sender
        absent = {t.name for t in selection.absent}
        assert lacks <= absent and all(t.cost for t in selection.absent if t.name in lacks)
    fork = {t.name for t in select_table(f"fork-prefill2-decode2@{release}").targets}
    assert {n for n in has if n.startswith("pd.")} <= fork


def test_a_release_the_table_does_not_list_is_refused_by_name():
    with pytest.raises(TargetFileError, match=r"no table for SGLang '0.5.17'; this table lists 0.5.18, "):
        select_table("sglang@0.5.17")


def test_an_unlisted_installed_release_is_served_and_flagged_untested():
    selection = select_table("sglang", installed="0.5.24")
    assert not selection.tested and "pd.send_kv_metadata" in {t.name for t in selection.targets}


ENTRY = "  - {{name: a, module: m, qualname: C.f, kind: after, hook: 'dsv4_idxk_probe.sglang.x:make_f_wrapper', required: true, role: any{extra}}}\n"


def test_entries_sharing_a_name_need_disjoint_ranges():
    text = "releases: ['0.5.20', '0.5.21']\ntargets:\n" + ENTRY.format(extra=", sglang: '>=0.5.20'") + ENTRY.format(
        extra=", sglang: '<0.5.22'")
    with pytest.raises(TargetFileError, match=r"t.yaml:4: target name 'a' also applies at t.yaml:3 for SGLang 0.5.20"):
        parse_target_table(text, "t.yaml")
    text = "targets:\n" + ENTRY.format(extra=", sglang: '>=0.5.21'") + ENTRY.format(extra=", sglang: '<0.5.21'")
    assert [t.sglang for t in parse_target_table(text, "t.yaml", release="0.5.20")] == ["<0.5.21"]


def test_a_bad_range_names_file_line_and_field():
    with pytest.raises(TargetFileError, match=r"t.yaml:2: targets\[0\] \(a\).sglang: 'about 0.5' is not a version clause"):
        parse_target_table("targets:\n" + ENTRY.format(extra=", sglang: 'about 0.5'"), "t.yaml")


def test_release_versions_parse_with_local_and_post_suffixes():
    assert release_tuple("0.5.23.post1") == release_tuple("0.5.23+fork") == (0, 5, 23)
    assert release_tuple("0.5") == (0, 5, 0) and release_tuple("unknown") is None


# %% request fields that moved between releases


def test_request_fields_are_read_where_each_release_keeps_them():
    old = SimpleNamespace(req_pool_idx=3, cache_protected_len=256, extend_range=SimpleNamespace(end=700))  # 0.5.18
    new = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=2, cache_protected_len=512), extend_end=900)  # 0.5.23
    assert (accessors.req_pool_idx(old), accessors.cache_protected_len(old), accessors.extend_end(old)) == (3, 256, 700)
    assert (accessors.req_pool_idx(new), accessors.cache_protected_len(new), accessors.extend_end(new)) == (2, 512, 900)


# %% decode: pages, and a commit that is not ready yet


def _decode_world(runtime):
    decode = pdworld.make_side(seed=2, pages=pdworld.DECODE_PAGES)
    side = pd_decode.decode_side(runtime, decode.scheduler)
    assert side is not None and side.active
    return decode, side


def _true_inband(decode, side) -> InbandDigest:
    """What prefill writes in band for these bytes: the room digest of decode's own pages."""
    geometry = index_k_geometry(dsv4_pool(decode.allocator))
    engine = DigestEngine(choose_layout(geometry, "auto", shipped_layouts()), geometry.layer_ids, geometry.buffers)
    pages = torch.tensor(pdworld.DECODE_PAGES[1:])
    digest = engine.digest_now([RoomRequest("x/0", pages, pdworld.ROOM_TOKENS)])[0]
    return InbandDigest(int(digest.room), side.signature, pdworld.ROOM_TOKENS)


def test_decode_pages_are_recorded_for_the_release(published):
    """0.5.21+: `_send_kv_metadata`; before: after `pop_preallocated`, from req_to_token."""
    runtime, sink, _ = make_runtime()
    try:
        decode, side = _decode_world(runtime)
        dreq = pdworld.decode_req(ROOM, DECODE_ROW)
        dreq.kv_receiver.send_metadata = lambda *a, **k: None
        dreq.req.time_stats.set_decode_transfer_queue_entry_time = lambda: None
        kv = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
        if pdworld.HAS_SEND_KV_METADATA:
            queue = pdworld.prealloc_queue(decode)
            wrapper = pd_decode.make_send_kv_metadata_wrapper(runtime)
            wrapper(queue._send_kv_metadata, queue, (dreq, kv, pdworld.PAGE, None), {"decode_prefix_len": pdworld.PREFIX_TOKENS})
        else:
            pdworld.publish_pages(runtime, decode, dreq, kv)
        dest = getattr(dreq, accessors.ATTR_DEST)
        assert dest.pages.tolist() == pdworld.DECODE_PAGES[1:] and dest.n_tokens == pdworld.ROOM_TOKENS
    finally:
        runtime.close()


def test_decode_hook_waits_for_a_commit_that_reports_not_ready(published):
    """Upstream after 0.5.23: `_commit_transfer_to_req` returns False for "not ready,
    keep it in the queue" and leaves the row as it was. The probe must not digest
    then; it digests once, at the commit that goes through (SGLang's real one here)."""
    runtime, sink, _ = make_runtime()
    try:
        decode, side = _decode_world(runtime)
        dreq = pdworld.decode_req(ROOM, DECODE_ROW)
        dreq.kv_receiver.send_metadata = lambda *a, **k: None
        kv = decode.req_to_token_pool.req_to_token[1, pdworld.PREFIX_TOKENS : pdworld.PREFIX_TOKENS + pdworld.ROOM_TOKENS]
        setattr(dreq, accessors.ATTR_DEST, pd_decode.decode_room_pages(kv, pdworld.PAGE, {"decode_prefix_len": pdworld.PREFIX_TOKENS}))
        row = decode.metadata.bootstrap_room[DECODE_ROW].numpy().view(np.uint64)
        row[0] = ROOM
        plan = accessors.row_slot_plan(row)
        row[plan.digest] = np.array(_true_inband(decode, side).to_slots(), dtype=np.uint64)
        decode.metadata.output_ids[DECODE_ROW][0] = 42
        transfer_queue = pdworld.transfer_queue(decode)
        calls = []

        def upstream_commit(decode_req):
            calls.append(decode_req)
            if len(calls) == 1:
                return False  # not ready: nothing cleared, nothing committed
            type(transfer_queue)._commit_transfer_to_req(transfer_queue, decode_req)  # SGLang's own commit
            return True

        wrapper = pd_decode.make_commit_transfer_wrapper(runtime)
        assert wrapper(upstream_commit, transfer_queue, (dreq,), {}) is False
        assert getattr(dreq.req, pd_decode.ATTR_ROOM, None) is None and side.monitor.tracked() == 0
        assert not [r for r in sink.records if r.get("stage") == "decode_recv"]
        assert wrapper(upstream_commit, transfer_queue, (dreq,), {}) is True
        record = sink.wait_for(1, stage="decode_recv")[0]
        assert record["verdict"] == "match" and dreq.req.output_ids == [42]
        assert side.monitor.tracked() == 1 and len([r for r in sink.records if r.get("stage") == "decode_recv"]) == 1
    finally:
        runtime.close()


# %% in-band slots: never one SGLang uses


class _Ready:
    room_digests = np.array([0xABCDEF], dtype=np.uint64)

    def ready(self):
        return True

    def whole_room_digest(self, i=0):
        return int(self.room_digests[i])


@pytest.fixture
def upstream_checksum_slots(monkeypatch):
    """Upstream's newer kv_checksum.py: bootstrap_room slots 1-3 carry SGLang's own KV digest."""
    module = ModuleType(accessors.KV_CHECKSUM_MODULE)
    module.ROOM_SLOT_CHECKSUM_SIG, module.ROOM_SLOT_CHECKSUM_DIGEST, module.ROOM_SLOT_CHECKSUM_TOKENS = 1, 2, 3
    monkeypatch.setitem(sys.modules, accessors.KV_CHECKSUM_MODULE, module)
    accessors._PLANS.clear()
    yield
    accessors._PLANS.clear()


def _prefill_write(row, endpoint=0x1234):
    """Prefill's row handling: clear its own slots on a reused row, endpoint, then the digest."""
    scheduler = SimpleNamespace(disagg_metadata_buffers=SimpleNamespace(bootstrap_room=row), disagg_prefill_bootstrap_queue=None)
    runtime = SimpleNamespace(sides={}, not_applicable=lambda *a: None)
    pd_prefill.on_last_chunk(runtime, scheduler, SimpleNamespace(metadata_buffer_index=0), None)  # clears, no side
    view = row[0].numpy().view(np.uint64)
    plan = accessors.row_slot_plan(view)
    if plan.endpoint is not None:
        view[plan.endpoint] = endpoint
    if plan.digest is not None:
        pd_prefill.InbandWrite(_Ready(), view, signature=77, n_tokens=612).commit()
    return plan


def _metadata_row():
    """A real MetadataBuffers bootstrap_room row of the release under test."""
    from sglang.srt.disaggregation.utils import MetadataBuffers

    metadata = MetadataBuffers(size=2, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)
    return metadata.bootstrap_room[:1]


def test_inband_slots_of_the_installed_release_leave_sglangs_room_alone():
    accessors._PLANS.clear()
    row = _metadata_row()
    view = row[0].numpy().view(np.uint64)
    view[:] = np.arange(100, 100 + len(view), dtype=np.uint64)
    plan = _prefill_write(row)
    assert int(view[0]) == 100  # SGLang's room, untouched
    assert plan.digest == slice(1, 5) and plan.endpoint == 5  # no kv_checksum slots in 0.5.18-0.5.23
    assert [int(v) for v in view[6:]] == list(range(106, 100 + len(view)))
    seen = pd_decode.before_commit(SimpleNamespace(metadata_buffers=SimpleNamespace(bootstrap_room=row)),
                                   SimpleNamespace(metadata_buffer_index=0, kv_receiver=None))
    assert InbandDigest.from_slots(seen[0]) == InbandDigest(0xABCDEF, 77, 612) and seen[1] == 0x1234


def test_inband_write_never_touches_a_slot_sglang_uses(upstream_checksum_slots):
    row = _metadata_row()
    view = row[0].numpy().view(np.uint64)
    sglang_values = [ROOM, 0x5151, 0x5252, 612]  # room, checksum signature, digest, tokens
    view[:] = 0
    view[:4] = sglang_values
    plan = _prefill_write(row)
    assert [int(v) for v in view[:4]] == sglang_values  # cleared, written, and SGLang's slots are as SGLang left them
    assert plan.digest == slice(4, 8) and plan.endpoint is None  # no room left for the endpoint: the exchange finds it
    seen = pd_decode.before_commit(SimpleNamespace(metadata_buffers=SimpleNamespace(bootstrap_room=row)),
                                   SimpleNamespace(metadata_buffer_index=0, kv_receiver=None))
    assert InbandDigest.from_slots(seen[0]) == InbandDigest(0xABCDEF, 77, 612) and seen[1] is None


def test_a_row_with_no_four_free_slots_carries_the_digest_out_of_band_only():
    plan = accessors.SlotPlan(8, {0, 1, 3, 5, 7})
    assert plan.digest is None and plan.endpoint == 2 and plan.probe_slots == [2]
