"""A DeepSeek-V4.1-shaped pair (``ServerOptions(model="v41")``: compress_ratios
[0, 4, 0, 4, 1, 2], SGLang 0.5.23's real pool with index_pools {4: fp8, 1: fp4,
2: fp4}): both sides digest every index pool of every room, each pool's records name
its layout, and a byte decode flips in the ratio-1 pool is found there, in its cell,
while the C4 pool and the ratio-2 pool of every room match. The rig's byte oracle
checks pools 1 and 2 at every decode digest point too: it sees the flip in that one
room and cell only, and backs every "match" the probe gives those pools."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.run import Phase, RigSession
from dsv4_idxk_probe.testbed.sglang.standin_model import ENV_POOL_FAULT

from .conftest import RIG_PROBE_CONFIG, describe

OPTIONS = launch.ServerOptions(model="v41")
ROOMS = 12


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    # decode flips one payload byte of the ratio-1 pool (layer 4) at the first slot of the
    # first room it decodes (standin_model.flip_pool_byte)
    session = RigSession(tmp_path_factory.mktemp("sglang-v41"), OPTIONS, probe_config=RIG_PROBE_CONFIG,
                         env={**os.environ, ENV_POOL_FAULT: "1"})
    try:
        session.start()
    except launch.LaunchError as exc:
        pytest.fail(f"the V4.1 SGLang pair did not start: {exc}", pytrace=False)
    yield session
    session.stop()


@dataclass
class V41Phase:
    phase: Phase
    rooms: set[str]  # bootstrap rooms, as the probe's records name them
    records: list[dict]  # the probe's records of those rooms, both sides
    oracle: list[dict]  # the oracle's points of those rooms


def _records(session: RigSession) -> list[dict]:
    from dsv4_idxk_probe.roomlog.reader import expand_inputs, read_entries

    entries = read_entries(expand_inputs([str(session.log_dir)]))
    return [e.record for e in entries if e.record is not None]


def _pool_records_complete(records: list[dict], rooms: set[str]) -> bool:
    """Every room has each low-ratio pool's prefill_send and decode_finish record (each pool's
    collector writes its own, behind the C4 records the phase waits for)."""
    for role, stage in (("prefill", "prefill_send"), ("decode", "decode_finish")):
        for ratio in (1, 2):
            seen = {r["room"] for r in records
                    if r.get("kind") == "index_pool" and (r["role"], r["stage"], r["pool"]) == (role, stage, ratio)}
            if not rooms <= seen:
                return False
    return True


@pytest.fixture(scope="module")
def v41(rig) -> V41Phase:
    """The module's one phase: its rooms, the probe's records of them and the oracle's points."""
    requests = workload.plan("v41", workload.WorkloadOptions(rooms=ROOMS, seed=5, max_new_tokens=24))
    phase = rig.phase("v41", requests)
    if not phase.ok:
        pytest.fail(describe(phase), pytrace=False)
    rooms = {str(room) for room in phase.rooms.values()}
    deadline = time.monotonic() + 60
    records = [r for r in _records(rig) if r.get("room") in rooms]
    while not _pool_records_complete(records, rooms) and time.monotonic() < deadline:
        time.sleep(1.0)
        records = [r for r in _records(rig) if r.get("room") in rooms]
    oracle = [o for o in rig.oracle(set(phase.rooms)) if o.get("cells") is not None]
    return V41Phase(phase, rooms, records, oracle)


