"""The probe's process labels are the installed SGLang's: same names, same values.

A child process publishes an SGLang config (the real `sglang.srt.runtime_context`),
builds SGLang's own `SchedulerMetricsCollector` (the labels every `sglang:*`
scheduler metric carries), and compares them with what the probe reads
(`sglang.accessors.identity()`) and the label set its metrics get. It runs in
a child because SGLang's collector registers its metrics in the process's
default registry, and a published config is process state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from prometheus_client import REGISTRY, CollectorRegistry
from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
from sglang.srt.runtime_context import get_context, get_parallel
from dsv4_idxk_probe.metrics.definitions import PROCESS_LABELS, ProbeMetrics
from dsv4_idxk_probe.sglang.accessors import identity

out = []
for case in json.loads(sys.argv[1]):
    override = get_context().override_server_args(enable_metrics=True, tp_size=4, **case["server_args"])
    server_args = override.install()
    try:
        with get_parallel().override(attn_tp_rank=0, attn_cp_rank=0, **case["ranks"]):
            collector = SchedulerMetricsCollector.init_new(
                server_args=server_args, enable_priority_scheduling=False, enable_lora=False,
                enable_hierarchical_cache=False).collector
            sglang = {k: str(v) for k, v in collector.labels.items()}
            probe = identity()
            registry = CollectorRegistry()
            metrics = ProbeMetrics(registry, labels=probe)
            metric_labels = [n for n in registry._names_to_collectors["dsv4_idxk_probe_rooms_verified_total"]._labelnames]
        out.append({"sglang": sglang, "probe": probe, "metric_labels": metric_labels, "PROCESS_LABELS": list(PROCESS_LABELS)})
    finally:
        for c in list(REGISTRY._collector_to_names):
            REGISTRY.unregister(c)
        override.restore()
print("RESULT" + json.dumps(out))
"""

CASES = [
    {"server_args": {"disaggregation_mode": "prefill", "served_model_name": "dsv4-flash"},
     "ranks": {"tp_rank": 3, "pp_rank": 0, "moe_ep_rank": 0, "dp_rank": None}},
    {"server_args": {"disaggregation_mode": "decode", "served_model_name": "dsv4-flash"},
     "ranks": {"tp_rank": 1, "pp_rank": 0, "moe_ep_rank": 0, "dp_rank": 2}},
    {"server_args": {"disaggregation_mode": "null", "served_model_name": "other",
                     "extra_metric_labels": {"cluster": "eu1"}},
     "ranks": {"tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0, "dp_rank": None}},
]


def run_cases(cases):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_probe_labels_are_sglangs_own_names_and_values():
    results = run_cases(CASES)
    assert len(results) == len(CASES)
    engine_types = []
    for result in results:
        sglang, probe = result["sglang"], result["probe"]
        assert probe == sglang, (probe, sglang)
        assert result["metric_labels"][: len(sglang)] == list(sglang), "probe metrics carry SGLang's labels first"
        # The fixed part is what SGLang always sets, in its order.
        assert [k for k in sglang if k in result["PROCESS_LABELS"]] == result["PROCESS_LABELS"]
        engine_types.append(sglang["engine_type"])
    assert engine_types == ["prefill", "decode", "unified"]
    assert "dp_rank" not in results[0]["sglang"] and results[1]["sglang"]["dp_rank"] == "2"
    assert results[2]["sglang"]["cluster"] == "eu1"
