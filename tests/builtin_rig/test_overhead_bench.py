"""bench/overhead.py runs probe configs against each other: each named variant reaches
the rig's children as a config file the product's own loader accepts."""

import json

import pytest


@pytest.fixture
def overhead():
    from bench import overhead

    return overhead


@pytest.mark.parametrize("variants", ["observe,off", "off", "off,observe,fast"])
def test_variants_must_start_with_off_and_be_known(overhead, variants, capsys):
    with pytest.raises(SystemExit):
        overhead.parse_args(["--rig-variants", variants])
    assert "--rig-variants must start with off" in capsys.readouterr().err


def test_each_variant_becomes_the_config_its_children_load(overhead, tmp_path):
    from dsv4_idxk_probe import environment_variables as ev
    from dsv4_idxk_probe.config import load_config

    assert overhead.parse_args(["--rig-variants", "off, observe-poll"]).rig_variants == ("off", "observe-poll")
    assert overhead.rig_env("off", tmp_path, 8).common == {}
    waits, diagnosis, outputs = {}, {}, {}
    for variant in ("observe", "observe-poll", "observe-diag", "observe-nodiag", "observe-pinned"):
        run_dir = tmp_path / variant
        run_dir.mkdir()
        env = overhead.rig_env(variant, run_dir, 8).common
        config = load_config({ev.DSV4_IDXK_PROBE: env[ev.DSV4_IDXK_PROBE], ev.DSV4_IDXK_PROBE_CONFIG: env[ev.DSV4_IDXK_PROBE_CONFIG]})
        assert config.step_interval == 8 and config.roomlog.dir == str(run_dir / "logs")
        waits[variant] = config.digest.collector_wait
        diagnosis[variant] = config.diagnosis.enabled
        outputs[variant] = config.digest.outputs
    assert waits == {"observe": "block", "observe-poll": "poll", "observe-diag": "block", "observe-nodiag": "block",
                     "observe-pinned": "block"}
    # the defaults have diagnosis on; observe-nodiag is verification alone
    assert diagnosis == {"observe": True, "observe-poll": True, "observe-diag": True, "observe-nodiag": False,
                         "observe-pinned": True}
    assert outputs == {"observe": "device", "observe-poll": "device", "observe-diag": "device",
                       "observe-nodiag": "device", "observe-pinned": "pinned"}


def test_a_three_variant_run_reports_each_against_off(overhead, tmp_path):
    import torch

    threads = torch.get_num_threads()
    try:  # main() pins this process to one thread, as a benchmark should
        code = overhead.main(["--reps", "1", "--rooms", "8", "--skip-hostpool", "--rig-variants",
                              "off,observe,observe-poll", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "overhead.json").read_text())["rig"]
    assert code == 0 and report["valid"]
    assert set(report["runs"]) == {"off", "observe", "observe-poll"}
    for variant in ("observe", "observe-poll"):
        run = report["runs"][variant][0]
        assert run["probe_log"]["ok"] and run["decode_busy_tokens_per_s"] > 0
        assert len(report["steady_rooms_per_s_ratio"][variant]["per_pair"]) == 1
        assert len(report["decode_busy_tokens_per_s_ratio"][variant]["per_pair"]) == 1
    # Each finished rep is kept as it ends, so a run cut by a time limit still leaves its pairs.
    partial = json.loads((tmp_path / "overhead.partial.json").read_text())
    assert partial["reps_done"] == 1
    assert partial["steady_rooms_per_s_ratio"] == report["steady_rooms_per_s_ratio"]
