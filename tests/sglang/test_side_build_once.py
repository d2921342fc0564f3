"""A side that fails to build is tried once (Reliability round two).

It was retried on every hook call, each attempt leaking a digest engine and the
collector thread its CUDA warm-up had started (50 calls: 1 -> 51 threads). The
build here fails the way a real one can: the engine comes up (and starts its
thread), then the next part of the side raises. Over real SGLang pools on CPU
(tests/sglang/pdworld.py), through the hooks' own wrappers.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pdworld
import pytest
from pd_testkit import make_runtime

from dsv4_idxk_probe import safety
from dsv4_idxk_probe.pd import assembly, records
from dsv4_idxk_probe.sglang import pd_decode, pd_prefill
from dsv4_idxk_probe.sglang.sides import build_side

CALLS = 50


class WarmingEngine:
    """Stands in for the digest engine: built, it starts a thread (as the CUDA warm-up
    starts the collector), which runs until the engine is closed."""

    built = 0

    def __init__(self):
        WarmingEngine.built += 1
        self.signature = 1
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._stop.wait, name="warm-up", daemon=True)
        self.thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)


def broken(*args, **kwargs):
    raise RuntimeError("the monitor cannot start")


def _threads_back_to(count: int) -> int:
    for _ in range(100):
        if threading.active_count() <= count:
            break
        time.sleep(0.01)
    return threading.active_count()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_side_that_fails_to_build_is_tried_once_and_leaks_nothing(worlds, monkeypatch, role):
    prefill, decode = worlds
    monkeypatch.setattr(assembly.DigestEngine, "from_config", classmethod(lambda cls, *a, **k: WarmingEngine()))
    monkeypatch.setattr(assembly, "PrefillMonitor" if role == "prefill" else "DecodeMonitor", broken)
    WarmingEngine.built = 0
    runtime, _, _ = make_runtime()
    served = []

    def original(*args, **kwargs):  # SGLang's own method, which must run every time
        served.append(1)

    errors_before = safety.error_counts().get(f"{role}.build", 0)
    threads_before = threading.active_count()
    try:
        if role == "prefill":
            hook = pd_prefill.make_send_kv_chunk_wrapper(runtime)
            req = pdworld.prefill_req(4242, 2)
            for _ in range(CALLS):
                hook(original, prefill.scheduler, (req,), {"last_chunk": True})
        else:
            hook = pd_decode.make_send_kv_metadata_wrapper(runtime)
            queue = SimpleNamespace(scheduler=decode.scheduler)
            decode_req = SimpleNamespace(req=SimpleNamespace(bootstrap_room=4242))
            for _ in range(CALLS):
                hook(original, queue, (decode_req, [0], 256), {})
        assert WarmingEngine.built == 1, f"{WarmingEngine.built} build attempts"
        assert _threads_back_to(threads_before) == threads_before, "the failed build's thread is still running"
        assert len(served) == CALLS
        side = runtime.sides[role]
        assert side.active is False and side.failed and "the monitor cannot start" in side.reason
        assert safety.error_counts().get(f"{role}.build", 0) == errors_before + 1  # counted once
        assert build_side(runtime, role, None) is side  # later calls: the same failed side, no build
    finally:
        runtime.close()


def test_the_cluster_label_of_the_config_reaches_the_records(worlds):
    """`roomlog.cluster` is what every record of this process carries (docs/roomlog.md)."""
    prefill, _ = worlds
    runtime, _, _ = make_runtime(roomlog={"cluster": "eu-1"})
    try:
        pd_prefill.prefill_side(runtime, prefill.scheduler)
        assert records.cluster_label() == "eu-1"
    finally:
        runtime.close()
        records.set_cluster("")
