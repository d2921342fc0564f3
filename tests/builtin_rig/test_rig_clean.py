"""500 clean rooms: zero mismatches anywhere, every stage verified, metrics say so too.

Pages are reused many times over (a small pool, LIFO free lists), rooms have
partial tail pages, decode-side prefixes and several chunks, so a probe that
digested a stale or unfrozen byte would show up here as a false mismatch.
"""

from __future__ import annotations

import urllib.request

import pytest
from tests.support.rigutil import diff_rooms, dump, run

from dsv4_idxk_probe.testbed.builtin.config import RigConfig
from dsv4_idxk_probe.testbed.faults.verify import verify

ROOMS = 500
INTERVAL = 4


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    scraped = {}

    def on_event(event):
        if event[:2] == ("done", "decode"):  # decode's counters are final; the port is still up
            scraped["text"] = urllib.request.urlopen(result_url[0], timeout=10).read().decode()
        if event[0] == "metrics":
            result_url.append(event[2])

    result_url: list[str] = []
    cfg = RigConfig(rooms=ROOMS, layers=2, min_tokens=16, max_tokens=900, chunk_tokens=256, prefix_fraction=0.3,
                    min_steps=0, max_steps=9, max_running=24, pool_source="builtin", seed=11)
    result = run(tmp, cfg, step_interval=INTERVAL, metrics_port=0, on_event=on_event)
    return result, tmp, scraped.get("text", "")


def test_every_room_verified_and_nothing_mismatches(clean):
    result, tmp, _ = clean
    status, doc, rooms = diff_rooms(tmp / "logs")
    assert status == 0, dump(doc["summary"])
    plan = result.config.room_plan()
    assert len(rooms) == ROOMS and result.finished == {p.room for p in plan}
    assert doc["summary"]["room_verdicts"] == {"match": ROOMS}
    assert doc["summary"]["prefill_only_rooms"] == 0 and doc["summary"]["bad_lines"] == 0
    step_digests = result.stats["decode"]["step_digests"]  # rooms still running on every INTERVAL-th batch
    assert step_digests > ROOMS // 2
    expected_records = 2 * ROOMS + step_digests
    assert sum(len(r["stages"]) for r in rooms.values()) == expected_records
    assert any(p.prefix_pages for p in plan) and any(p.prompt_tokens % 256 for p in plan)


def test_loop_clock_counts_every_probe_call_on_both_serving_loops(clean):
    """What bench/overhead.py reads: one timed call per allocation (the journal event and,
    with diagnosis, the snapshot's launch: the probe's, not the loop's own work), per
    receipt, per finishing batch, per step batch, per send."""
    result, *_ = clean
    decode, prefill = result.stats["decode"], result.stats["prefill"]
    calls = decode["probe_by_kind"]
    assert calls["allocate"]["calls"] == calls["receive"]["calls"] == ROOMS
    assert 0 < calls["finish"]["calls"] <= ROOMS and calls["step"]["calls"] <= decode["batches"] // INTERVAL
    assert prefill["probe_by_kind"]["send"]["calls"] == ROOMS
    assert decode["probe_s"] > 0 and decode["sleeps"] == 0  # this rig run models no forward time
    assert all(k["cpu_median_us"] > 0 and k["max_us"] >= k["median_us"] for k in calls.values())
    phases = prefill["phases"]  # prefill's own work, timed with the probe on and off alike
    assert phases["room"]["calls"] == ROOMS and phases["digest and metadata row"]["calls"] == ROOMS
    assert phases["forward (ground truth)"]["calls"] >= ROOMS
    assert phases["room"]["total_s"] >= phases["forward (ground truth)"]["total_s"] + prefill["probe_s"]
    assert decode["running_sum"] >= decode["batches"] and decode["loop_s"] > decode["probe_s"]
    assert 0 < decode["busy_batches"] < decode["batches"] and decode["busy_batch_median_us"] > 0


def test_pages_were_reused(clean):
    result, *_ = clean
    pages = result.info["decode"]["pages"]
    total = sum(p.total_pages for p in result.config.room_plan())
    assert total > 3 * pages  # every decode page held several rooms in turn


def test_oracle_agrees(clean):
    result, tmp, _ = clean
    check = verify(tmp / "logs", result.faults, result.oracle, sorted(result.finished))
    assert check.ok and check.oracle_disagreements == [] and check.oracle_checked > ROOMS
    assert all(not o["cells"] for o in result.oracle)


def test_metrics_endpoint_counts_the_same(clean):
    result, _, text = clean
    assert text, "metrics were not scraped"
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}

    def value(stage, verdict):
        return sum(v for k, v in lines.items()
                   if k.startswith("dsv4_idxk_probe_rooms_verified_total{") and f'stage="{stage}"' in k and f'verdict="{verdict}"' in k)

    assert value("decode_recv", "match") == ROOMS
    assert value("decode_finish", "match") == ROOMS
    assert sum(value(s, "mismatch") for s in ("decode_recv", "decode_step", "decode_finish")) == 0
    digested = sum(v for k, v in lines.items() if k.startswith("dsv4_idxk_probe_rooms_digested_total{") and 'stage="prefill_send"' in k)
    assert digested == ROOMS
