"""The rig's verdict on an in_host_pool fault (a HiCache host row changed between its backup
and its load): no digest point may report it, the oracle must see it on decode, and HiCache
round-trip mode must name the host row, its leg, its backup verdict and the load."""

from __future__ import annotations

import copy

import pytest

from dsv4_idxk_probe.testbed.sglang.run import expectations
from dsv4_idxk_probe.testbed.faults.verify import _against_oracle, _check_fault, _upstream

ROOM = 7001
FAULT = {"fault": 0, "name": "host-row", "kind": "byte_set", "when": "in_host_pool", "after_step": 0, "side": "prefill",
         "rid": "r1", "rig_room": 5, "room": ROOM, "applied": True, "reason": "", "target": {}, "point": 0,
         "cells": [[1, 2, "payload"]], "expect": [],
         "roundtrip": [{"pool": "deepseek_v4_c4_indexer", "host_row": 12, "layer": 0, "device_page": 40,
                        "leg": "host", "at_backup": "match"}]}
ORACLE = [{"room": ROOM, "stage": "decode_recv", "step": None, "index": 0, "n_tokens": 1600, "cells": [[1, 2, "payload"]]},
          {"room": ROOM, "stage": "decode_finish", "step": None, "index": 1, "n_tokens": 1600, "cells": [[1, 2, "payload"]]}]
MATCH = {"verdict": "match", "stage": "decode_recv", "step": None, "localisation": None}
STAGES = {ROOM: {(0, 0, 0): MATCH, (0, 2, 0): dict(MATCH, stage="decode_finish")}}
GOOD = {"pool": "deepseek_v4_c4_indexer", "host_row": 12, "device_page": 40, "layer": 0, "leg": "host",
        "checks": {"d2h": "match", "host": "mismatch", "h2d": "match"},
        "events": [{"event": "hicache_backup", "page": 40, "host_row": 12},
                   {"event": "hicache_load", "page": 40, "host_row": 12, "pool": "deepseek_v4_c4_indexer",
                    "host_row_checks": {"d2h": "match", "host": "mismatch", "h2d": "match", "layers": [0]}}]}


def judged(rows, oracle=ORACLE):
    (record,) = expectations([FAULT], oracle)
    return record, _check_fault(record, STAGES, {}, rows)


def test_the_round_trip_naming_the_row_and_its_load_finds_it_and_the_oracle_agrees_with_match():
    record, check = judged([GOOD])
    assert check.ok, check.note
    assert check.diagnosed.startswith("deepseek_v4_c4_indexer host row 12 layer 0: changed in host memory while resident")
    assert record["effects"][0]["stage"] is None and record["effects"][0]["oracle_stage"] == "decode_recv"
    # the oracle's changed cell is the fault's, upstream of both digests: the probe's "match" agrees
    assert _against_oracle(STAGES, ORACLE, _upstream([record])) == (2, [])
    assert _against_oracle(STAGES, ORACLE)[1]  # without the fault's cells it would not


def _edit(path, value):
    row = copy.deepcopy(GOOD)
    *keys, last = path
    target = row
    for k in keys:
        target = target[k]
    target[last] = value
    return row


@pytest.mark.parametrize("rows, problem", [
    ([], "round trip did not report host row 12 layer 0"),
    ([_edit(["host_row"], 13)], "round trip did not report"),
    ([_edit(["leg"], "h2d")], "blamed on h2d, expected host"),
    ([_edit(["checks", "d2h"], "unverified")], "unverified at backup, expected match"),
    ([_edit(["device_page"], 41)], "loaded into device page 41, expected 40"),
    ([_edit(["events"], GOOD["events"][:1])], "last journal event is not its load"),
    ([_edit(["events", 1, "host_row_checks", "host"], "match")], "last journal event is not its load"),
    ([_edit(["events", 1, "pool"], "deepseek_v4_c4")], "last journal event is not its load"),
])
def test_a_wrong_or_missing_round_trip_report_fails_the_fault(rows, problem):
    _, check = judged(rows)
    assert not check.ok and problem in check.note, check.note


def test_a_fault_the_oracle_never_saw_on_decode_fails():
    _, check = judged([GOOD], oracle=[dict(o, cells=[]) for o in ORACLE])
    assert not check.ok and "the oracle never saw the changed bytes" in check.note


def test_a_digest_point_reporting_it_fails():
    (record,) = expectations([FAULT], ORACLE)
    stages = {ROOM: {(0, 0, 0): {"verdict": "mismatch", "stage": "decode_recv", "step": None,
                                 "localisation": {"layer_segments": [[1, "payload"]], "pages": [2]}}}}
    check = _check_fault(record, stages, {}, [GOOD])
    assert not check.ok and "a digest point reported it" in check.note
