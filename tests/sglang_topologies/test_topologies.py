"""SGLang 0.5.23's prefill and decode servers in production topologies (docs/rig.md,
"Topologies"): attention TP 2 on both sides, prefill TP 2 against decode TP 1, prefill
PP 2 against decode PP 1, prefill and decode on two hosts (network namespaces the rig
makes) with and without the exchange's secret, and Mooncake's transfer engine with the
in-band digest forced late. Each pair runs the same four faults, one per stage a fault
can first show at; every probe verdict must equal the byte oracle's at every digest point,
and every fault must be found at the oracle's stage, localised to its cells.

One pair runs at a time (the `pairs` fixture); tests are ordered by pair.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dsv4_idxk_probe.testbed.sglang import launch, workload
from dsv4_idxk_probe.testbed.sglang.deferral import ENV_DEFER_INBAND
from sglang_rig.conftest import decode_records, describe

FAULTS = Path(__file__).with_name("faults.yaml")
FAULT_NAMES = {"source-changed-after-digest", "bit-in-transit", "zeroed-after-receipt", "overwritten-during-decode"}
WITH_SECRET = "step_interval: 4\nexchange:\n  secret_file: {secret}\n"


#: The rooms of FAULTS corrupt as they land (`before_send`, `in_flight`): enforce refuses them.
CORRUPT_AT_RECEIPT = (2, 3)


def faults_phase(rig, name: str, seed: int, rejected: tuple[int, ...] = ()):
    requests = workload.plan(name, workload.fault_workload(FAULTS, rooms=8, seed=seed, max_new_tokens=12))
    return rig.phase(name, requests, faults=str(FAULTS), rejected=rejected)


def assert_every_fault_found(phase) -> None:
    """phase.ok: each fault at the oracle's stage and cells, nothing else reported, every
    verdict the oracle's; and each of the four was applied and is one the probe must see."""
    assert phase.ok, describe(phase)
    applied = [c for c in phase.verification.checks if c.record["applied"]]
    assert {c.record["name"] for c in applied} == FAULT_NAMES, describe(phase)
    assert all(c.expected for c in applied), [(c.label, c.note) for c in applied if not c.expected]
    stages = {e["stage"] for c in applied for e in c.expected}
    assert stages == {"decode_recv", "decode_step"}, stages
    assert phase.verification.verdicts.get("mismatch", 0) == len(FAULT_NAMES), describe(phase)


def rank_logs(rig, role: str) -> int:
    """How many processes of `role` wrote room records (one room log per scheduler rank)."""
    return sum(1 for p in rig.log_dir.glob(f"{role}-*.jsonl") if '"kind":"room"' in p.read_text())


# %% prefill TP 2 -> decode TP 2, on two hosts, with the exchange's secret


def test_tp2_to_tp2_across_two_hosts_with_the_secret_finds_every_fault(pairs):
    """In enforce mode: the two decode ranks agree at start and refuse the same rooms (SGLang's
    batches stay alike across the attention-TP group: a rank alone would hang its collectives)."""
    rig = pairs.get("tp2-tp2-two-hosts", launch.ServerOptions(prefill_tp=2, decode_tp=2),
                    probe_config=WITH_SECRET + "mode: enforce\n", two_hosts=True)
    phase = faults_phase(rig, "tp22", seed=21, rejected=CORRUPT_AT_RECEIPT)
    assert_every_fault_found(phase)  # the refusals too: a rank that had not agreed would have left both off
    assert rank_logs(rig, "prefill") == 2 and rank_logs(rig, "decode") == 2
    hosts = rig.options.hosts
    prefill_log = rig.cluster.logs["prefill"].read_text()
    # the exchange left loopback for prefill's own address on the link to decode
    assert re.search(rf"exchange listens on routable address {re.escape(hosts.prefill_ip)}\b", prefill_log), \
        prefill_log[-2000:]


# %% prefill PP 2 -> decode PP 1: SGLang 0.5.23 refuses it for DeepSeek-V4


PP_REFUSAL = "PP-heterogeneous transfer requires layer ids on both peers"


def test_pp2_to_pp1_is_refused_by_sglang_at_the_first_transfer(pairs):
    """Both servers start (each prefill stage holds its own C4 layer), but SGLang's KV manager
    cannot pair a stage's KV entries with decode's: the DeepSeek-V4 pool reports no layer ids
    (`build_kv_layer_ids` answers [] for it) and positional pairing is refused between pools of
    different sizes, so prefill's bootstrap thread dies on the first request and that
    request never gets its KV (docs/rig.md). Should a release accept it, this test fails and
    the pair can be judged like the others."""
    rig = pairs.get("pp2-pp1", launch.ServerOptions(prefill_pp=2))
    (request,) = workload.plan("pp21", workload.WorkloadOptions(rooms=1, seed=25, max_new_tokens=8))
    sender = threading.Thread(target=workload.send, args=(rig.cluster.url, [request], 1), daemon=True)
    sender.start()
    deadline = time.monotonic() + 120
    log = rig.cluster.logs["prefill"]
    while time.monotonic() < deadline and PP_REFUSAL not in log.read_text(errors="replace"):
        time.sleep(1.0)
    text = log.read_text(errors="replace")
    assert PP_REFUSAL in text and "bootstrap_thread died" in text, rig.cluster.log_tail("prefill", 60)
    assert "got src=" in text  # the stage's entries against decode's, as SGLang counts them
    pairs.close()  # the request waits for a transfer that cannot come: stop the pair now


