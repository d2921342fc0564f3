"""Every fault kind at every timing, end to end: two processes, real NIXL, the probe
switched on by its environment variable, then the product's `diff` over the logs.

For each injected fault the test states, from the timing rules of
docs/faults.md, which stage must see it first and which (layer, page,
segment) cells it must name; the diff's JSON must say exactly that, with
every earlier stage a match. Faults in bytes that are not frozen, and
prefill-side changes to pages that already left, must not be reported.
"""

from __future__ import annotations

import pytest
from tests.support.rigutil import diff_rooms, dump, run, stages_of

from dsv4_idxk_probe.testbed.faults.spec import KINDS, TRANSFER_KINDS
from dsv4_idxk_probe.testbed.builtin.config import RigConfig, explicit_plan
from dsv4_idxk_probe.testbed.faults.verify import verify

INTERVAL = 4
LAYER_IDS = (1, 3, 5, 7)  # global ids differ from buffer indices on purpose
TOKENS, STEPS = 700, 10  # pages 0 and 1 full, page 2 holds 47 frozen slots
BOTH = ["payload", "scale"]
WHENS = ["before_send", "in_flight", "after_recv", {"after_step": 5}]
PARTNER = 90  # the swap partner: received early, decoding long after the swaps


def _allowed(kind, when) -> bool:
    if kind in TRANSFER_KINDS:
        return when == "in_flight"
    return not (kind == "swap_pages" and when == "before_send")


def _first(when, stages) -> tuple[str, int | None]:
    """Written out independently of the rig's expect module: the first digest point
    after the change, among the points this room was actually digested at."""
    if when in ("before_send", "in_flight"):
        return "decode_recv", None
    done = 0 if when == "after_recv" else when["after_step"]
    later = [step for stage, step, *_ in stages if stage == "decode_step" and step > done]
    return ("decode_step", min(later)) if later else ("decode_finish", None)


def _case(kind, when):
    """(fault fields, expected layer_segments, expected pages) for one kind/timing on a fresh room."""
    page = "last" if when == "before_send" else 1  # before_send must hit a page of the last WRITE
    want_page = 2 if page == "last" else 1
    fault = {"when": when, "kind": kind, "where": {"layer": 5, "page": page}}
    segs = BOTH
    if kind == "bitflip":
        fault["where"].update(segment="scale", offset=12)
        segs = ["scale"]
    elif kind == "byte_set":
        fault["where"].update(segment="payload", range=[256, 300])
        fault["value"] = 0
        segs = ["payload"]
    elif kind == "partial_write":
        fault["keep_bytes"] = 8200  # payload lands, the scales after byte 8200 do not
        segs = ["scale"]
    elif kind == "swap_pages":
        fault["with_room"] = PARTNER
    return fault, [[5, s] for s in segs], [want_page]


CASES = [(k, w) for k in KINDS for w in WHENS if _allowed(k, w)]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("matrix")
    faults, expected, rows = [], {}, [(PARTNER, 600, 0, 400)]
    for i, (kind, when) in enumerate(CASES):
        room = 10 + i
        fault, layer_segs, pages = _case(kind, when)
        faults.append({"name": f"{kind}-{i}", "room": room, **fault})
        expected[room] = (when, layer_segs, pages)
        rows.append((room, TOKENS, 0, STEPS))
    # after the last decode_step digest: only decode_finish can see it
    faults.append({"name": "late", "room": 60, "when": {"after_step": 9}, "kind": "bitflip",
                   "where": {"layer": 1, "page": 0, "segment": "payload", "offset": 3}})
    expected[60] = ({"after_step": 9}, [[1, "payload"]], [0])
    # a decode-side prefix: pages are numbered from the first transferred one
    faults.append({"name": "prefix", "room": 61, "when": "in_flight", "kind": "bitflip",
                   "where": {"layer": 7, "page": 1, "segment": "payload", "offset": 100}})
    expected[61] = ("in_flight", [[7, "payload"]], [1])
    # changes no stage may report
    quiet = {
        70: {"when": "after_recv", "kind": "bitflip", "where": {"layer": 3, "page": "last", "segment": "payload", "offset": "unfrozen"}},
        71: {"when": "in_flight", "kind": "byte_set", "value": 7, "where": {"layer": 3, "page": 2, "segment": "payload", "range": [6100, 6200]}},
        72: {"when": "before_send", "kind": "byte_set", "value": 0, "where": {"layer": 3, "page": 0, "segment": "payload", "range": [0, 64]}},
        73: {"when": "in_flight", "kind": "zero_page", "where": {"layer": "all", "page": "last"}},
    }
    for room, fault in quiet.items():
        faults.append({"name": f"quiet-{room}", "room": room, **fault})
    rows += [(60, TOKENS, 0, STEPS), (61, 1000, 2, STEPS), (70, TOKENS, 0, STEPS), (71, TOKENS, 0, STEPS),
             (72, TOKENS, 0, STEPS), (73, 515, 0, STEPS), (80, TOKENS, 0, STEPS)]  # 73: tail page has no frozen slot
    cfg = RigConfig(layers=4, layer_ids=LAYER_IDS, chunk_tokens=512, max_running=40, pool_source="builtin",
                    plan=explicit_plan(rows))
    result = run(tmp, cfg, faults=faults, step_interval=INTERVAL)
    status, doc, rooms = diff_rooms(tmp / "logs")
    return result, status, rooms, expected, quiet, tmp


