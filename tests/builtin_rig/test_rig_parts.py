"""The rig's pieces on their own: plan, ground truth, fault targeting, timing rules, buffers."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.digest import get_layout
from dsv4_idxk_probe.testbed.faults import content, expect, inject
from dsv4_idxk_probe.testbed.faults.spec import parse_fault_spec
from dsv4_idxk_probe.testbed.builtin.config import PlanError, RigConfig, explicit_plan
from dsv4_idxk_probe.testbed.builtin.pool import build_buffers
from dsv4_idxk_probe.testbed.builtin.wire import notification, parse_notification

FP8 = get_layout("fp8")


# %% plan


def test_plan_has_partial_tails_prefixes_and_is_seeded():
    plan = RigConfig(rooms=300, seed=5).room_plan()
    assert plan == RigConfig(rooms=300, seed=5).room_plan()
    assert plan != RigConfig(rooms=300, seed=6).room_plan()
    assert any(p.prompt_tokens % 256 for p in plan)
    assert any(p.prefix_pages for p in plan) and all(p.sent_pages >= 1 for p in plan)
    assert all(p.sent_tokens == p.prompt_tokens - 256 * p.prefix_pages for p in plan)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"layers": 62}, "layers must be 1..61"),
        ({"layers": 2, "layer_ids": (1, 1)}, "distinct"),
        ({"chunk_tokens": 300}, "multiple of 256"),
        ({"device": "tpu"}, "device must be one of"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens <= max_tokens"),
        ({"pool_pages": 3}, "cannot hold the largest room"),
    ],
)
def test_bad_rig_settings_are_named(kwargs, message):
    with pytest.raises(PlanError, match=message):
        RigConfig(**kwargs).validated()


def test_explicit_plan_checks_rows():
    with pytest.raises(PlanError, match="prefix_pages"):
        explicit_plan([(1, 256, 1, 0)])  # a prefix must leave at least one page to transfer
    with pytest.raises(PlanError, match="distinct"):
        explicit_plan([(1, 10, 0, 0), (1, 20, 0, 0)])


# %% ground truth and frozen bytes


def test_write_frozen_writes_only_frozen_slots():
    buf = torch.full((4, FP8.row_bytes), 0xAB, dtype=torch.uint8)
    truth = content.truth_rows(1, 2, 0, 3, [0, 1], FP8.row_bytes)
    frozen = np.array([64, 10])
    content.write_frozen(buf, [1, 3], truth, frozen, FP8)
    rows = buf.numpy()
    assert np.array_equal(rows[1], truth[0])
    assert np.array_equal(rows[3, : 10 * 128], truth[1, : 10 * 128])
    assert np.all(rows[3, 10 * 128 : 8192] == 0xAB)
    assert np.array_equal(rows[3, 8192 : 8192 + 40], truth[1, 8192 : 8192 + 40])
    assert np.all(rows[3, 8192 + 40 :] == 0xAB)
    assert np.all(rows[[0, 2]] == 0xAB)


def test_frozen_differences_ignore_unfrozen_bytes():
    truth = content.truth_rows(0, 1, 0, 0, [0], FP8.row_bytes)
    actual = truth.copy()
    actual[0, 10 * 128] ^= 1  # slot 10: not frozen when 10 slots are
    actual[0, 8192 + 40] ^= 1
    assert not content.frozen_differences(actual, truth, np.array([10]), FP8).any()
    actual[0, 8192 + 39] ^= 1  # last frozen scale byte
    assert content.frozen_differences(actual, truth, np.array([10]), FP8).tolist() == [[False, True]]


def test_truth_depends_on_every_key():
    base = content.truth_rows(0, 1, 0, 2, [3], 64)
    for args in [(1, 1, 0, 2), (0, 2, 0, 2), (0, 1, 1, 2), (0, 1, 0, 3)]:
        assert not np.array_equal(base, content.truth_rows(*args, [3], 64))
    assert not np.array_equal(base, content.truth_rows(0, 1, 0, 2, [4], 64))


# %% fault targeting


def _fault(body: str):
    return parse_fault_spec("faults:\n  - " + body).faults[0]


PLAN = explicit_plan([(7, 256 + 41, 0, 12)])[0]  # page 1 has 10 frozen slots


@pytest.mark.parametrize("seed", range(20))
def test_random_offset_lands_in_frozen_bytes_and_unfrozen_outside(seed):
    rng = np.random.default_rng(seed)
    t = inject.resolve(_fault("{room: 7, when: after_recv, kind: bitflip, where: {page: 1}}"), PLAN, FP8, [0, 2], rng)
    seg = next(s for s in FP8.segments if s.name == t.segment)
    assert t.frozen == 10 and seg.offset <= t.start < seg.offset + 10 * seg.slot_bytes
    u = inject.resolve(
        _fault("{room: 7, when: after_recv, kind: bitflip, where: {page: 1, offset: unfrozen}}"), PLAN, FP8, [0, 2], rng
    )
    seg = next(s for s in FP8.segments if s.name == u.segment)
    assert seg.offset + 10 * seg.slot_bytes <= u.start < seg.offset + 64 * seg.slot_bytes


def test_unreachable_targets_say_why():
    rng = np.random.default_rng(0)
    full = explicit_plan([(1, 512, 0, 0)])[0]
    assert "only 2 pages" in inject.resolve(_fault("{room: 1, when: in_flight, kind: zero_page, where: {page: 5}}"), full, FP8, [0], rng)
    assert "no unfrozen slot" in inject.resolve(
        _fault("{room: 1, when: in_flight, kind: bitflip, where: {page: 0, offset: unfrozen}}"), full, FP8, [0], rng
    )


def test_apply_in_place_changes_exactly_the_target():
    buf = torch.zeros((3, FP8.row_bytes), dtype=torch.uint8)
    t = inject.resolve(
        _fault("{room: 7, when: after_recv, kind: bitflip, bit: 3, where: {layer: 2, page: 0, segment: scale, offset: 5}}"),
        PLAN, FP8, [0, 2], np.random.default_rng(0),
    )
    old = inject.apply_in_place([buf, buf], 1, t, np.random.default_rng(0))
    assert t.layers == [1] and np.flatnonzero(buf.numpy()[1]).tolist() == [8192 + 5] and buf[1, 8197] == 8
    assert inject.changed_segments(FP8, old[0], buf.numpy()[1], t.frozen) == ["scale"]


def test_partial_write_segments_follow_the_cut():
    assert inject.partial_write_segments(FP8, 8200, 64) == ["scale"]
    assert inject.partial_write_segments(FP8, 100, 64) == ["payload", "scale"]
    assert inject.partial_write_segments(FP8, 1280, 10) == ["scale"]  # payload's 10 frozen slots end at 1280
    assert inject.partial_write_segments(FP8, 100, 0) == []


# %% timing rules


@pytest.mark.parametrize(
    "when, after, steps, interval, want",
    [
        ("in_flight", 0, 10, 4, ("decode_recv", None)),
        ("before_send", 0, 10, 4, ("decode_recv", None)),
        ("after_recv", 0, 10, 4, ("decode_step", 4)),
        ("after_step", 4, 10, 4, ("decode_step", 8)),
        ("after_step", 5, 10, 4, ("decode_step", 8)),
        ("after_step", 9, 10, 4, ("decode_finish", None)),
        ("after_step", 8, 8, 4, ("decode_finish", None)),
        ("after_recv", 0, 3, 4, ("decode_finish", None)),
        ("after_recv", 0, 10, 0, ("decode_finish", None)),
    ],
)
def test_first_stage_rules(when, after, steps, interval, want):
    assert expect.first_stage(when, after, steps, interval) == want


@pytest.mark.parametrize(
    "steps_done, steps, interval, batch, want",
    [
        (0, 10, 4, 2, ("decode_step", 2)),  # received after batch 2: batch 4 is its step 2
        (3, 10, 4, 7, ("decode_step", 4)),  # step 3 in batch 7: batch 8 is its step 4
        (3, 5, 4, 5, ("decode_finish", None)),  # batch 8 would be step 6: it finished at step 5
        (1, 10, 4, 8, ("decode_step", 5)),  # batch 8 is itself a step batch: the next one is 12
    ],
)
def test_step_digests_follow_the_batch_count_not_the_room(steps_done, steps, interval, batch, want):
    assert expect.next_digest_point(steps_done, steps, interval, batch) == want


def test_before_send_on_a_page_already_sent_is_invisible():
    assert expect.first_stage("before_send", 0, 10, 4, page_in_last_write=False) is None


# %% buffers and wire format


@pytest.mark.parametrize("layout", ["fp8", "fp4", "bf16"])
def test_builtin_buffers_have_sglang_shape(layout):
    lay = get_layout(layout)
    bufs, source = build_buffers(lay, 3, 17, "cpu", "builtin")
    assert source == "builtin" and len(bufs) == 3
    assert all(b.dtype == torch.uint8 and tuple(b.shape) == (17, lay.row_bytes) and not b.any() for b in bufs)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
@pytest.mark.parametrize("layout", ["fp8", "fp4"])
def test_sglang_pool_gives_the_same_geometry_as_builtin(layout):
    lay = get_layout(layout)
    real, source = build_buffers(lay, 2, 40, "cpu", "sglang")
    builtin, _ = build_buffers(lay, 2, 40, "cpu", "builtin")
    assert source == "sglang"
    for r, b in zip(real, builtin):
        assert (r.dtype, r.shape[1], r.is_contiguous()) == (b.dtype, b.shape[1], True)
        assert r.shape[0] >= 40 and not r.any()


def test_bf16_has_no_sglang_pool_and_says_so():
    with pytest.raises(ValueError, match="no 'bf16' layout"):
        build_buffers(get_layout("bf16"), 1, 8, "cpu", "sglang")


def test_notification_round_trip_and_foreign_messages():
    assert parse_notification(notification(12, 1, 3, 4)) == (12, 1, 3, 4)
    assert parse_notification(b"other|1|2") is None
    assert parse_notification(b"idxk|a|0|0|0") is None
