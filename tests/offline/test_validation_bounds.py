"""Bounds `validation.room_fields` keeps on what a room record carries: what passes is
bounded, so neither engine keeps or prints an unbounded string, nor overflows an attempt."""

from __future__ import annotations

import copy

import pytest
from tests.support.logdata import RoomPlan, room_records

from dsv4_idxk_probe.offline.validation import RecordError, hicache_branch, room_fields


def _prefill() -> dict:
    return room_records(RoomPlan(1))[0][0]


@pytest.mark.parametrize("attempt, ok", [(0, True), (2**63 - 1, True), (2**63, False), (2**64 - 1, False), (-1, False)])
def test_attempt_is_a_bigint(attempt, ok):
    rec = dict(_prefill(), attempt=attempt)
    if ok:
        assert room_fields(rec)[1] == attempt
    else:
        with pytest.raises(RecordError, match="attempt must be a non-negative integer"):
            room_fields(rec)


@pytest.mark.parametrize("length, ok", [(256, True), (257, False), (1 << 20, False)])
def test_instance_is_at_most_256_characters(length, ok):
    rec = dict(_prefill(), instance="i" * length)
    if ok:
        room_fields(rec)
    else:
        with pytest.raises(RecordError, match="instance must be at most 256 characters"):
            room_fields(rec)


@pytest.mark.parametrize("length, ok", [(256, True), (257, False), (1 << 20, False)])
def test_segment_names_are_at_most_256_characters(length, ok):
    rec = copy.deepcopy(_prefill())
    rec["digest"]["segments"][1] = "s" * length
    if ok:
        assert room_fields(rec)[6].segments[1] == "s" * length
    else:
        with pytest.raises(RecordError, match="digest.segments must be names of at most 256 characters"):
            room_fields(rec)
        with pytest.raises(RecordError):  # a refused shape is not cached: refused again
            room_fields(rec)


@pytest.mark.parametrize("field", ["pool", "branch", "direction"])
@pytest.mark.parametrize("length, ok", [(256, True), (257, False), (1 << 20, False)])
def test_hicache_branch_names_are_at_most_256_characters(field, length, ok):
    rec = dict({"pool": "deepseek_v4_c4_indexer", "branch": "page", "direction": "d2h", "count": 3},
               **{field: "n" * length})
    if ok:
        assert hicache_branch(rec)[3] == 3
    else:
        with pytest.raises(RecordError, match="pool, branch and direction must be at most 256 characters"):
            hicache_branch(rec)
