"""Every index pool of a DeepSeek-V4.1 pool (SGLang 0.5.23's real pool on CPU):
listed with its layout, digested on both PD sides, compared per pool; pools the
probe cannot read are counted unverified and a side that reads nothing says so."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import v41world
from pd_testkit import collected, make_runtime

from dsv4_idxk_probe.digest import shipped_layouts
from dsv4_idxk_probe.exchange.endpoint import pack_endpoint
from dsv4_idxk_probe.exchange.stages import StageEndpoints
from dsv4_idxk_probe.pd import RoomId
from dsv4_idxk_probe.sglang.index_k import index_pools, indexer_row_buffers, room_pool_pages
from dsv4_idxk_probe.sglang.pool_sides import fetch_pool_digest, pool_key
from dsv4_idxk_probe.sglang.sides import InactiveSide, build_side

ROOM = 77


@pytest.fixture(scope="module")
def v41(published):
    return v41world.make_pool(seed=1), v41world.make_pool(seed=2)


def test_every_index_pool_is_listed_with_its_layout_and_wire_entry(v41):
    pool = v41[0]
    listed = index_pools(pool, shipped_layouts(), v41world.kv_args_of(pool))
    assert [p.ratio for p in listed] == [4, 1, 2]
    assert all(p.readable for p in listed), [p.reason for p in listed]
    by_ratio = {p.ratio: p for p in listed}
    assert [by_ratio[r].layout.name for r in (4, 1, 2)] == ["fp8", "fp4_r1", "fp4_r2"]
    assert [by_ratio[r].geometry.layer_ids for r in (4, 1, 2)] == [(1, 3), (4,), (5,)]
    assert [by_ratio[r].geometry.row_bytes for r in (1, 2)] == [4352, 4352]
    assert [by_ratio[r].geometry.rows_per_page for r in (4, 1, 2)] == [1, 4, 2]
    # the PD wire: [C4 KV x2, C4 indexer x2, C128 KV, r1 KV, r1 indexer, r2 KV, r2 indexer]
    assert [by_ratio[r].geometry.wire for r in (4, 1, 2)] == [(2, 3), (6,), (8,)]
    assert by_ratio[1].geometry.fp4 and by_ratio[2].geometry.fp4
    assert "fp4_r1" in by_ratio[1].describe() and "4352 B rows" in by_ratio[1].describe()


def test_a_full_page_is_its_run_of_low_ratio_rows_computed_on_the_device():
    pages = torch.tensor([5, 2], dtype=torch.int64)
    assert room_pool_pages(pages, 4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    assert room_pool_pages(pages, 1) is pages
    assert room_pool_pages([3], 2) == [6, 7]


def test_aiter_page8_low_ratio_pool_is_listed_unreadable_with_its_bytes(v41):
    pool = v41[0]
    pool.index_pools[1].index_k_page8 = True
    try:
        listed = {p.ratio: p for p in index_pools(pool, shipped_layouts())}
    finally:
        pool.index_pools[1].index_k_page8 = False
    assert not listed[1].readable and "page-8" in listed[1].reason and listed[1].code == "layout_unknown"
    assert listed[1].bytes_per_page == 4 * 4352  # one layer, four 64-slot rows per full page
    assert listed[4].readable and listed[2].readable


def _sides(v41, **config):
    prefill_pool, decode_pool = v41
    runtime, sink, registry = make_runtime(**config)
    prefill = build_side(runtime, "prefill", prefill_pool, v41world.kv_args_of(prefill_pool), host="127.0.0.1")
    decode = build_side(runtime, "decode", decode_pool, v41world.kv_args_of(decode_pool))
    return runtime, sink, registry, prefill, decode


def _sides_r1_unreadable(v41):
    """`_sides`, decode's ratio-1 pool built in aiter's page-8 row-group order, which no
    layout describes: decode cannot read that pool."""
    decode_pool = v41[1]
    decode_pool.index_pools[1].index_k_page8 = True
    try:
        return _sides(v41)
    finally:
        decode_pool.index_pools[1].index_k_page8 = False


def _room_flow(prefill, decode, stages: bool = False):
    """A room sent and received. `stages`: decode remembers prefill as the stages of a PP
    prefill (`pd_decode.prefill_endpoint`, with the C4 pool's layout), here one stage."""
    n = v41world.ROOM_TOKENS
    prefill.monitor.room_sent(RoomId(ROOM), v41world.sent_tokens(v41world.PREFILL_PAGES[1:], n), n)
    endpoint = ("127.0.0.1", prefill.server.port)
    decode.remember_peer(RoomId(ROOM).key, StageEndpoints([endpoint], decode.layout) if stages else endpoint)
    decode.monitor.room_received(RoomId(ROOM), torch.tensor(v41world.DECODE_PAGES[1:]), n, None, {"rid": "r"})


def _sample(registry, name, **labels):
    """The sum of `name`'s samples whose labels include `labels` (the process labels aside)."""
    return sum(sample.value for metric in registry.collect() for sample in metric.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def _coverage(registry, outcome, reason):
    return _sample(registry, "dsv4_idxk_probe_coverage_bytes_total", path="pd", outcome=outcome, reason=reason)


def test_the_prefill_exchange_answers_each_pools_digest(v41):
    runtime, sink, _, prefill, decode = _sides(v41)
    try:
        prefill.monitor.room_sent(RoomId(ROOM), v41world.sent_tokens(v41world.PREFILL_PAGES[1:], v41world.ROOM_TOKENS),
                                  v41world.ROOM_TOKENS)
        sink.wait_for(2, stage="prefill_send", kind="index_pool")
        sink.wait_for(1, stage="prefill_send", kind="room")
        decode.remember_peer(RoomId(ROOM).key, ("127.0.0.1", prefill.server.port))
        c4 = decode.fetch(RoomId(ROOM).key)
        r1_layout = next(p.pool.layout for p in decode.pool_sides if p.ratio == 1)
        r1 = fetch_pool_digest(decode, pool_key(RoomId(ROOM).key, 1), r1_layout)
        assert (c4.layer_ids, r1.layer_ids) == ((1, 3), (4,))
        assert r1.n_pages == 12  # three full pages, four rows each
    finally:
        runtime.close()


@pytest.mark.parametrize("ratio, row, offset, segment", [
    (1, 5, 10, "payload"),  # full page 1, its second 64-token row
    (2, 4, 64 * 64 + 4 * 17, "scale"),  # the tail page's first row, slot 17's scale
])
def test_a_fault_in_a_low_ratio_pool_is_found_in_that_pool_with_its_cell(v41, ratio, row, offset, segment):
    prefill_pool, decode_pool = v41
    v41world.transfer(prefill_pool, decode_pool)
    k = v41world.rows_per_page(decode_pool, ratio)
    physical = v41world.DECODE_PAGES[1 + row // k] * k + row % k
    indexer_row_buffers(decode_pool.index_pools[ratio])[0][physical, offset] ^= 0x10
    runtime, sink, _, prefill, decode = _sides(v41)
    try:
        _room_flow(prefill, decode)
        c4 = sink.wait_for(1, stage="decode_recv", kind="room")[0]
        pools = {r["pool"]: r for r in sink.wait_for(2, stage="decode_recv", kind="index_pool")}
    finally:
        runtime.close()
        v41world.transfer(prefill_pool, decode_pool)  # the next test starts clean
    assert c4["verdict"] == "match" and "pool" not in c4  # the C4 pool's records read as before
    other = 3 - ratio
    assert pools[other]["verdict"] == "match", pools[other]
    bad = pools[ratio]
    assert (bad["verdict"], bad["layout"]) == ("mismatch", f"fp4_r{ratio}")
    loc = bad["localisation"]
    assert (loc["pool"], loc["layers"], loc["pages"], loc["segments"]) == (ratio, [4 if ratio == 1 else 5], [row], [segment])


@pytest.mark.parametrize("stages", [False, True], ids=["one_prefill", "pp_prefill_stages"])
def test_a_clean_v41_room_matches_in_every_pool(v41, stages):
    """With a PP prefill each pool's stage digests are combined against that pool's own
    layout (with the C4 pool's, every low-ratio pool read `not_comparable`)."""
    v41world.transfer(*v41)
    runtime, sink, registry, prefill, decode = _sides(v41)
    try:
        _room_flow(prefill, decode, stages)
        records = sink.wait_for(1, stage="decode_recv", kind="room") + sink.wait_for(
            2, stage="decode_recv", kind="index_pool")
        sent = sink.wait_for(2, stage="prefill_send", kind="index_pool")
    finally:
        runtime.close()
    assert [r["verdict"] for r in records] == ["match"] * 3
    assert sorted((r["pool"], r["layout"]) for r in sent) == [(1, "fp4_r1"), (2, "fp4_r2")]


@pytest.mark.parametrize("fault", [None, 1, 2], ids=["clean", "ratio_1_fault", "ratio_2_fault"])
def test_a_pp_prefill_whose_first_stage_has_no_low_ratio_pool_is_verified_in_every_pool(published, fault):
    """Prefill PP 2 over layers [0, 3) and [3, 6): SGLang makes the ratio-1 and ratio-2
    pools (layers 4 and 5) on the second stage only. The first answered those pools' keys
    "not found", so decode read both `unverified` (`no_exchange`) on every room, each fetch
    waiting out a retry (found by review); it now answers them with no layers."""
    stages = [v41world.make_pool(seed, layers) for seed, layers in ((1, (0, 3)), (3, (3, 6)))]
    assert set(stages[0].index_pools) == {4} and set(stages[1].index_pools) == {4, 1, 2}
    decode_pool = v41world.make_pool(2)
    v41world.transfer_stages(stages, decode_pool)
    if fault is not None:
        k = v41world.rows_per_page(decode_pool, fault)
        indexer_row_buffers(decode_pool.index_pools[fault])[0][v41world.DECODE_PAGES[2] * k, 7] ^= 0x10
    runtimes = []
    try:
        prefills = []
        for pool in stages:
            runtime, _, _ = make_runtime()
            runtimes.append(runtime)
            prefills.append(build_side(runtime, "prefill", pool, v41world.kv_args_of(pool), host="127.0.0.1"))
        runtime, sink, registry = make_runtime()
        runtimes.append(runtime)
        decode = build_side(runtime, "decode", decode_pool, v41world.kv_args_of(decode_pool))
        n = v41world.ROOM_TOKENS
        for prefill in prefills:
            prefill.monitor.room_sent(RoomId(ROOM), v41world.sent_tokens(v41world.PREFILL_PAGES[1:], n), n)
        endpoints = StageEndpoints([("127.0.0.1", p.server.port) for p in prefills], decode.layout)
        for prefill in prefills:  # each stage's digests are in before decode asks
            for engine in (prefill.engine, *(side.engine for side in prefill.pool_sides)):
                collected(engine, 30)
        decode.remember_peer(RoomId(ROOM).key, endpoints)
        decode.monitor.room_received(RoomId(ROOM), torch.tensor(v41world.DECODE_PAGES[1:]), n, None, {"rid": "r"})
        c4 = sink.wait_for(1, stage="decode_recv", kind="room")[0]
        pools = {r["pool"]: r for r in sink.wait_for(2, stage="decode_recv", kind="index_pool")}
    finally:
        for runtime in runtimes:
            runtime.close()
    assert c4["verdict"] == "match"
    for ratio, record in pools.items():
        if ratio == fault:
            loc = record["localisation"]
            assert (record["verdict"], loc["pool"], loc["layers"], loc["pages"]) == ("mismatch", ratio, [3 + ratio], [k])
        else:
            assert record["verdict"] == "match", record
    assert _coverage(registry, "unverified", "no_exchange") == 0


def test_a_stage_answers_empty_only_for_a_pool_it_does_not_have_and_a_room_it_sent():
    import numpy as np

    from dsv4_idxk_probe.digest.result import RoomDigest
    from dsv4_idxk_probe.pd.prefill import RecentRooms
    from dsv4_idxk_probe.sglang.pool_sides import PoolRoutedRooms

    main = RecentRooms(8)
    main.put(RoomDigest("5/0", 9, 300, (1, 3), ("payload", "scale"), np.ones((2, 2), dtype=np.uint64),
                        np.ones(2, dtype=np.uint64)))
    routed = PoolRoutedRooms(main, {}, held=[1])  # has a ratio-1 pool it cannot read; no ratio-2 pool
    empty = routed.get("5/0@pool2")
    assert (empty.key, empty.layer_ids, empty.layer_segment.shape, empty.n_tokens) == ("5/0@pool2", (), (0, 2), 300)
    assert not empty.pages.any()
    assert routed.get("5/0@pool1") is None  # its layers are here, unread: never called empty
    assert routed.get("6/0@pool2") is None  # a room not sent (yet): not found, asked again
    assert routed.get("5/0@poolx") is None


def test_bytes_of_an_unreadable_low_ratio_pool_are_counted_unverified_per_room(v41):
    runtime, sink, registry, prefill, decode = _sides_r1_unreadable(v41)
    try:
        assert decode.active and [p.ratio for p in decode.pool_sides] == [2]
        before = _coverage(registry, "unverified", "layout_unknown")
        _room_flow(prefill, decode)
        sink.wait_for(1, stage="decode_recv", kind="index_pool")
        counted = _coverage(registry, "unverified", "layout_unknown") - before
    finally:
        runtime.close()
    assert counted == 3 * 4 * 4352  # three full pages of the ratio-1 pool's one layer


def test_a_room_skipped_before_its_receipt_counts_the_unreadable_pools_bytes_too(v41):
    """A room whose transfer failed never reaches a receipt: every readable pool counts its
    bytes `skipped` from its length, and so must the pool the side cannot read."""
    from dsv4_idxk_probe.pd.coverage import estimated_bytes

    runtime, sink, registry, prefill, decode = _sides_r1_unreadable(v41)
    n = v41world.ROOM_TOKENS
    try:
        decode.monitor.room_skipped(RoomId(ROOM), "transfer failed: peer gone", n_tokens=n)
        sink.wait_for(1, stage="decode_recv")
        engines = [decode.monitor.main.engine] + [pool.monitor.engine for pool in decode.pool_sides]
        for engine in engines:  # each engine's collector has counted its part
            collected(engine, timeout_s=10)
        readable = sum(estimated_bytes(engine, n) for engine in engines)
        counted = _coverage(registry, "skipped", "transfer_failed")
    finally:
        runtime.close()
    assert counted == readable + 3 * 4 * 4352  # three pages (the last partial) of the ratio-1 pool's one layer


def test_a_received_room_whose_commit_hook_failed_after_its_receipt_counts_the_unreadable_pools_bytes_once(v41):
    """The probe's commit hook can fail after decode's monitor took the room (the receipt
    counted the unreadable pool's bytes `unverified`): the room is retired `skipped`, and
    the unreadable pool's bytes are not counted a second time."""
    from dsv4_idxk_probe.pd.coverage import estimated_bytes
    from dsv4_idxk_probe.sglang import pd_decode

    v41world.transfer(*v41)
    runtime, sink, registry, prefill, decode = _sides_r1_unreadable(v41)
    n = v41world.ROOM_TOKENS
    req = SimpleNamespace(origin_input_ids=list(range(v41world.PREFIX_TOKENS + n)),
                          cache_protected_len=v41world.PREFIX_TOKENS, bootstrap_room=ROOM, rid="r")
    try:
        _room_flow(prefill, decode)  # the receipt, then the hook fails before the request carries the room
        sink.wait_for(1, stage="decode_recv", kind="room", verdict="match")
        engines = [decode.monitor.main.engine] + [pool.monitor.engine for pool in decode.pool_sides]
        for engine in engines:
            collected(engine, timeout_s=10)
        pd_decode.commit_failed(runtime, SimpleNamespace(scheduler=None), SimpleNamespace(req=req))
        sink.wait_for(1, stage="decode_recv", kind="room", verdict="skipped")
        for engine in engines:
            collected(engine, timeout_s=10)
        verified = _coverage(registry, "verified", "none")  # a tracked room counts once it is retired
        unread = _coverage(registry, "unverified", "layout_unknown")
        skipped = _coverage(registry, "skipped", "probe_error")
    finally:
        runtime.close()
    assert verified == sum(estimated_bytes(engine, n) for engine in engines)  # the readable pools, as received
    assert unread == 3 * 4 * 4352  # the unreadable pool, at the receipt
    assert skipped == 0  # nothing counted twice


# %% a side that reads nothing says so


def _info(registry, state, reason):
    return _sample(registry, "dsv4_idxk_probe_info", state=state, reason=reason)


def test_a_side_with_a_layout_it_cannot_read_is_inactive_and_counts_each_room_unverified(v41):
    from dsv4_idxk_probe.sglang import pd_decode

    runtime, sink, registry = make_runtime(layout="bf16")  # forced: no pool of this rig has bf16 rows
    try:
        side = build_side(runtime, "decode", v41[1], v41world.kv_args_of(v41[1]))
        assert isinstance(side, InactiveSide) and side.code == "layout_unknown"
        assert _info(registry, "inactive", "layout_unknown") == 1
        assert _info(registry, "on", "running") == 0
        n = v41world.ROOM_TOKENS
        req = SimpleNamespace(origin_input_ids=list(range(v41world.PREFIX_TOKENS + n)),
                              kv=SimpleNamespace(cache_protected_len=v41world.PREFIX_TOKENS),
                              cache_protected_len=v41world.PREFIX_TOKENS, bootstrap_room=ROOM)
        pd_decode.count_inactive_room(runtime, None, SimpleNamespace(req=req))
        # as on an active side: a health check moves no index-K; an aborted room is skipped
        pd_decode.count_inactive_room(runtime, None, SimpleNamespace(req=SimpleNamespace(**{**vars(req), "rid": "HEALTH_CHECK_1"})))
        FINISH_ABORT = type("FINISH_ABORT", (), {})
        aborted = SimpleNamespace(**{**vars(req), "finished_reason": FINISH_ABORT()})
        pd_decode.count_inactive_room(runtime, None, SimpleNamespace(req=aborted))
        # a room decode published host rows for (host receive): `host_dest`, as an active side says
        host_received = SimpleNamespace(req=req)
        pd_decode.on_send_metadata(runtime, SimpleNamespace(scheduler=None), host_received, None, 256,
                                   {"destination": SimpleNamespace(name="HOST", value="host")})
        pd_decode.count_inactive_room(runtime, None, host_received)
        counted = _coverage(registry, "unverified", "layout_unknown")
        skipped = _coverage(registry, "skipped", "aborted")
        host_dest = _coverage(registry, "skipped", "host_dest")
    finally:
        runtime.close()
    per_page = 2 * 8448 + 4 * 4352 + 2 * 4352  # C4: two layers of one 8448 B row; r1: 4 rows; r2: 2 rows
    assert counted == 3 * per_page
    assert skipped == 3 * per_page
    assert host_dest == 3 * per_page


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_side_whose_kv_manager_shares_pages_over_dcp_ranks_is_inactive_with_the_reason(v41, role):
    """With decode context parallel (the KV manager's `dcp_size` > 1) SGLang spreads each page's
    tokens over the DCP ranks, or relays prefill's pages so: the probe's whole-page digests would
    differ between the sides, a false mismatch. The side is inactive (`layout_unknown`) instead."""
    from dsv4_idxk_probe.sglang import pd_decode, pd_prefill

    runtime, sink, registry = make_runtime()
    try:
        manager = SimpleNamespace(kv_args=v41world.kv_args_of(v41[1]), dcp_size=2, local_ip="127.0.0.1",
                                  rank_port=None)
        queue = SimpleNamespace(token_to_kv_pool=v41[1], gpu_id=0, scheduler=None)
        (pd_decode if role == "decode" else pd_prefill).on_queue_init(runtime, queue, manager)
        side = runtime.sides[role]
        assert isinstance(side, InactiveSide) and side.code == "layout_unknown", side
        assert "context parallel over 2 ranks" in side.reason
        assert _info(registry, "inactive", "layout_unknown") == 1
    finally:
        runtime.close()


def test_after_a_role_switch_the_status_metric_reads_the_new_roles_side(v41):
    """SGLang's PD role switch tears the old role's queues down and builds the new role's
    (each queue's init hook runs again): the status metric follows the role the server runs,
    an inactive decode side's state does not stay on a prefill that verifies, nor the reverse."""
    from dsv4_idxk_probe.sglang import pd_decode, pd_prefill

    runtime, sink, registry = make_runtime()
    try:
        queue = SimpleNamespace(token_to_kv_pool=v41[1], gpu_id=0, scheduler=None)

        def manager(dcp):
            return SimpleNamespace(kv_args=v41world.kv_args_of(v41[1]), dcp_size=dcp, local_ip="127.0.0.1",
                                   rank_port=None)

        pd_decode.on_queue_init(runtime, queue, manager(2))  # decode cannot read its pages: inactive
        assert (_info(registry, "inactive", "layout_unknown"), _info(registry, "on", "running")) == (1, 0)
        pd_prefill.on_queue_init(runtime, queue, manager(1))  # switched to prefill, which verifies
        assert (_info(registry, "inactive", "layout_unknown"), _info(registry, "on", "running")) == (0, 1)
        pd_decode.on_queue_init(runtime, queue, manager(2))  # and back: the kept decode side's state
        assert (_info(registry, "inactive", "layout_unknown"), _info(registry, "on", "running")) == (1, 0)
    finally:
        runtime.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


PORT_OFFSET = 1000  # exchange.port_offset of the role-switch tests


def _rule_runtime():
    return make_runtime(exchange={"bind": "127.0.0.1", "timeout_ms": 200, "port_offset": PORT_OFFSET})


def _manager_for(v41, exchange_port: int) -> SimpleNamespace:
    """A KV manager whose transport port the ``port_offset`` rule maps to `exchange_port`."""
    return SimpleNamespace(kv_args=v41world.kv_args_of(v41[1]), dcp_size=1, local_ip="127.0.0.1",
                           rank_port=exchange_port - PORT_OFFSET)


def test_after_a_role_switch_the_prefill_exchange_follows_the_port_rule_to_the_new_transport_port(v41):
    """Each PD role switch makes a new KV manager on a new port, and decode rebuilds the
    exchange's port from it (``port_offset``): the kept prefill side's exchange moves there
    (it stayed on the first manager's port, and a decode with only the rule could not fetch)."""
    from dsv4_idxk_probe.sglang import pd_decode, pd_prefill

    first, second = _free_port(), _free_port()  # the exchange's ports
    runtime, sink, registry = _rule_runtime()
    try:
        queue = SimpleNamespace(token_to_kv_pool=v41[1], gpu_id=0, scheduler=None)
        pd_prefill.on_queue_init(runtime, queue, _manager_for(v41, first))
        side = runtime.sides["prefill"]
        assert _listens(first)
        pd_decode.on_queue_init(runtime, queue, _manager_for(v41, _free_port()))  # switched to decode
        pd_prefill.on_queue_init(runtime, queue, _manager_for(v41, second))  # and back, on a new manager
        assert runtime.sides["prefill"] is side
        assert (side.server.port, _listens(second), _listens(first)) == (second, True, False)
        assert side.endpoint_slot == pack_endpoint("127.0.0.1", second)
    finally:
        runtime.close()


def test_a_prefill_exchange_that_cannot_bind_the_new_port_keeps_serving_on_the_old(v41):
    """The move starts the new server before it closes the old: a taken port leaves the
    exchange where decodes that read the endpoint slot still find it (logged), not gone."""
    from dsv4_idxk_probe.sglang import pd_prefill

    first = _free_port()
    runtime, sink, registry = _rule_runtime()
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        queue = SimpleNamespace(token_to_kv_pool=v41[1], gpu_id=0, scheduler=None)
        pd_prefill.on_queue_init(runtime, queue, _manager_for(v41, first))
        side = runtime.sides["prefill"]
        pd_prefill.on_queue_init(runtime, queue, _manager_for(v41, taken.getsockname()[1]))
        assert (side.server.port, _listens(first), side.endpoint_slot) == (first, True, pack_endpoint("127.0.0.1", first))
    finally:
        taken.close()
        runtime.close()


@pytest.mark.parametrize("read_fails", [False, True], ids=["commit", "commit_read_fails"])
def test_an_inactive_side_counts_a_committed_room_even_when_the_probe_s_commit_read_fails(v41, monkeypatch, read_fails):
    """Through the commit wrapper: an inactive side counts the room at its commit, and still
    counts it when the probe's own read of the metadata row raised (SGLang's commit goes on,
    and no release of the queue comes for a committed room)."""
    from dsv4_idxk_probe.sglang import pd_decode

    runtime, sink, registry = make_runtime(layout="bf16")  # forced: no pool of this rig has bf16 rows
    try:
        side = build_side(runtime, "decode", v41[1], v41world.kv_args_of(v41[1]))
        assert isinstance(side, InactiveSide)
        if read_fails:
            monkeypatch.setattr(pd_decode, "before_commit", lambda *a, **k: 1 / 0)
        n = v41world.ROOM_TOKENS
        req = SimpleNamespace(origin_input_ids=list(range(v41world.PREFIX_TOKENS + n)),
                              kv=SimpleNamespace(cache_protected_len=v41world.PREFIX_TOKENS),
                              bootstrap_room=ROOM, rid="r", finished_reason=None)
        queue = SimpleNamespace(scheduler=None, metadata_buffers=None)
        decode_req = SimpleNamespace(req=req, metadata_buffer_index=None, kv_receiver=None)
        pd_decode.make_commit_transfer_wrapper(runtime)(lambda *a, **k: None, queue, (decode_req,), {})
        counted = _coverage(registry, "unverified", "layout_unknown")
    finally:
        runtime.close()
    assert counted == 3 * (2 * 8448 + 4 * 4352 + 2 * 4352)  # three pages of every pool, as above


@pytest.mark.parametrize("scheduler", [False, True], ids=["rule", "prealloc_queue"])
def test_an_inactive_side_counts_every_token_a_rebootstrapped_room_published(v41, scheduler):
    """SGLang 0.5.23 rebootstraps every retracted DeepSeek-V4 room and publishes its prompt and
    outputs; the commit hands the probe the transfer queue, which has no
    `_rebootstrap_prefill_len`: the prealloc queue's (through the scheduler), or the same rule,
    sizes the room, not the prompt alone."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue

    from dsv4_idxk_probe.sglang import pd_decode

    runtime, sink, registry = make_runtime(layout="bf16")  # forced: no pool of this rig has bf16 rows
    try:
        side = build_side(runtime, "decode", v41[1], v41world.kv_args_of(v41[1]))
        assert isinstance(side, InactiveSide)
        prompt, outputs = 300, 600
        req = SimpleNamespace(origin_input_ids=list(range(prompt)), output_ids=list(range(outputs)),
                              pd_rebootstrap_in_progress=True, kv=SimpleNamespace(cache_protected_len=0),
                              bootstrap_room=ROOM, rid="r", finished_reason=None)
        queue = DecodeTransferQueue.__new__(DecodeTransferQueue)  # the instance the commit wrapper gets
        prealloc = DecodePreallocQueue.__new__(DecodePreallocQueue)
        queue.__dict__.update(metadata_buffers=None,
                              scheduler=SimpleNamespace(disagg_decode_prealloc_queue=prealloc) if scheduler else None)
        decode_req = SimpleNamespace(req=req, metadata_buffer_index=None, kv_receiver=None)
        pd_decode.make_commit_transfer_wrapper(runtime)(lambda *a, **k: None, queue, (decode_req,), {})
        counted = _coverage(registry, "unverified", "layout_unknown")
    finally:
        runtime.close()
    published = DecodePreallocQueue._rebootstrap_prefill_len(req)
    assert published == prompt + outputs
    assert counted == -(-published // 256) * side.bytes_per_page  # four pages of every pool, not two


def test_an_npu_indexer_is_not_read_as_its_unwritten_packed_rows(v41):
    """NPU writes index-K to its own PA_ND buffers; the packed rows the transfer registers
    stay zero on both sides: digesting them would say match and verify nothing."""
    pool = v41[1]
    pool.index_pools[4].has_npu_storage = True  # what NPUDeepSeekV4IndexerPool answers
    runtime, sink, registry = make_runtime()
    try:
        side = build_side(runtime, "decode", pool, v41world.kv_args_of(pool))
        assert isinstance(side, InactiveSide) and "NPU indexer" in side.reason
        assert _info(registry, "inactive", "layout_unknown") == 1
    finally:
        del pool.index_pools[4].has_npu_storage
        runtime.close()
