"""What restore verification adds to the copying thread, counted (deterministic, no GPU).

The copying thread's Python competes with the scheduler thread for the GIL, and each
device call costs it a launch (docs/hicache.md, "Serving thread"). So what restore
verification adds to a wrapped copy is counted here: the same calls through the
adapter's wrappers with `hicache.restore_verify` on and off (everything else the
same), the digest engine on its CUDA submit path with its device calls faked
(`bench.hicache_overhead.faked_cuda_engine`), index tensors as the pool's device
would pass them. A backup and a load's last layer add at most the digest's submit
(one frame of ours plus the engine's three) and no device call but the digest's launch
(the engine reads the token indices as they are, `page_id_stride`, and its collector
records the batch's event, `record` "collector"); a load's other layers add nothing; no
copy is made on this thread.
"""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
import torch
import wrapt
from prometheus_client import CollectorRegistry

from bench.hicache_overhead import METHODS, StandalonePool, copy_cases, faked_cuda_engine
from dsv4_idxk_probe.hicache import forget, probe_for
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics

LAYERS, PAGE, PAGES = 4, 256, 4
#: C calls that make a tensor, copy bytes or move them between devices
COPYING = {"copy_", "to", "tensor", "as_tensor", "cat", "stack", "index_select", "clone", "contiguous", "cpu",
           "pin_memory", "tolist", "item", "empty", "zeros", "full", "arange"}


class Pool(StandalonePool):
    """Its own class, so wrapping it leaves the bench's alone."""


def _calls(fn) -> tuple[int, list[str]]:
    """Python frames entered and the names of the C functions called, on this thread, by `fn()`."""
    py, c = [0], []

    def profile(frame, event, arg):
        if event == "call":
            py[0] += 1
        elif event == "c_call":
            c.append(getattr(arg, "__name__", str(arg)))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return py[0] - 1, [name for name in c if name != "setprofile"]  # less `fn` itself


def _counted(restore_verify: bool) -> dict[str, tuple[int, list[str]]]:
    runtime = SimpleNamespace(
        metrics=ProbeMetrics(CollectorRegistry()),
        config=SimpleNamespace(hicache={"index_checks": True, "flush_interval_s": 3600.0,
                                        "restore_verify": restore_verify}),
        emit=lambda record: None, log=logging.getLogger("tests.hicache.calls"))
    probe = probe_for(runtime)
    if probe.restore is not None:
        probe.restore._engine_factory = faked_cuda_engine
    pool = Pool(torch.device("cpu"), layers=LAYERS, name="deepseek_v4_c4_indexer", seed=3)
    host = torch.arange(0, PAGES * PAGE)
    device = torch.arange(8 * PAGE, (8 + PAGES) * PAGE)
    cases = copy_cases(pool, host, device, LAYERS)  # each load case a whole load; the last layer completes it
    handles = [(name, wrapt.wrap_function_wrapper(Pool, name, factory(runtime))) for name, factory in METHODS.items()]
    try:
        for before, fn, after in cases.values():  # registers the pool, builds its engine: not counted
            before(), fn(), after()
        out = {}
        for case, (before, fn, after) in cases.items():
            before()
            if probe.restore is not None:
                assert probe.restore.drain()  # events and staging back in their pools, as between real copies
            out[case] = _calls(fn)
            after()
        if probe.restore is not None:
            assert probe.restore.drain()
        return out
    finally:
        for name, handle in handles:
            wrapt.unwrap_object(Pool, name, handle) if hasattr(wrapt, "unwrap_object") else setattr(
                Pool, name, Pool.__dict__[name].__wrapped__)
        forget(runtime)


@pytest.fixture(scope="module")
def counted():
    return _counted(False), _counted(True)


@pytest.mark.parametrize("case, most", [("backup", 4), ("load, the last layer", 4)])
def test_a_verified_copy_adds_only_the_digest_submit_to_the_copying_thread(counted, case, most):
    off, on = counted
    added = on[case][0] - off[case][0]
    assert 1 <= added <= most, (
        f"{case}: restore verification adds {added} Python frames on the copying thread (1 to {most}: its digest)")


def test_a_loads_other_layers_add_nothing(counted):
    off, on = counted
    case = "load, a middle layer"
    assert on[case][0] == off[case][0], f"restore verification adds {on[case][0] - off[case][0]} frames to {case}"
    assert on[case][1] == off[case][1], f"restore verification adds C calls to {case}"


@pytest.mark.parametrize("case", ["backup", "load, the last layer"])
def test_a_verified_copy_makes_no_division_and_no_copy_on_the_copying_thread(counted, case):
    off, on = counted
    added = list(on[case][1])
    for name in off[case][1]:
        if name in added:
            added.remove(name)
    assert "floor_divide" not in added, (
        f"{case}: the kernel reads the token indices; the copying thread derives no page ids: {added}")
    copies = [name for name in added if name in COPYING]
    assert not copies, f"{case}: restore verification copies on the copying thread: {copies}"
    # the faked event record is `operator.is_` (bench.hook_ops.fake_device_calls): the launch is
    # the copying thread's one device call; the collector records the batch's event
    assert "is_" not in added, f"{case}: the copying thread records the digest's event itself: {added}"
