"""dsv4_idxk_probe_gpu_info: which GPU (DCGM's UUID) and host each probe process runs on,
set once when the metrics are built, from torch's device properties (a host-side read)."""

from __future__ import annotations

import sys
import types
import uuid

from prometheus_client import CollectorRegistry

from dsv4_idxk_probe import runtime
from dsv4_idxk_probe.metrics.gpu_identity import gpu_identity

LABELS = {"model_name": "m", "engine_type": "decode", "tp_rank": "3", "pp_rank": "0", "moe_ep_rank": "0"}


def fake_torch(*, available=True, initialised=True, device=5, uid=None):
    """A torch module whose CUDA answers like a GPU process's; counts every call it gets."""
    calls = []
    uid = uid or uuid.UUID("5fd4e1f5-1111-2222-3333-444455556666")

    def record(name, value):
        def fn(*args):
            calls.append(name)
            return value
        return fn

    cuda = types.SimpleNamespace(
        is_available=record("is_available", available), is_initialized=record("is_initialized", initialised),
        current_device=record("current_device", device),
        get_device_properties=record("get_device_properties", types.SimpleNamespace(uuid=uid)),
        synchronize=record("synchronize", None),
    )
    return types.SimpleNamespace(cuda=cuda), calls


def gpu_series(registry: CollectorRegistry) -> list[dict]:
    return [dict(s.labels, value=s.value) for family in registry.collect() if family.name == "dsv4_idxk_probe_gpu_info"
            for s in family.samples]


def test_identity_names_the_current_device_as_dcgm_does(monkeypatch):
    torch, calls = fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    got = gpu_identity()
    assert got["gpu_uuid"] == "GPU-5fd4e1f5-1111-2222-3333-444455556666"  # DCGM's UUID label spelling
    assert got["cuda_device"] == "5" and got["hostname"]
    assert "synchronize" not in calls


def test_no_gpu_identity_on_cpu_or_before_cuda_is_initialised(monkeypatch):
    for kwargs in ({"available": False}, {"initialised": False}):
        torch, calls = fake_torch(**kwargs)
        monkeypatch.setitem(sys.modules, "torch", torch)
        assert gpu_identity() is None
        assert "current_device" not in calls  # the probe never initialises CUDA itself


def test_runtime_publishes_the_gpu_info_once_with_the_process_labels(monkeypatch):
    torch, _ = fake_torch(device=2)
    monkeypatch.setitem(sys.modules, "torch", torch)
    registry = CollectorRegistry()
    metrics = runtime.shared_metrics(registry, LABELS)
    (series,) = gpu_series(registry)
    assert series["gpu_uuid"] == "GPU-5fd4e1f5-1111-2222-3333-444455556666" and series["cuda_device"] == "2"
    assert series["tp_rank"] == "3" and series["engine_type"] == "decode" and series["value"] == 1
    assert runtime.shared_metrics(registry, LABELS) is metrics and len(gpu_series(registry)) == 1


def test_cpu_process_publishes_no_gpu_series(monkeypatch):
    torch, _ = fake_torch(available=False)
    monkeypatch.setitem(sys.modules, "torch", torch)
    registry = CollectorRegistry()
    runtime.shared_metrics(registry, LABELS)
    assert gpu_series(registry) == []


def test_a_failing_device_query_is_counted_never_raised(monkeypatch):
    torch, _ = fake_torch()

    def broken(index):
        raise RuntimeError("driver went away")

    torch.cuda.get_device_properties = broken
    monkeypatch.setitem(sys.modules, "torch", torch)
    registry = CollectorRegistry()
    runtime.shared_metrics(registry, LABELS)  # no exception
    assert gpu_series(registry) == []
    from dsv4_idxk_probe.safety import error_counts

    assert error_counts().get("metrics.gpu_info", 0) >= 1