def test_every_index_pool_is_digested_and_a_low_ratio_fault_is_found_in_its_pool(v41):
    phase, rooms, records = v41.phase, v41.rooms, v41.records
    c4 = [r for r in records if r["kind"] == "room" and r["role"] == "decode"]
    pools = [r for r in records if r["kind"] == "index_pool"]
    # both sides digested every room in each low-ratio pool, with that pool's layout
    for role, stage in (("prefill", "prefill_send"), ("decode", "decode_recv"), ("decode", "decode_finish")):
        for ratio, layout in ((1, "fp4_r1"), (2, "fp4_r2")):
            seen = {r["room"] for r in pools if (r["role"], r["stage"], r["pool"], r["layout"]) == (role, stage, ratio, layout)}
            assert seen == rooms, (role, stage, ratio, sorted(rooms - seen))
    assert {r["verdict"] for r in c4 if r["verdict"] != "skipped"} == {"match"}, describe(phase)
    # a further pool is compared through the exchange alone: a receipt digest may be judged before
    # prefill's collector published that pool's digest (unverified then); later stages ask again
    # (a later stage may also be asked before prefill published: seen once on a quiet machine)
    later = {r["verdict"] for r in pools if r["role"] == "decode" and r["stage"] != "decode_recv"
             and r["verdict"] != "mismatch"}
    assert "match" in later and later <= {"match", "unverified"}, later
    assert {r["verdict"] for r in pools if r["pool"] == 2 and r["role"] == "decode"} <= {"match", "unverified"}
    bad = [r for r in pools if r["pool"] == 1 and r["verdict"] == "mismatch"]
    assert len({r["room"] for r in bad}) == 1, [(r["room"], r["stage"]) for r in bad]
    found = bad[0]
    assert found["stage"] in ("decode_step", "decode_finish") and found["first_divergence"] == found["stage"]
    loc = found["localisation"]
    assert (loc["pool"], loc["layers"], loc["pages"], loc["segments"]) == (1, [4], [0], ["payload"]), loc
    # the same room's receipt matched in that pool: the flip came after the transfer
    receipt = [r for r in pools if r["pool"] == 1 and r["room"] == found["room"] and r["stage"] == "decode_recv"]
    assert [r["verdict"] for r in receipt] in (["match"], ["unverified"])


def _planted(v41: V41Phase) -> dict:
    """The probe's first pool-1 mismatch: the planted flip as the probe found it."""
    bad = [r for r in v41.records if r.get("kind") == "index_pool" and r["pool"] == 1 and r["verdict"] == "mismatch"]
    assert bad, "the probe found no mismatch in pool 1"
    return bad[0]


def test_the_oracle_sees_the_low_ratio_pools_bad_in_the_planted_room_only(v41):
    # every room had oracle points, each of which checked pools 1 and 2
    assert {str(o["room"]) for o in v41.oracle} == v41.rooms
    assert {tuple(o.get("pools") or ()) for o in v41.oracle} == {(1, 2)}
    bad = {(str(o["room"]), *cell) for o in v41.oracle for cell in o["pool_cells"]}
    found = _planted(v41)
    assert {cell[0] for cell in bad} == {found["room"]}, sorted(bad)
    # the planted room's bad cells are the probe's localisation of it: pool 1, layer 4, row 0, payload
    loc = found["localisation"]
    want = {(found["room"], layer, page, segment, loc["pool"])
            for layer in loc["layers"] for page in loc["pages"] for segment in loc["segments"]}
    assert bad == want == {(found["room"], 4, 0, "payload", 1)}, (sorted(bad), loc)
    at = [o for o in v41.oracle if _point(o) == _point(found)]
    assert at and all({tuple(c) for c in o["pool_cells"]} == {(4, 0, "payload", 1)} for o in at), at


def test_every_low_ratio_match_is_backed_by_the_oracle(v41):
    points: dict[tuple, list[dict]] = {}
    for o in v41.oracle:
        points.setdefault(_point(o), []).append(o)
    matches = [r for r in v41.records if r.get("kind") == "index_pool" and r["role"] == "decode"
               and r["verdict"] == "match"]
    assert {r["pool"] for r in matches} == {1, 2}
    for r in matches:
        at = points.get(_point(r))
        assert at, f"pool {r['pool']} room {r['room']} {r['stage']} {r['step']}: match with no oracle point"
        for o in at:
            assert r["pool"] in o.get("pools", []), f"an oracle point that did not check pool {r['pool']}: {o}"
            bad = [c for c in o["pool_cells"] if c[3] == r["pool"]]
            assert not bad, f"pool {r['pool']} room {r['room']} {r['stage']} {r['step']}: probe says match, oracle {bad}"


def _point(record: dict) -> tuple:
    """A decode digest point, as the probe's records and the oracle's name it."""
    return str(record["room"]), int(record["attempt"]), record["stage"], record["step"]
