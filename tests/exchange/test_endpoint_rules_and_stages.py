"""Where decode finds a prefill rank's exchange (issue 31) and how PP stages' digests combine.

Pure functions and a small thread pool: no SGLang, no sockets (test_pd_topologies.py runs
them through SGLang's objects and a real exchange).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dsv4_idxk_probe.config import ConfigError, parse_config
from dsv4_idxk_probe.digest import get_layout
from dsv4_idxk_probe.digest.reference import digest_room
from dsv4_idxk_probe.digest.result import RoomDigest, compare
from dsv4_idxk_probe.exchange.endpoint import pack_endpoint, rebuild_endpoint, rule_port
from dsv4_idxk_probe.exchange.prefetch import Prefetcher
from dsv4_idxk_probe.exchange.stages import StageEndpoints, combine_stage_digests, describe_endpoint
from dsv4_idxk_probe.pd.assembly import exchange_port
from dsv4_idxk_probe.pd.inband import InbandDigest, endpoint_only_slots, port_from_slots

LAYOUT = get_layout("fp8")
LAYERS = [1, 3, 5, 7]
N_TOKENS = 2 * 256 + 100


def _buffers(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(6, LAYOUT.row_bytes), dtype=np.uint8) for _ in LAYERS]


PAGES = [4, 1, 3]


# %% the header carries the port; an endpoint-only header carries no digest


def test_the_digest_header_carries_the_port_without_changing_the_digest():
    digest = InbandDigest(0xDEAD, 0xBEEF, 612)
    slots = digest.to_slots(port=43210)
    assert InbandDigest.from_slots(slots) == digest
    assert port_from_slots(slots) == 43210
    assert port_from_slots(digest.to_slots()) is None  # no server: no port


def test_an_endpoint_only_header_names_the_port_and_no_digest():
    slots = endpoint_only_slots(5555)
    assert InbandDigest.from_slots(slots) is None
    assert port_from_slots(slots) == 5555
    assert port_from_slots([0, 0, 0, 0]) is None


# %% decode's order: slot, header port at rank_ip, port rule


@pytest.mark.parametrize(
    "slot, header_port, rank_ip, rank_port, offset, expected",
    [
        (pack_endpoint("10.0.0.5", 7000), 9000, "10.0.0.9", 30000, 100, ("10.0.0.5", 7000)),  # the slot wins
        (pack_endpoint("fe80::1", 7000), None, "10.0.0.9", None, 0, ("10.0.0.9", 7000)),  # slot without IPv4
        (None, 9000, "10.0.0.9", 30000, 100, ("10.0.0.9", 9000)),  # the header's port
        (None, None, "10.0.0.9", 30000, 100, ("10.0.0.9", 30100)),  # the rule
        (None, None, "10.0.0.9", 30000, 0, None),  # no rule, nothing in band
        (None, 9000, None, 30000, 100, None),  # no address known
        (None, None, "10.0.0.9", 65500, 100, None),  # the rule leaves the port range
    ],
)
def test_rebuild_endpoint(slot, header_port, rank_ip, rank_port, offset, expected):
    assert rebuild_endpoint(slot, header_port, rank_ip, rank_port, offset) == expected


def test_prefill_listens_where_decode_rebuilds():
    config = parse_config({"exchange": {"port_offset": -500, "port_base": 20000}}, "<test>")
    assert exchange_port(config.exchange, gpu_id=3, rank_port=31000) == 30500 == rule_port(31000, -500)
    assert exchange_port(config.exchange, gpu_id=3, rank_port=None) == 20003  # no rank_port known: port_base
    plain = parse_config({}, "<test>")
    assert exchange_port(plain.exchange, gpu_id=3, rank_port=31000) == 0


def test_a_port_offset_out_of_range_is_refused_by_name():
    with pytest.raises(ConfigError, match="exchange.port_offset"):
        parse_config({"exchange": {"port_offset": 70000}}, "probe.yaml")


# %% PP stages: their digests add up to the whole room's


def test_stage_digests_combine_into_the_whole_rooms():
    buffers = _buffers()
    whole = digest_room(buffers, PAGES, N_TOKENS, LAYOUT, LAYERS, key="9/0")
    stage0 = digest_room(buffers[:2], PAGES, N_TOKENS, LAYOUT, LAYERS[:2], key="9/0")
    stage1 = digest_room(buffers[2:], PAGES, N_TOKENS, LAYOUT, LAYERS[2:], key="9/0")
    assert stage0.signature != whole.signature  # alone, a stage is not comparable with decode
    combined = combine_stage_digests("9/0", [stage1, stage0], LAYOUT)  # any order
    assert combined.signature == whole.signature
    assert combined.layer_ids == whole.layer_ids
    assert combined.room == whole.room
    assert np.array_equal(combined.layer_segment, whole.layer_segment)
    assert np.array_equal(combined.pages, whole.pages)
    assert compare(combined, whole).verdict == "match"


def test_a_corrupt_cell_in_one_stage_is_localised_in_the_combined_digest():
    buffers = _buffers()
    received = [b.copy() for b in buffers]
    received[3][PAGES[1], 9] ^= 0x20  # layer 7 (stage 1), logical page 1, payload
    observed = digest_room(received, PAGES, N_TOKENS, LAYOUT, LAYERS, key="9/0")
    stages = [digest_room(buffers[:2], PAGES, N_TOKENS, LAYOUT, LAYERS[:2], key="9/0"),
              digest_room(buffers[2:], PAGES, N_TOKENS, LAYOUT, LAYERS[2:], key="9/0")]
    comparison = compare(combine_stage_digests("9/0", stages, LAYOUT), observed)
    assert comparison.verdict == "mismatch"
    assert (comparison.layers, comparison.pages) == ([7], [1])


@pytest.mark.parametrize("spoil", ["other_layout", "overlap", "tokens", "missing_stage", "segments"])
def test_stages_that_do_not_make_up_the_room_are_not_comparable(spoil):
    buffers = _buffers()
    whole = digest_room(buffers, PAGES, N_TOKENS, LAYOUT, LAYERS, key="9/0")
    stage0 = digest_room(buffers[:2], PAGES, N_TOKENS, LAYOUT, LAYERS[:2], key="9/0")
    stage1 = digest_room(buffers[2:], PAGES, N_TOKENS, LAYOUT, LAYERS[2:], key="9/0")
    if spoil == "other_layout":
        stage1.signature ^= 1
    elif spoil == "overlap":
        stage1 = digest_room(buffers[1:], PAGES, N_TOKENS, LAYOUT, LAYERS[1:], key="9/0")
    elif spoil == "tokens":
        stage1 = digest_room(buffers[2:], PAGES, N_TOKENS - 4, LAYOUT, LAYERS[2:], key="9/0")
    elif spoil == "segments":  # a stage digested with other segments: its rows do not stack with stage 0's
        stage1 = RoomDigest(key="9/0", signature=stage1.signature, n_tokens=stage1.n_tokens,
                            layer_ids=stage1.layer_ids, segments=stage1.segments[:1],
                            layer_segment=stage1.layer_segment[:, :1], pages=stage1.pages)
    stages = [stage0] if spoil == "missing_stage" else [stage0, stage1]
    assert compare(combine_stage_digests("9/0", stages, LAYOUT), whole).verdict == "not_comparable"


def test_stage_endpoints_describe_every_stage():
    stages = StageEndpoints([("10.0.0.1", 1), ("10.0.0.2", 2)], LAYOUT)
    assert list(stages) == [("10.0.0.1", 1), ("10.0.0.2", 2)] and stages.layout is LAYOUT
    assert describe_endpoint(stages) == "10.0.0.1:1,10.0.0.2:2"
    assert describe_endpoint(("h", 3)) == "h:3"


# %% the prefetch: the caller never waits


def test_the_prefetch_answers_in_flight_then_once_done():
    gate = threading.Event()
    callers = []

    def fetch(key):
        callers.append(threading.current_thread())
        gate.wait(5)
        return f"digest of {key}"

    prefetcher = Prefetcher(fetch)
    try:
        prefetcher.start("1/0")
        assert prefetcher.poll("1/0") == (False, None)  # in flight: the caller does not wait
        gate.set()
        for _ in range(200):
            done, digest = prefetcher.poll("1/0")
            if done:
                break
            threading.Event().wait(0.01)
        assert (done, digest) == (True, "digest of 1/0")
        assert prefetcher.poll("1/0") == (False, None)  # handed out once; asked again: started again
        assert threading.current_thread() not in callers
    finally:
        prefetcher.close()


def test_the_prefetch_table_is_bounded():
    gate = threading.Event()
    prefetcher = Prefetcher(lambda key: gate.wait(5), cap=2, workers=1)
    try:
        for key in ("a", "b", "c"):
            prefetcher.start(key)
        assert list(prefetcher._futures) == ["b", "c"]
    finally:
        gate.set()
        prefetcher.close()


def test_fetches_the_bounded_table_let_go_of_never_run():
    """Rooms landing faster than the workers fetch: those the table dropped before their
    fetch began are cancelled, so the workers run at most the table's worth, not every room."""
    gate, calls = threading.Event(), []

    def fetch(key):
        calls.append(key)
        gate.wait(5)

    prefetcher = Prefetcher(fetch, cap=4, workers=1)
    try:
        for n in range(100):
            prefetcher.start(str(n))
        gate.set()
        prefetcher._pool.shutdown(wait=True)  # every queued fetch that is still live runs
    finally:
        gate.set()
        prefetcher.close()
    assert calls[0] == "0" and len(calls) <= 1 + 4, calls
    assert set(calls[1:]) <= {"96", "97", "98", "99"}
