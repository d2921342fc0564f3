"""Restore verification never reads an index tensor back on the thread that copies: the
page ids it hands the digest engine stay tensors, and host-row numbers are read by the
engine's collector only (docs/hicache.md, "Serving thread"). A stand-in engine defers
every callback to another thread, and index tensors refuse to be read on the copying one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch

from dsv4_idxk_probe.hicache.geometry import PoolGeometry
from dsv4_idxk_probe.hicache.restore import RestoreVerifier

SERVING = threading.get_ident()
READS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__iter__")  # values, not shapes


class Watched(torch.Tensor):
    """A tensor whose values may not be read on the serving thread (nor those of tensors made from it)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and threading.get_ident() == SERVING:
            raise AssertionError(f"{name} read an index tensor on the serving thread")
        return super().__torch_function__(func, types, args, kwargs or {})


class DeferringEngine:
    """Takes submits, runs their callbacks later on a thread of its own (as the collector does)."""

    def __init__(self, layers: int, segments: int, page_id_stride: int = 1):
        self.layers, self.segments, self.pending, self.pages_seen = layers, segments, [], []
        self.page_id_stride = page_id_stride  # as the real engine: token indices, this many per page

    def submit_room(self, key, pages, n_tokens, callback, contents_only=False):
        assert isinstance(pages, torch.Tensor), "page ids must stay a tensor on the serving thread"
        self.pages_seen.append(pages)
        self.pending.append((pages, callback))
        return object()

    def post(self, call, arg=None):
        self.pending.append((None, lambda _r: call(arg)))

    def run_on_collector(self):
        def work():
            for pages, callback in self.pending:
                if pages is None:
                    callback(None)
                    continue
                n = -(-len(pages.tolist()) // self.page_id_stride)  # a short last group is a page, as there
                contents = np.arange(self.layers * n * self.segments, dtype=np.uint64).reshape(self.layers, n, -1)
                callback(SimpleNamespace(error=None, contents=(contents,), out_of_range=(0,)))
            self.pending = []

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()

    def close(self):
        pass


def test_backup_and_load_read_no_index_value_on_the_serving_thread():
    verifier, state, engines, reports, counted = _verifier_and_state()
    host = torch.arange(2 * 256, 4 * 256).as_subclass(Watched)
    device = torch.arange(0, 2 * 256).as_subclass(Watched)
    verifier.after_backup(state, host, device)
    verifier.after_load(state, host, device, {})  # the load's layers all in
    (engine,) = engines
    assert len(engine.pages_seen) == 2 and reports == []  # nothing compared yet: the collector has not run
    engine.run_on_collector()
    (comparison,) = reports
    assert comparison.verdict == "match" and comparison.rows == 2
    assert ("hicache_load", "verified", "none", 2 * 2 * 8448) in counted


SHAPE_ONLY = {"numel", "dim", "size", "__get__", "__len__", "is_inference"}  # a tensor's shape and kind, not its values
COPIES = {"to", "copy_", "cpu", "clone", "contiguous", "pin_memory", "tolist", "numpy", "item"}


class Recorded(torch.Tensor):
    """A tensor that records what the serving thread does with it (and with tensors made from it)."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if threading.get_ident() == SERVING:
            Recorded.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


class RecordedHost(Recorded):
    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if threading.get_ident() == SERVING:
            RecordedHost.seen.append(getattr(func, "__name__", str(func)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _verifier_and_state(layers: int = 2):
    geom = PoolGeometry(name="deepseek_v4_c4_indexer", layers=layers, item_bytes=8448, page_size=256, host_pages=8,
                        layout="layer_first", page_aligned_only=True, buffers=(), page_routes=frozenset(),
                        token_row=None)
    views = SimpleNamespace(device_layer=lambda layer: torch.zeros((4, 8448), dtype=torch.uint8))
    state = SimpleNamespace(key=1, geom=geom, views=views, invariants_failed={})
    engines, reports, counted = [], [], []

    def factory(layout, layer_ids, buffers, queue_max, **options):
        engines.append(DeferringEngine(len(layer_ids), len(layout.segments), options["page_id_stride"]))
        return engines[-1]

    verifier = RestoreVerifier(16, 8, lambda s, c, ctx: reports.append(c), lambda *a: counted.append(a),
                               lambda n: None, engine_factory=factory)
    return verifier, state, engines, reports, counted


def test_the_copying_thread_derives_device_page_ids_only_and_leaves_host_rows_to_the_collector():
    verifier, state, engines, reports, counted = _verifier_and_state()
    RecordedHost.seen.clear()
    Recorded.seen.clear()
    host = torch.arange(2 * 256, 4 * 256).as_subclass(RecordedHost)
    device = torch.arange(0, 2 * 256).as_subclass(Recorded)
    verifier.after_backup(state, host, device)
    verifier.after_load(state, host, device, {})  # the load's layers all in
    on_host, on_device = set(RecordedHost.seen), set(Recorded.seen)
    assert on_host <= SHAPE_ONLY, f"the copying thread worked on the host indices: {sorted(on_host - SHAPE_ONLY)}"
    assert not on_device & COPIES, f"the copying thread copied device indices: {sorted(on_device & COPIES)}"
    engines[0].run_on_collector()
    (comparison,) = reports
    assert comparison.verdict == "match" and comparison.rows == 2  # the collector read the rows


def test_an_index_tensor_rewritten_before_the_collector_reads_it_is_counted_and_never_compared():
    verifier, state, engines, reports, counted = _verifier_and_state()
    host, device = torch.arange(2 * 256, 4 * 256), torch.arange(0, 2 * 256)
    verifier.after_backup(state, host, device)
    host.add_(2 * 256)  # now names host rows 4 and 5, which no backup read
    engines[0].run_on_collector()
    assert ("hicache_backup", "unverified", "probe_error", 2 * 2 * 8448) in counted
    assert verifier.store.get(state.key, [2, 3, 4, 5]) == [None] * 4
    later = torch.arange(4 * 256, 6 * 256)
    verifier.after_load(state, later, device, {})
    engines[0].run_on_collector()
    (comparison,) = reports
    assert comparison.verdict == "unverified" and comparison.unverified_rows == [4, 5]
