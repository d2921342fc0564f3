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


SMALL = ["--target-seconds", "0.2", "--step-ms", "2", "--layers", "2", "--pages", "2", "--groups", "4"]


def test_a_serving_leg_whose_load_digests_are_dropped_is_invalid(tmp_path, monkeypatch):
    """A load whose digest the collector had no room for is counted unverified (queue_full)
    and never compared: the variant does less work and every compared load still matches.
    Such a run must not pass as verified."""
    from dsv4_idxk_probe.hicache.restore import RestoreVerifier

    submit, loads = RestoreVerifier._submit_page_ids, []

    def drop_every_other_load(self, pool, key, device_indices, n_pages, callback):
        if key == pool.load_key:
            loads.append(key)
            if len(loads) % 2:
                return None  # what the engine answers when its queue is full
        return submit(self, pool, key, device_indices, n_pages, callback)

    monkeypatch.setattr(RestoreVerifier, "_submit_page_ids", drop_every_other_load)
    rc = main(["--reps", "2", *SMALL, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "hicache_serving.json").read_text())
    assert len(loads) > 2
    assert rc == 1 and not report["valid"]
    assert report["restore_verdicts"]["match"] > 0 and report["restore_verdicts"]["mismatch"] == 0
    assert report["restore_verdicts"]["match"] < report["restore_on_loads"]
    assert report["restore_on_unverified_bytes"] > 0


def test_every_run_restores_the_same_rooms_of_a_step_and_pairs_alternate_which_runs_first(monkeypatch):
    """Runs differ only in the variant: a run's own room count picks the restoring rooms
    (the ring's count moves by an odd number between runs), and each pair after the first
    swaps which variant runs first."""
    import bench.hicache_serving as serving

    current, order, seen = [None], [], {}
    run = serving.one_run

    def one_run(args, traffic, wait, sync):
        order.append(current[0])
        admit, n = traffic.admit, [0]

        def counted(restore):
            position = n[0] % args.rooms_per_step
            seen.setdefault(current[0], set()).add((position, bool(restore)))
            n[0] += 1
            admit(restore)

        traffic.admit = counted
        try:
            return run(args, traffic, wait, sync)
        finally:
            del traffic.admit

    enter = serving.Probed.__enter__

    def entered(self):
        current[0] = "on" if self.runtime.config.hicache["restore_verify"] else "off"
        return enter(self)

    monkeypatch.setattr(serving, "one_run", one_run)
    monkeypatch.setattr(serving.Probed, "__enter__", entered)
    assert main(["--reps", "4", *SMALL]) == 0
    assert seen["on"] == seen["off"] == {(0, True), (1, False)}
    assert order == ["off", "on", "on", "off", "off", "on", "on", "off"]


def test_the_restore_profile_runs_small_on_the_cpu_and_holds_the_collector_off(capsys):
    """bench/hicache_profile.py: every case and variant timed, the collector held off for a
    burst (its note blocks until the burst is timed) and then caught up, no probe failure."""
    from bench import hicache_profile
    from dsv4_idxk_probe.safety import record_error

    try:  # a failure counted before the bench ran (another test's) is not the bench's
        raise RuntimeError("an earlier probe failure")
    except RuntimeError:
        record_error("test.earlier")
    assert hicache_profile.main(["--calls", "32", "--burst", "16", "--rounds", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    for variant in ("bare", "wrapped, collector running", "wrapped, collector held"):
        assert out.count(variant) == 2, out
    assert "cProfile, copying thread, wrapped backup" in out


def test_the_serving_leg_takes_the_restore_deferral(tmp_path):
    """`--restore-defer-ms` reaches the restore-on variant's config (step hicacheservingnodefer of bench/gpu_session.sh)."""
    from bench.hicache_serving import Probed

    probed = Probed(True, tmp_path, 0.0)
    assert probed.runtime.config.hicache["restore_defer_ms"] == 0.0
    assert "restore_record" not in probed.runtime.config.hicache  # the config's default
    assert Probed(True, tmp_path, None, "copy").runtime.config.hicache["restore_record"] == "copy"
