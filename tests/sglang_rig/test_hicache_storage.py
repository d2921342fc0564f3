"""HiCache restores verified by default (docs/hicache.md, "Restore verification"), on
SGLang's own prefill with HiCache on, round-trip mode OFF (the shipped defaults) and the
storage tier (L3) on SGLang's file backend (`--hicache-storage-backend file`, HiCacheFile,
CPU): one server pair for the module (about 2 min to start on the 2-core CI machine).

From the host pool (L2): the device pages each backup reads are digested and kept per host
row; the device pages each load writes are digested after it and compared. A host row
changed between its backup and its load reaches prefill's device page before prefill's PD
digest, so every PD digest point says `match`; restore verification names it at stage
`hicache_load`, with its pool, layer, host row, device page and segment.

From the storage tier (L3): every index-K page prefill stores in L3 is stored with its
backup digests beside it, under a sidecar key (docs/hicache.md, "The storage tier"), and
those digests are the digests of the stored bytes. A prompt whose pages left the device and
host pools (SGLang's /flush_cache, which keeps L3) is prefetched from L3 when sent again
(`--hicache-storage-prefetch-policy wait_complete`): each page read by
`HiCacheFile._read_page` brings its sidecar, and its load is compared at `hicache_load`;
a byte changed in a stored page's file is found there with its cells.

The tests run in file order on one pair: each counts the findings and verdicts it adds."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from dsv4_idxk_probe.digest.layout import get_layout
from dsv4_idxk_probe.digest.reference import segment_digests
from dsv4_idxk_probe.hicache.restore import SIDECAR_SUFFIX, decode_sidecar
from dsv4_idxk_probe.sglang import l3_files
from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.workload import Request

from .conftest import describe, start_session
from .test_pd_hicache import HOST_ROW_FAULT, INDEXER_POOL, PROMPTS, counters, hicache_records, wait_for

PROBE_CONFIG = "step_interval: 4\nhicache:\n  flush_interval_s: 1.0\n"
LAYERS = 2  # the rig's C4 layers (1 and 3): the index-K host pool's layers


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    store = tmp_path_factory.mktemp("l3")
    options = launch.ServerOptions(prefill_hicache=True, extra_prefill=(
        "--max-total-tokens", "16384", "--hicache-storage-backend", "file", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": str(store)}),
        # a prefetch from L3 is waited for: the default (`timeout`) may admit the resent prompt first
        "--hicache-storage-prefetch-policy", "wait_complete"))
    session = start_session(tmp_path_factory, "sglang-hicache-l3", options, PROBE_CONFIG)
    session.store = store
    yield session
    session.stop()


def indexer_pages(store: Path) -> dict[str, Path]:
    """The index-K pool's stored pages by their key (the file name before the pool's name)."""
    return {p.name.split(".", 1)[0]: p for p in store.glob(f"*.{INDEXER_POOL}_*.bin")
            if f".{INDEXER_POOL}_state" not in p.name}  # its C4 state pool is another pool


def sidecars(store: Path) -> dict[str, Path]:
    return {p.name.split(".", 1)[0]: p for p in store.glob(f"*.{INDEXER_POOL}{SIDECAR_SUFFIX}_*.bin")}


def load_verdicts(session, verdict: str) -> float:
    return counters(session, "rooms_verified_total", stage="hicache_load", verdict=verdict)


def restore_findings(session) -> list[dict]:
    return [r for r in hicache_records(session) if r.get("event") == "restore_mismatch"]


# -- restores from the host pool (L2)

def evict_then_resend(session, name: str, seed: int, number: int, faults: str | None = None):
    """One room's prompt, sixteen filler rooms that push its pages out to the host pool, and
    the prompt again: loaded back from the host pool in that round."""
    (first,) = workload.plan(name, workload.WorkloadOptions(rooms=1, seed=seed, **PROMPTS))
    phase = session.phase(f"{name}-seed", [Request(number, f"{name}-seed", first.input_ids, first.max_new_tokens)])
    assert phase.ok, describe(phase)
    fill = workload.plan(f"{name}fill", workload.WorkloadOptions(rooms=16, seed=seed + 100, **PROMPTS))
    phase = session.phase(f"{name}-fill", [Request(number + 1 + r.number, r.rid, r.input_ids, r.max_new_tokens)
                                           for r in fill])
    assert phase.ok, describe(phase)
    again = Request(number + 50, f"{name}-again", first.input_ids, first.max_new_tokens)
    return session.phase(name, [again], faults=faults)


def test_clean_hicache_traffic_is_verified_at_hicache_load_with_no_finding(rig):
    """Round trip off: backups digested, loads compared, every load a match, every index-K
    byte of the loads counted verified, nothing reported, no probe error."""
    assert counters(rig, "hicache_roundtrip_total") == 0  # round-trip mode is off
    phase = evict_then_resend(rig, "clean", seed=8, number=10)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert wait_for(lambda: load_verdicts(rig, "match") > 0, timeout_s=30), "no load was compared at hicache_load"
    assert load_verdicts(rig, "mismatch") == 0 and restore_findings(rig) == []
    # the copy path's coverage counts reach /metrics through the flusher (flush_interval_s), after the verdict
    assert wait_for(lambda: counters(rig, "coverage_bytes_total", path="hicache_load", outcome="verified",
                                     reason="none") > 0, timeout_s=30), "no verified hicache_load bytes counted"
    verified = counters(rig, "coverage_bytes_total", path="hicache_load", outcome="verified", reason="none")
    assert verified % (8448 * 2) == 0, verified  # whole host rows of both C4 layers
    assert counters(rig, "coverage_bytes_total", path="hicache_backup", outcome="verified", reason="none") > 0
    assert counters(rig, "coverage_bytes_total", path="hicache_load", outcome="unverified") == 0
    assert counters(rig, "errors_total") == 0


def test_a_host_row_changed_before_its_load_is_found_at_hicache_load_with_its_cells(rig, tmp_path):
    spec = tmp_path / "host-row.yaml"
    spec.write_text(HOST_ROW_FAULT.replace("room: 300", "room: 350"))
    mismatches_before, known = load_verdicts(rig, "mismatch"), len(restore_findings(rig))
    phase = evict_then_resend(rig, "hostrow", seed=21, number=300, faults=str(spec))
    applied = [f for f in phase.faults if f["applied"]]
    assert applied, [f["reason"] for f in phase.faults]
    (fault,) = applied
    (where,) = fault["roundtrip"]  # the host row and device page the injector changed and the load used
    # every PD digest point matches (both sides digest the changed bytes); decode's oracle sees them
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert fault["effects"] and all(e["oracle_stage"] == "decode_recv" for e in fault["effects"]), fault
    want = {(3, 1, where["host_row"], where["device_page"], segment)
            for e in fault["effects"] for segment in e["segments"]}
    assert want and {w[4] for w in want} == {"payload"}

    assert wait_for(lambda: load_verdicts(rig, "mismatch") > mismatches_before, timeout_s=30), \
        "restore verification did not report the changed host row"
    # prefill's room-log writer flushes on its own thread: the record may follow the metric
    assert wait_for(lambda: restore_findings(rig)[known:], timeout_s=30), "no restore_mismatch record in prefill's room log"
    (found,) = restore_findings(rig)[known:]
    assert (found["stage"], found["pool"], found["layout"]) == ("hicache_load", INDEXER_POOL, "fp8")
    got = {(c["layer"], c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]}
    assert got == want, (got, want)
    assert found["mismatch_rows"] == [where["host_row"]]
    # diagnosed with the journal: the device page's last event is this load, naming the host row
    (diag,) = found["diagnosis"]
    last = diag["events"][-1]
    assert (diag["device_page"], last["event"], last["host_row"], last["pool"]) == (
        where["device_page"], "hicache_load", where["host_row"], INDEXER_POOL)
    assert counters(rig, "mismatch_cells_total", stage="hicache_load", segment="payload") >= 1
    assert counters(rig, "mismatch_layer_hits_total", stage="hicache_load", layer="3") >= 1
    assert counters(rig, "hicache_roundtrip_total") == 0 and counters(rig, "errors_total") == 0


# -- the storage tier (L3)

def test_every_index_k_page_stored_in_l3_carries_the_digests_of_its_bytes(rig):
    mismatches_before, known = load_verdicts(rig, "mismatch"), len(restore_findings(rig))
    rooms = workload.plan("l3", workload.WorkloadOptions(rooms=6, seed=41, **PROMPTS))
    phase = rig.phase("l3", [Request(500 + r.number, r.rid, r.input_ids, r.max_new_tokens) for r in rooms])
    assert phase.ok, describe(phase)
    # L3 writes follow the backups, and each sidecar follows its backup's digests on the collector
    wait_for(lambda: indexer_pages(rig.store) and set(sidecars(rig.store)) == set(indexer_pages(rig.store)))
    pages, carried = indexer_pages(rig.store), sidecars(rig.store)
    assert pages, sorted(p.name for p in rig.store.iterdir())[:20]
    assert set(carried) == set(pages), (len(pages), len(carried))
    layout = get_layout("fp8")
    for key, sidecar in carried.items():
        decoded = decode_sidecar(np.fromfile(sidecar, dtype=np.uint8), LAYERS, len(layout.segments))
        assert decoded is not None, f"{sidecar.name} is not a sidecar of this pool's shape"
        digests, version = decoded
        assert version == l3_files.file_version(str(pages[key])), f"{key}: the sidecar names another page version"
        rows = np.fromfile(pages[key], dtype=np.uint8).reshape(LAYERS, layout.row_bytes)
        want = segment_digests(rows, np.full(LAYERS, layout.slots), layout)
        assert np.array_equal(digests, want), f"{key}: the sidecar's digests are not those of the stored page"
    assert load_verdicts(rig, "mismatch") == mismatches_before and restore_findings(rig)[known:] == []
    assert counters(rig, "errors_total") == 0 and counters(rig, "hicache_roundtrip_total") == 0


# -- restores from L3: the prompt's pages leave the device and host pools (SGLang's
# /flush_cache resets both, and keeps L3), so the resent prompt is prefetched from L3

FLUSH_IDLE_WAIT_S = 20  # SGLang defers the flush until its scheduler is idle, for at most this long


def flush_device_and_host(session) -> None:
    """SGLang's /flush_cache on prefill: the radix tree, device and host pools are reset; the
    storage tier keeps every page (UnifiedRadixCache.reset clears the host pool, not L3).
    SGLang flushes only an idle scheduler and otherwise answers 400 at once; with `timeout`
    it waits for idle (a busy machine leaves the last phase's work in flight a little longer)."""
    url = f"{session.cluster.server_url('prefill')}/flush_cache?timeout={FLUSH_IDLE_WAIT_S}"
    status, body = launch.http_get(url, timeout=FLUSH_IDLE_WAIT_S + 10)
    assert status == 200, body.decode(errors="replace")


def stored_in_l3(session, name: str, seed: int, number: int):
    """One room's prompt, served; waits until its index-K pages and their sidecars are in L3,
    then empties the device and host pools. Returns the prompt and its stored pages."""
    before = set(indexer_pages(session.store))
    (first,) = workload.plan(name, workload.WorkloadOptions(rooms=1, seed=seed, **PROMPTS))
    phase = session.phase(f"{name}-seed", [Request(number, f"{name}-seed", first.input_ids, first.max_new_tokens)])
    assert phase.ok, describe(phase)

    def new_pages():
        return {k: p for k, p in indexer_pages(session.store).items() if k not in before}

    assert wait_for(new_pages), "the prompt's index-K pages never reached L3"
    time.sleep(2.0)  # the prompt's last pages may follow its first ones
    pages = new_pages()
    # each sidecar follows its page (not asserted here: a build that stores none fails at the load)
    wait_for(lambda: set(pages) <= set(sidecars(session.store)), timeout_s=30)
    flush_device_and_host(session)
    return first, pages


def resend(session, name: str, first, number: int):
    """The prompt again: SGLang prefetches its pages from L3 (nothing of it is on the device or
    the host), and says so in prefill's log, with how many tokens it loaded."""
    phase = session.phase(name, [Request(number, f"{name}-again", first.input_ids, first.max_new_tokens)],
                          check_outputs=False)
    loaded = [(int(m), int(l)) for m, l in re.findall(
        rf"HiCache prefetch success req={name}-again completed=\d+ matched=(\d+) loaded=(\d+)",
        session.cluster.logs["prefill"].read_text())]
    assert loaded and loaded[-1][1] > 0, f"{name}: the resent prompt was not prefetched from L3 ({loaded})"
    return phase


def l3_verified(session) -> float:
    return counters(session, "coverage_bytes_total", path="l3", outcome="verified", reason="none")


def test_a_prompt_restored_from_l3_is_verified_at_hicache_load_with_no_finding(rig):
    """Round trip off: the resent prompt's pages come from L3 (HiCacheFile._read_page) with
    their sidecars; each load is compared with the digests its backup took, all match."""
    first, pages = stored_in_l3(rig, "l3clean", seed=52, number=600)
    l3_before, matches_before = l3_verified(rig), load_verdicts(rig, "match")
    mismatches_before, known = load_verdicts(rig, "mismatch"), len(restore_findings(rig))
    phase = resend(rig, "l3clean", first, 650)
    assert phase.ok, describe(phase)
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    # each page read from L3 is one host row of both C4 layers, counted once; the prefetch
    # thread counts page by page, so the count grows while the load runs: wait for all of it
    page_bytes = 8448 * LAYERS
    assert wait_for(lambda: l3_verified(rig) - l3_before >= len(pages) * page_bytes, timeout_s=60), \
        ("not every page read from L3 came with its sidecar (counted unverified, digest_lost, instead)",
         l3_verified(rig) - l3_before, len(pages))
    assert (l3_verified(rig) - l3_before) % page_bytes == 0
    assert wait_for(lambda: load_verdicts(rig, "match") > matches_before, timeout_s=30), \
        "the pages read from L3 were never loaded and compared at hicache_load"
    assert load_verdicts(rig, "mismatch") == mismatches_before and restore_findings(rig)[known:] == []
    assert counters(rig, "coverage_bytes_total", path="l3", outcome="unverified") == 0
    assert counters(rig, "errors_total") == 0 and counters(rig, "hicache_roundtrip_total") == 0


def test_a_page_changed_in_l3_is_found_at_hicache_load_with_its_cells(rig):
    """One byte of one stored index-K page (the model's layer 3, a payload byte) is changed in
    its file between the write and the read, as storage corrupts it (the file's metadata
    unchanged: a rewrite the file system dates is another page, docs/hicache.md); the page is read back into a host row and loaded
    into a device page. Prefill digests the changed bytes, so decode agrees with it; the
    sidecar's digests (of the bytes the backup read) do not: a finding at `hicache_load`."""
    first, pages = stored_in_l3(rig, "l3fault", seed=63, number=700)
    path = pages[sorted(pages)[0]]
    layout = get_layout("fp8")
    data = np.fromfile(path, dtype=np.uint8).reshape(LAYERS, layout.row_bytes)
    slot = 5
    offset = layout.segments[0].offset + slot * layout.segments[0].slot_bytes + 17  # payload, pool layer 1
    data[1, offset] ^= 0x40
    st = os.stat(path)
    data.tofile(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # storage's corruption: the bytes change, the metadata not
    mismatches_before, known = load_verdicts(rig, "mismatch"), len(restore_findings(rig))
    phase = resend(rig, "l3fault", first, 750)
    assert not phase.failed_requests, describe(phase)
    # both sides digest the changed bytes: every PD digest point matches
    assert phase.verification.verdicts == {"match": 1}, describe(phase)
    assert wait_for(lambda: load_verdicts(rig, "mismatch") > mismatches_before, timeout_s=30), \
        "restore verification did not report the page changed in L3"
    assert wait_for(lambda: restore_findings(rig)[known:], timeout_s=30), "no restore_mismatch record in prefill's room log"
    (found,) = restore_findings(rig)[known:]
    assert (found["stage"], found["pool"], found["layout"]) == ("hicache_load", INDEXER_POOL, "fp8")
    assert found["rows"] == len(pages), (found["rows"], len(pages))  # the load carried every page read from L3
    ((host_row,),) = [found["mismatch_rows"]]
    (diag,) = found["diagnosis"]
    last = diag["events"][-1]
    # the device page's last event is the load that carried the host row the L3 read filled
    assert (last["event"], last["host_row"], last["pool"]) == ("hicache_load", host_row, INDEXER_POOL), last
    got = {(c["layer"], c["pool_layer"], c["host_row"], c["device_page"], c["segment"]) for c in found["cells"]}
    assert got == {(3, 1, host_row, diag["device_page"], "payload")}, got
    assert counters(rig, "mismatch_cells_total", stage="hicache_load", segment="payload") >= 1
    assert counters(rig, "hicache_roundtrip_total") == 0 and counters(rig, "errors_total") == 0
