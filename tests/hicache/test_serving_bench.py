"""The HiCache serving leg (bench/hicache_serving.py) runs on the CPU, small: its restore-on
runs compare loads, every one `match`, with no probe failure, and it reports a ratio per pair."""

from __future__ import annotations

import json

from bench.hicache_serving import main


def test_the_serving_leg_runs_small_on_the_cpu_and_every_compared_load_matches(tmp_path):
    rc = main(["--reps", "2", "--target-seconds", "0.2", "--step-ms", "2", "--layers", "2", "--pages", "2",
               "--groups", "4", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "hicache_serving.json").read_text())
    assert rc == 0 and report["valid"]
    assert report["restore_verdicts"]["match"] > 0 and report["restore_verdicts"]["mismatch"] == 0
    assert report["restore_verdicts"]["unverified"] == 0 and report["probe_errors"] == 0
    assert len(report["rooms_per_s_ratio"]["per_pair"]) == 2
    assert all(run["rooms"] > 0 for runs in report["runs"].values() for run in runs)