def test_every_room_ran_to_the_end(matrix):
    result, status, rooms, *_ = matrix
    planned = {p.room for p in result.config.room_plan()}
    assert result.finished == planned and not result.skipped
    assert set(rooms) == planned
    assert status == 1  # mismatches were found
    assert all(f["applied"] for f in result.faults), dump([f for f in result.faults if not f["applied"]])


@pytest.mark.parametrize("kind, when", CASES, ids=[f"{k}@{w if isinstance(w, str) else 'after_step'}" for k, w in CASES])
def test_fault_found_at_its_first_stage_and_localised(matrix, kind, when):
    result, _, rooms, expected, *_ = matrix
    room = 10 + CASES.index((kind, when))
    _check_room(rooms[room], *expected[room])


@pytest.mark.parametrize("room", [60, 61])
def test_late_and_prefix_faults(matrix, room):
    _, _, rooms, expected, *_ = matrix
    _check_room(rooms[room], *expected[room])


def _check_room(room: dict, when, layer_segs, pages):
    stages = stages_of(room)
    first = _first(when, stages)
    assert any(stage == "decode_step" for stage, *_ in stages) or STEPS <= INTERVAL, dump(stages)
    assert (room["first_divergence"]["stage"], room["first_divergence"]["step"]) == first, dump(stages)
    order = {"decode_recv": 0, "decode_step": 1, "decode_finish": 2}
    first_key = (order[first[0]], first[1] or 0)
    for stage, step, verdict, loc in stages:
        if (order[stage], step or 0) < first_key:
            assert verdict == "match", dump(stages)
        else:
            assert verdict == "mismatch", dump(stages)
            assert loc["layer_segments"] == layer_segs and loc["pages"] == pages and loc["exact"] == (len(layer_segs) == 1), dump(loc)


def test_swap_partner_is_found_too(matrix):
    result, _, rooms, *_ = matrix
    swaps = [f for f in result.faults if f["kind"] == "swap_pages"]
    assert len(swaps) == 3
    partner_pages = {f["target"]["partner"]["page"] for f in swaps}
    assert {f["target"]["partner"]["room"] for f in swaps} == {PARTNER}
    loc = next(s for s in rooms[PARTNER]["stages"] if s["stage"] == "decode_finish")["localisation"]
    assert loc["layer_segments"] == [[5, "payload"], [5, "scale"]] and set(loc["pages"]) == partner_pages


@pytest.mark.parametrize("room", [70, 71, 72, 73, 80])
def test_changes_outside_frozen_bytes_or_already_sent_are_not_reported(matrix, room):
    result, _, rooms, *_ = matrix
    assert rooms[room]["verdict"] == "match", dump(stages_of(rooms[room]))
    stages = [s["stage"] for s in rooms[room]["stages"]]
    # recv, then a step digest on every INTERVAL-th decode batch among its steps 1..STEPS-1
    # (9 consecutive batches hold 2 or 3 multiples of 4), then finish
    assert stages[0] == "decode_recv" and stages[-1] == "decode_finish", stages
    assert stages[1:-1] == ["decode_step"] * len(stages[1:-1]) and 2 <= len(stages) - 2 <= 3, stages
    if room != 80:  # the fault really changed bytes, just none that the digest covers
        record = next(f for f in result.faults if f["room"] == room)
        assert record["applied"] and record["target"]["bytes"] or record["kind"] == "zero_page"


def test_probe_agrees_with_the_byte_level_oracle_everywhere(matrix):
    result, _, _, _, _, tmp = matrix
    check = verify(tmp / "logs", result.faults, result.oracle, sorted(result.finished))
    rooms = len(result.config.room_plan())
    assert check.oracle_checked == 2 * rooms + result.stats["decode"]["step_digests"]
    assert check.oracle_disagreements == [] and check.unexplained == []
    assert check.ok, dump([c.__dict__ for c in check.checks if not c.ok])


def test_a_live_verdict_the_digests_do_not_back_fails_the_verification(matrix, tmp_path):
    """The checks above judge the diff's verdicts, recomputed from both sides' digests; what
    decode said live (its log, metrics, alerts) must be the same: the matrix's decode records
    rewritten as a probe whose live comparison always said match (digests left alone, lines
    re-encoded) fail the verification, where the real ones pass."""
    import shutil

    from dsv4_idxk_probe.roomlog.lineformat import decode_line, encode_line

    result, _, _, _, _, tmp = matrix
    logs = tmp_path / "logs"
    shutil.copytree(tmp / "logs", logs)
    rewritten = 0
    for path in logs.glob("decode-*.jsonl"):
        lines = []
        for line in path.read_bytes().splitlines(keepends=True):
            rec = decode_line(line)
            if rec.get("kind") == "room" and rec.get("verdict") == "mismatch":
                rec.pop("h", None)
                rec["verdict"], rec["reason"] = "match", ""
                rewritten += 1
                line = encode_line(rec)
            lines.append(line)
        path.write_bytes(b"".join(lines))
    assert rewritten
    check = verify(logs, result.faults, result.oracle, sorted(result.finished))
    assert len(check.live_disagreements) == rewritten and not check.ok, check.live_disagreements[:3]
    import io

    from dsv4_idxk_probe.testbed.faults.summary import render

    out = io.StringIO()
    render(check, sum(1 for f in result.faults if f["applied"]), out)
    assert f"decode's own verdict differs from its digests' at {rewritten} point(s)" in out.getvalue()
    assert "the probe MISSED or INVENTED something" in out.getvalue()
    assert verify(tmp / "logs", result.faults, result.oracle, sorted(result.finished)).live_disagreements == []
