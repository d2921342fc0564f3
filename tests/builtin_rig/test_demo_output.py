"""What the demo shows while it runs and at the end: progress while requests run, a verdict
table within 100 columns, and a plain answer when the `[demo]` extra is not installed."""

from __future__ import annotations

import io
import time
from contextlib import contextmanager

import pytest

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.testbed.faults.summary import render
from dsv4_idxk_probe.testbed.faults.verify import FaultCheck, Verification

ROOM = 1271161584116060613


def _check(i: int, applied: bool = True, ok: bool = True) -> FaultCheck:
    record = {"fault": i, "name": f"a-rather-long-fault-name-number-{i}", "kind": "swap_pages", "when": "after_step",
              "after_step": 5, "room": ROOM + i, "rig_room": 100 + i, "applied": applied}
    expected = [{"stage": "decode_step", "step": 7}] if applied else []
    localised = "; ".join(f"room {ROOM + i + k} L1,3 P{k} payload,scale" for k in range(4))
    return FaultCheck(record, expected, seen="decode_step@7", localised=localised,
                      diagnosed=f"other_room {ROOM}/0; other_room {ROOM + 1}/0; zeroed after transfer_landed",
                      ok=ok, note="" if ok else "first seen at decode_finish, expected decode_step@7 " * 3)


def test_the_verdict_table_fits_in_100_columns_and_keeps_what_it_says(tmp_path):
    checks = [_check(i) for i in range(6)] + [_check(6, ok=False), _check(7, applied=False)]
    verification = Verification(diff_status=1, diff_json=tmp_path / "diff.json", checks=checks,
                                unexplained=["room 5 decode_step@3 L1 P2: " + "x" * 150], oracle_checked=40,
                                verdicts={"match": 37, "mismatch": 11, "not_comparable": 2, "unverified": 1})
    out = io.StringIO()
    render(verification, 7, out)
    text = out.getvalue()
    assert [line for line in text.splitlines() if len(line) > 100] == []
    flat = " ".join(text.split())
    for c in checks:
        assert c.localised in flat and c.diagnosed in flat
    assert " ".join(checks[6].note.split()) in flat and "MISSED" in text
    assert "found where and when expected: 6/7" in flat and "40/40 digest points agree" in flat


def test_a_fault_name_from_the_spec_reaches_the_terminal_escaped(tmp_path):
    """A fault spec's name with an escape sequence was printed raw in the table (found by review)."""
    check = _check(0)
    check.record["name"] = "\x1b[31mRED\x1b]0;title\x07"
    out = io.StringIO()
    render(Verification(diff_status=0, diff_json=tmp_path / "d.json", checks=[check], unexplained=[],
                        oracle_checked=1, verdicts={"match": 1}), 1, out)
    assert "\x1b" not in out.getvalue() and "\\x1b[31mRED" in out.getvalue()


class _Recorder:
    def __init__(self):
        self.counts: list[tuple[int, int]] = []
        self.steps: list[str] = []

    @contextmanager
    def step(self, text):
        self.steps.append(text)
        yield

    def count(self, done, total=None, unit="", what=""):
        self.counts.append((done, total))


def test_the_sglang_demo_reports_rooms_finished_while_requests_run():
    from dsv4_idxk_probe.testbed.sglang.demo import watch_rooms

    records: list[dict] = []

    class Session:  # what watch_rooms reads: the oracle's records the servers append
        def _read(self, kind):
            assert kind == "oracle"
            return list(records)

    progress = _Recorder()
    with watch_rooms(Session(), 3, progress, every_s=0.05):
        for room in range(3):
            records.append({"room": room, "stage": "decode_recv"})
            records.append({"room": room, "stage": "decode_finish"})
            time.sleep(0.2)
    assert progress.counts and progress.counts[-1] == (3, 3)
    assert [d for d, _ in progress.counts] == sorted(d for d, _ in progress.counts)


def test_the_demo_without_the_demo_extra_says_what_to_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nixl" else real(name, *a))
    assert run(["demo", "--rig", "builtin"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'dsv4-idxk-probe[demo]'" in err and "Traceback" not in err


def test_the_demos_metric_samples_are_shown_without_sglangs_labels():
    from dsv4_idxk_probe.testbed.sglang.demo import without_sglang_labels

    sample = ('dsv4_idxk_probe_rooms_verified_total{engine_type="decode",model_name="/models/a \\"b\\"",'
              'moe_ep_rank="0",pp_rank="0",stage="decode_finish",tp_rank="0",verdict="match"} 4.0')
    shown = without_sglang_labels(sample)
    assert shown == 'dsv4_idxk_probe_rooms_verified_total{stage="decode_finish",verdict="match"} 4.0'
    assert len(shown) <= 100 < len(sample)


@pytest.mark.parametrize("option, value", [("--metrics-port", "99999"), ("--seed", "-1"), ("--step-interval", "-2"),
                                           ("--rooms", "0"), ("--layers", "62")])
def test_a_demo_option_out_of_its_range_is_a_usage_error(capsys, option, value):
    """Each ended in an internal error (exit 3), some only after the servers had started;
    `--rooms 0` became the default silently (found by review)."""
    with pytest.raises(SystemExit) as exited:
        run(["demo", "--rig", "builtin", option, value])
    assert exited.value.code == 2
    assert f"argument {option}: '{value}' is not between" in capsys.readouterr().err