# %% two hosts, the default config: no secret, so prefill's exchange stays on its loopback


def test_two_hosts_without_the_secret_match_the_oracle_but_leave_mismatches_unlocalised(pairs):
    rig = pairs.get("two-hosts-default", launch.ServerOptions(), two_hosts=True)
    phase = faults_phase(rig, "default", seed=23)
    assert not phase.failed_requests and not phase.wrong_outputs and not phase.unrecorded_faults, describe(phase)
    v = phase.verification
    assert v.verdicts.get("mismatch", 0) == len(FAULT_NAMES) and not v.unfinished, describe(phase)
    # every verdict is the oracle's, and `diff` over both sides' room logs localises each
    # mismatch to the oracle's cells (prefill's log holds its vectors) ...
    assert not v.oracle_disagreements and not v.unexplained, describe(phase)
    # ... but live, decode could not: without the secret prefill's exchange refuses the
    # routable address SGLang reports and runs without a server, so decode on the other
    # host has no vectors to fetch (the default config's cost across hosts, docs/rig.md)
    assert "exchange refuses to listen on routable address" in rig.cluster.logs["prefill"].read_text()
    live = [r for r in decode_records(rig) if r.get("verdict") == "mismatch" and r.get("rid") in set(phase.rooms)]
    assert live and all(not r.get("localisation") and "vectors unavailable" in r.get("reason", "") for r in live), live[:2]


# %% prefill TP 2 -> decode TP 1 over Mooncake (its TCP transport), the in-band digest forced late


def mooncake_missing() -> str | None:
    """Why Mooncake's transfer engine cannot load here (its engine links libibverbs), or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake's transfer engine is not installed (pip install '.[mooncake]')"
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return f"Mooncake's transfer engine does not load: {exc} (apt-get install libibverbs1)"
    return None


@pytest.mark.skipif(mooncake_missing() is not None, reason=str(mooncake_missing()))
def test_tp2_to_tp1_over_mooncake_with_the_digest_late_judges_and_enforces_from_the_exchange(pairs):
    """Three things in one pair (SGLang starts fewer): heterogeneous TP (prefill TP 2 -> decode
    TP 1: the decode rank takes its KV from one prefill rank) over Mooncake's TCP transport,
    with the in-band digest forced late, in enforce mode: every room's prefill digest comes from
    the exchange, fetched off the scheduler thread while the room is held (exchange/prefetch.py);
    the two rooms corrupt as they land are refused with SGLang's checksum answer, the faults
    that come later are reported as in observe mode, every other room is served."""
    rig = pairs.get("tp2-tp1-mooncake-late", launch.ServerOptions(prefill_tp=2, decode_tp=1, transfer_backend="mooncake"),
                    probe_config="step_interval: 4\nmode: enforce\n", env={ENV_DEFER_INBAND: "1"})
    phase = faults_phase(rig, "mooncake", seed=24, rejected=CORRUPT_AT_RECEIPT)
    assert_every_fault_found(phase)  # the refusals too (a room served is a failed request)
    assert [o.status for o in phase.outcomes].count(200) == len(phase.requests) - len(CORRUPT_AT_RECEIPT)
    # the decode rank registered with one prefill rank for real and with the other as dummy: that
    # one sends nothing, so it digests nothing and writes no room record (accessors.sends_nothing)
    assert rank_logs(rig, "prefill") == 1 and rank_logs(rig, "decode") == 1
    judged = [r for r in decode_records(rig) if r.get("rid") in set(phase.rooms) and r.get("verdict") in ("match", "mismatch")]
    # no room carried its digest in band: each verdict came by the late path (the exchange)
    assert judged and all(r.get("expected_room") is None for r in judged), judged[:2]


# %% attention DP: SGLang's CPU path cannot run it


DP_REFUSAL = "Found no NVIDIA driver on your system"


def test_dp_attention_is_refused_on_the_cpu_at_the_first_forward(pairs, tmp_path):
    """A prefill server with attention DP (TP 2 as two attention-DP ranks) dies at its warm-up
    forward: `ForwardBatch.prepare_mlp_sync_batch` gathers the ranks' token counts through a
    pinned host tensor, and pinning needs a CUDA driver (docs/rig.md). Should a release run
    it on the CPU, this test fails and the rig can cover attention DP."""
    pairs.close()  # one SGLang server set at a time
    options = launch.ServerOptions(prefill_tp=2, prefill_dp=2)
    model = launch.write_model_dir(tmp_path / "model")
    args = launch.server_args("prefill", model, launch.Ports.free(), options)
    env = launch.server_env(dict(os.environ), launch.rig_plugin_site(tmp_path / "site"), tmp_path, "prefill", options)
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path,
                         start_new_session=True)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and DP_REFUSAL in text and "prepare_mlp_sync_batch" in text, text[-3000:]
