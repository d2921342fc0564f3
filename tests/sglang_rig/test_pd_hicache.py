"""HiCache on prefill (`--enable-hierarchical-cache`, direct io backend, layer_first):
SGLang's own DeepSeek-V4 host pools back device pages up and load them back for
prefix hits, through the wrapped backup/load methods and the probe's branch counters.
Round-trip mode is on, so the probe also compares every backed-up and loaded-back
index-K row with the bytes it came from (docs/hicache.md), and a host row changed
between its backup and its load is named with the load that carried it
(docs/diagnosis.md, "Round-trip diagnosis").

HiCache on decode cannot run with DeepSeek-V4 on SGLang 0.5.23 (decode's radix cache
with HiCache is refused for sliding-window models; docs/rig.md), so neither can
host-receive decode; test_sglang_refusals.py shows it."""

from __future__ import annotations

import re
import time

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.workload import Request

from .conftest import describe, pair_fixture

# A small device pool on prefill, so the radix cache evicts rooms to the host pool,
# and prompts of six pages, so a repeated prompt's pages are still on the host
# (the SWA host pool holds only 64 pages).
OPTIONS = launch.ServerOptions(prefill_hicache=True, extra_prefill=("--max-total-tokens", "16384"))
PROBE_CONFIG = "step_interval: 4\nhicache:\n  roundtrip: true\n  flush_interval_s: 1.0\n"
INDEXER_POOL = "deepseek_v4_c4_indexer"
PROMPTS = dict(min_prompt=1500, max_prompt=1600, min_new_tokens=4, max_new_tokens=8, shared_prefix_share=0.0)

rig = pair_fixture("sglang-hicache", OPTIONS, PROBE_CONFIG)


