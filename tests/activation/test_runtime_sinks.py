"""Runtime: metrics created on first use (with what is known by then), room log on first record."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from dsv4_idxk_probe.config import parse_config
from dsv4_idxk_probe.roomlog import read_entries
from dsv4_idxk_probe.runtime import Runtime


def test_room_log_is_written_under_the_configured_dir(tmp_path):
    config = parse_config({"roomlog": {"dir": "logs", "gzip": False}}, "probe.yaml", tmp_path)
    runtime = Runtime(config, registry=CollectorRegistry(), identity=lambda: {"role": "decode", "rank": "tp1"})
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
    identity.update(role="prefill", model="dsv4", rank="tp0")  # published later by the host
    labels = {"role": "prefill", "model": "dsv4", "rank": "tp0"}
    runtime.metrics.rooms_digested.labels(stage="prefill_send").inc()
    assert registry.get_sample_value("dsv4_idxk_probe_rooms_digested_total", {**labels, "stage": "prefill_send"}) == 1
    assert registry.get_sample_value(
        "dsv4_idxk_probe_patch_target_status", {**labels, "target": "pd.send_kv_chunk", "status": "patched"}
    ) == 1
    assert registry.get_sample_value(
        "dsv4_idxk_probe_patch_target_status", {**labels, "target": "pd.send_kv_chunk", "status": "missing"}
    ) == 0
    assert registry.get_sample_value(
        "dsv4_idxk_probe_rooms_verified_total", {**labels, "stage": "decode_recv", "verdict": "mismatch"}
    ) == 0  # zero visible from the start
    runtime.close()
