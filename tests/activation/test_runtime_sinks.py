"""Runtime: metrics created on first use (with what is known by then), room log on first record."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from dsv4_idxk_probe.config import parse_config
from dsv4_idxk_probe.roomlog import read_entries
from dsv4_idxk_probe.runtime import Runtime


def test_room_log_is_written_under_the_configured_dir(tmp_path):
    config = parse_config({"roomlog": {"dir": "logs", "gzip": False}}, "probe.yaml", tmp_path)
    runtime = Runtime(config, registry=CollectorRegistry(), identity=lambda: {"engine_type": "decode", "tp_rank": "1"})
    runtime.emit({"v": 1, "kind": "room", "room": "5", "stage": "decode_recv"})
    runtime.close()
    files = sorted((tmp_path / "logs").iterdir())
    assert [f.name.split("-")[0] for f in files] == ["decode"]
    entries = list(read_entries([str(files[0])]))
    assert [e.record["room"] for e in entries] == ["5"]


def test_metrics_take_identity_at_first_use_and_replay_target_status():
    identity = {}
    registry = CollectorRegistry()
    runtime = Runtime(parse_config(None), registry=registry, identity=lambda: identity)
    runtime.set_target_status("pd.send_kv_chunk", "patched", True)
    # published later by the host, as SGLang labels its own metrics
    identity.update(model_name="dsv4", engine_type="prefill", tp_rank="0", pp_rank="0", moe_ep_rank="0")
    labels = dict(identity)
    runtime.metrics.rooms_digested.labels(stage="prefill_send").inc()
    assert registry.get_sample_value("dsv4_idxk_probe_rooms_digested_total", {**labels, "stage": "prefill_send"}) == 1
    assert registry.get_sample_value(
        "dsv4_idxk_probe_patch_target_status", {**labels, "target": "pd.send_kv_chunk", "status": "patched"}
    ) == 1
    assert registry.get_sample_value(
        "dsv4_idxk_probe_patch_target_status", {**labels, "target": "pd.send_kv_chunk", "status": "missing"}
    ) == 0
    assert registry.get_sample_value(
        "dsv4_idxk_probe_rooms_digested_total", {**labels, "stage": "prefill_send"}) == 1
    assert registry.get_sample_value(
        "dsv4_idxk_probe_records_dropped_total", {**labels, "sink": "roomlog"}) == 0  # zero visible from the start
    assert registry.get_sample_value(  # prefill never judges: no verdict series
        "dsv4_idxk_probe_rooms_verified_total", {**labels, "stage": "decode_recv", "verdict": "mismatch"}) is None
    from dsv4_idxk_probe.version import __version__

    state = {**labels, "mode": "observe", "version": __version__}
    assert registry.get_sample_value("dsv4_idxk_probe_info", {**state, "state": "on", "reason": "running"}) == 1
    runtime.close()
    assert registry.get_sample_value("dsv4_idxk_probe_info", {**state, "state": "on", "reason": "running"}) == 0
    assert registry.get_sample_value("dsv4_idxk_probe_info", {**state, "state": "off", "reason": "uninstalled"}) == 1


def test_a_broken_config_publishes_the_broken_state_once_the_labels_are_known():
    from dsv4_idxk_probe import activation
    from dsv4_idxk_probe.runtime import report_broken

    identity = {}
    registry = CollectorRegistry()
    thread = report_broken("config_error", registry=registry, identity=lambda: identity, wait_s=10)
    assert not list(registry.collect())  # nothing yet: SGLang has not published the ranks
    identity.update(model_name="dsv4", engine_type="decode", tp_rank="2", pp_rank="0", moe_ep_rank="0")
    thread.join(timeout=10)
    assert not thread.is_alive()
    labels = {**identity, "state": "broken", "reason": "config_error", "mode": "observe"}
    samples = [s for f in registry.collect() for s in f.samples]
    assert [s.value for s in samples if s.labels.items() >= labels.items()] == [1]
    # A process that never publishes ranks (the tokenizer) reports nothing, and stops waiting.
    quiet = CollectorRegistry()
    thread = report_broken("config_error", registry=quiet, identity=lambda: {"model_name": "dsv4"}, wait_s=0.5)
    thread.join(timeout=5)
    assert not thread.is_alive() and not list(quiet.collect())
    assert activation.loaded is False