def counters(session, name: str, **labels: str) -> float:
    """The sum of `dsv4_idxk_probe_<name>` samples on prefill's /metrics whose labels include `labels`."""
    status, body = launch.http_get(session.cluster.server_url("prefill") + "/metrics", timeout=10)
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(f"dsv4_idxk_probe_{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def copies(session, direction: str, branch: str) -> float:
    return counters(session, "hicache_copies_total", pool=INDEXER_POOL, direction=direction, branch=branch)


def wait_for(predicate, timeout_s: float = 60.0) -> bool:
    """HiCache copies behind the forward and the probe's flusher publishes later: poll."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(1.0)
    return predicate()


def cached_tokens(session) -> list[int]:
    return [int(n) for n in re.findall(r"#cached-token: (\d+)", session.cluster.logs["prefill"].read_text())]


def test_a_prompt_resent_after_filler_traffic_is_loaded_back_from_the_host_on_the_first_round(rig):
    """The load path (`load_to_device_per_layer` on prefill) is reached: two rooms are backed
    up, sixteen filler rooms push them out of the small device pool, and the two prompts sent
    once more are prefix hits on the host pool, loaded back to the device in that very round."""
    first = workload.plan("hicache", workload.WorkloadOptions(rooms=2, seed=8, **PROMPTS))
    phase = rig.phase("first", first)
    assert phase.ok, describe(phase)
    assert wait_for(lambda: copies(rig, "d2h", "page") > 0), "nothing was backed up to the host pool"

    fill = workload.plan("fill", workload.WorkloadOptions(rooms=16, seed=9, **PROMPTS))
    phase = rig.phase("fill", [Request(10 + r.number, r.rid, r.input_ids, r.max_new_tokens) for r in fill])
    assert phase.ok, describe(phase)
    hits_before = sum(n > 0 for n in cached_tokens(rig))
    loads_before, pages_before = copies(rig, "h2d", "page"), counters(rig, "hicache_pages_total", pool=INDEXER_POOL,
                                                                       direction="h2d")
    again = [Request(100 + r.number, f"again-{r.number}", r.input_ids, r.max_new_tokens) for r in first]
    phase = rig.phase("again", again)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": len(again)}, describe(phase)
    assert wait_for(lambda: copies(rig, "h2d", "page") > loads_before, timeout_s=30), \
        "the resent prompts loaded nothing back from the host pool (load_to_device_per_layer never ran)"
    assert counters(rig, "hicache_pages_total", pool=INDEXER_POOL, direction="h2d") > pages_before
    assert sum(n > 0 for n in cached_tokens(rig)) > hits_before, "the resent prompts were no prefix hits"
    # index-K stayed page-aligned: the token-granular branch was never taken
    assert copies(rig, "d2h", "token") == 0 and copies(rig, "h2d", "token") == 0

    # Round-trip mode compared the loaded-back rows with what was backed up, and the
    # device rows after each load with the host rows: all matched, none unverified.
    assert wait_for(lambda: counters(rig, "hicache_roundtrip_total", pool=INDEXER_POOL, leg="h2d", verdict="match") > 0)
    for leg in ("d2h", "host", "h2d"):
        assert counters(rig, "hicache_roundtrip_total", pool=INDEXER_POOL, leg=leg, verdict="match") > 0, leg
        assert counters(rig, "hicache_roundtrip_total", pool=INDEXER_POOL, leg=leg, verdict="mismatch") == 0, leg
    assert counters(rig, "hicache_roundtrip_total", pool=INDEXER_POOL, leg="host", verdict="unverified") == 0
    assert counters(rig, "hicache_guard_total") == 0 and counters(rig, "errors_total") == 0


# A byte of a frozen slot's payload, in the indexer host pool's copy of a page the room loads
# back, after the backup stored it and before the load (docs/faults.md, in_host_pool).
# Layer 3 is the model's second C4 layer (the index-K host pool's layer 1): every record and
# line must name it 3, as `diff` names layers (global ids), not by its place in the pool.
HOST_ROW_FAULT = """faults:
  - name: host-row-changed-while-resident
    room: 300
    when: in_host_pool
    kind: byte_set
    where: {layer: 3, segment: payload}
"""


def hicache_records(session) -> list[dict]:
    """The HiCache probe's records in the room logs (only prefill runs HiCache here)."""
    from dsv4_idxk_probe.roomlog.reader import expand_inputs, read_entries

    entries = read_entries(expand_inputs([str(session.log_dir)]))
    return [e.record for e in entries if e.record is not None and e.record.get("kind") == "hicache"]


def test_a_host_row_changed_between_backup_and_load_is_named_by_round_trip_with_its_load(rig, tmp_path, capsys):
    """The changed row reaches prefill's device page before prefill's digest, so both sides
    digest the same wrong bytes and every digest point matches (the oracle on decode sees the
    change). Round-trip mode sees it: the host row's `host` leg, after a backup that matched;
    the journal's load into the device page carries the row and its checks; the room log,
    the metrics and `diff` name the load as the last event."""
    from dsv4_idxk_probe.cli.main import run

    spec = tmp_path / "host-row.yaml"
    spec.write_text(HOST_ROW_FAULT)
    (seed,) = workload.plan("hostrow", workload.WorkloadOptions(rooms=1, seed=21, **PROMPTS))
    phase = rig.phase("hostrow-seed", [Request(200, "hostrow-seed", seed.input_ids, seed.max_new_tokens)])
    assert phase.ok, describe(phase)
    # push the seed's pages out of the device pool, then send its prompt again: it is loaded back
    fill = workload.plan("hrfill", workload.WorkloadOptions(rooms=16, seed=30, **PROMPTS))
    phase = rig.phase("hostrow-fill", [Request(210 + r.number, r.rid, r.input_ids, r.max_new_tokens) for r in fill])
    assert phase.ok, describe(phase)
    phase = rig.phase("hostrow", [Request(300, "hostrow-again", seed.input_ids, seed.max_new_tokens)], faults=str(spec))
    applied = [f for f in phase.faults if f["applied"]]
    assert applied, [f["reason"] for f in phase.faults]
    # the rig's own verdict: no digest point reported it, the oracle saw it on decode, and
    # round trip named the row, the leg, the backup's verdict and the load (testbed.faults.verify)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    (fault,) = applied
    (want,) = fault["roundtrip"]
    assert fault["effects"] and all(e["oracle_stage"] == "decode_recv" for e in fault["effects"]), fault
    # the model's layer 3, the pool's layer 1: named 3 everywhere below, as `diff` names layers
    assert (want["layer"], want["pool_layer"]) == (3, 1) and fault["target"]["layers"] == [3], fault

    # the room log (prefill): the host leg's mismatch, and the diagnosis with the journal's events
    records = hicache_records(rig)
    assert any(r.get("event") == "roundtrip_mismatch" and r["leg"] == "host" and r["host_row"] == want["host_row"]
               and r["layer"] == want["layer"] for r in records)
    (diag,) = [r for r in records if r.get("event") == "roundtrip_diagnosis"]
    assert (diag["host_row"], diag["layer"], diag["pool_layer"], diag["device_page"], diag["leg"]) == (
        want["host_row"], 3, 1, want["device_page"], "host")
    assert diag["checks"] == {"d2h": "match", "host": "mismatch", "h2d": "match"}
    load = diag["events"][-1]
    assert (load["event"], load["page"], load["host_row"], load["pool"]) == (
        "hicache_load", want["device_page"], want["host_row"], INDEXER_POOL)
    assert load["host_row_checks"]["host"] == "mismatch" and load["host_row_checks"]["layers"] == [3]

    # the metrics and what an operator's `diff` prints
    assert counters(rig, "hicache_roundtrip_total", pool=INDEXER_POOL, leg="host", verdict="mismatch") >= 1
    capsys.readouterr()
    assert run(["diff", str(rig.log_dir)]) == 1
    out = capsys.readouterr().out
    assert ("hicache round trip: 1 host row changed in host memory while resident (matched at backup), "
            "last event hicache_load") in out, out
    assert (f"{INDEXER_POOL} host row {want['host_row']} layer 3: changed in host memory while "
            f"resident (matched at backup); loaded into device page {want['device_page']}, last event hicache_load") in out


def test_sglangs_own_metrics_fill_every_dashboard_variable_and_panel(rig, tmp_path):
    """A real Prometheus scrapes SGLang's own /metrics of both servers while rooms with the
    shipped faults run: every dashboard variable returns its label and every panel a
    series (the HiCache rows included), but "Digest GPU time" (observed on CUDA only)."""
    import shutil

    from dsv4_idxk_probe.testbed.faults.summary import shipped_fault_spec
    from tests.support.prometheus_server import Prometheus, wait_for as wait_until
    from tests.support.promql import dashboard_gaps

    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: run .ci/install-test-services.sh (make test does)"
    targets = [rig.cluster.server_url(role).split("://", 1)[1] for role in ("prefill", "decode")]
    prom = Prometheus(binary, tmp_path, targets)
    try:
        wait_until("prometheus to be ready", prom.ready)
        requests = workload.plan("dash", workload.WorkloadOptions(rooms=48, seed=1, shared_prefix_share=0.0))
        phase = rig.phase("dash", [Request(r.number, r.rid, r.input_ids, r.max_new_tokens) for r in requests],
                          faults=str(shipped_fault_spec()))
        assert phase.ok, describe(phase)

        failures, checked = dashboard_gaps(prom, ("Digest GPU time",))  # observed on CUDA only
        deadline = time.monotonic() + 60  # the probes' flushers publish behind the rooms; scrapes every second
        more_at = time.monotonic() + 20
        while failures and time.monotonic() < deadline:
            time.sleep(2)
            if time.monotonic() > more_at:
                # a rate panel needs its counter to move between two scrapes: on a loaded machine
                # the first scrapes can come after the last room was counted, so a few more rooms
                # (once) make the counters move again while Prometheus scrapes
                more_at = deadline
                extra = workload.plan("dash-more", workload.WorkloadOptions(rooms=6, seed=2, shared_prefix_share=0.0))
                again = rig.phase("dash-more", [Request(500 + r.number, r.rid, r.input_ids, r.max_new_tokens)
                                                for r in extra])
                assert again.ok, describe(again)
            failures, checked = dashboard_gaps(prom, ("Digest GPU time",))
    finally:
        prom.stop()
    assert not failures, "\n".join(failures)
    assert len(checked) >= 20 and any(w.startswith("HiCache") for w in checked), checked
