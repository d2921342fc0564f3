"""The command line's progress lines (`dsv4_idxk_probe.cli.progress`): on stderr, silent for
short work, a heartbeat while a step blocks, counts rate-limited, each line within 100 columns."""

from __future__ import annotations

import io
import time

from dsv4_idxk_probe.cli import progress as cli_progress
from dsv4_idxk_probe.cli.progress import Progress
from dsv4_idxk_probe.offline.fleet import pipeline


def test_quiet_work_prints_nothing(capsys):
    with Progress("check", quiet_s=60) as p:
        with p.step("a short step"):
            pass
        p.count(3, 10, "files")
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_a_blocking_step_shows_a_heartbeat_then_how_long_it_took():
    stream = io.StringIO()
    with Progress("check", stream, quiet_s=0.05, every_s=0.05) as p:
        with p.step("importing SGLang"):
            time.sleep(0.4)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("dsv4-idxk-probe check: importing SGLang ... ")
    assert lines[-1].startswith("dsv4-idxk-probe check: importing SGLang: done in ")
    assert len(lines) >= 3


def test_counts_are_rate_limited_but_the_last_one_shows():
    stream = io.StringIO()
    with Progress("diff", stream, quiet_s=0, every_s=3600) as p:
        for i in range(1, 1001):
            p.count(i, 1000, "files", what="reading")
    lines = stream.getvalue().splitlines()
    assert lines == ["dsv4-idxk-probe diff: reading: 1/1,000 files (0%)",
                     "dsv4-idxk-probe diff: reading: 1,000/1,000 files (100%)"]


def test_the_first_count_shows_on_a_machine_booted_moments_ago(monkeypatch):
    """The monotonic clock counts from boot: a rate limit measured from 0 hid the first
    lines for `every_s` after boot (a fresh CI machine)."""
    monkeypatch.setattr(cli_progress.time, "monotonic", lambda: 12.0)
    stream = io.StringIO()
    with Progress("diff", stream, quiet_s=0, every_s=3600) as p:
        p.count(1, 10, "files", what="reading")
    assert stream.getvalue().splitlines()[0] == "dsv4-idxk-probe diff: reading: 1/10 files (10%)"


def test_the_fleet_pass_shows_its_first_progress_line_soon_after_boot(monkeypatch):
    monkeypatch.setattr(pipeline.time, "monotonic", lambda: 1.0)
    lines = []
    pipeline.Progress(lines.append, every=2.0)("reading 3 files")
    assert lines == ["[   0.0 s] reading 3 files"]


def test_lines_fit_100_columns_and_a_closed_stream_costs_only_the_progress():
    stream = io.StringIO()
    with Progress("report", stream, quiet_s=0) as p:
        p.note("x" * 300)
    assert all(len(line) <= 100 for line in stream.getvalue().splitlines())
    stream.close()
    p = Progress("report", stream, quiet_s=0)
    p.note("nothing raised")  # the write fails; progress turns itself off
    assert p.enabled is False
