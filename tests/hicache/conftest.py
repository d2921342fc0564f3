"""Fixtures for the HiCache host-pool tests: the real SGLang pool classes on CPU
(0.5.23, and each older release in the release matrix, tests/sglang_releases/).

* `hicache` installs the probe's wrappers exactly as the target table
  (configs/targets/sglang.yaml, HiCache section) names them, with
  wrapt, against a tiny runtime (fresh Prometheus registry, records list),
  and removes them again at teardown.
* `standins` injects the CPU copy ops of cpu_standins.py into
  ``sglang.srt.mem_cache.memory_pool_host`` (see that module's docstring);
  every op call is also appended to ``mem.calls``.
* `make_pool` builds a real ``DeepSeekV4PagedHostPool`` the way SGLang's
  DeepSeek-V4 HiCache stack of the release under test does (device pools on
  CPU, item bytes and flags from SGLang's own region helpers where the release
  has them, else as its stack builder computes them inline), with pin_memory
  off and a host-memory budget scope where the release has one (neither
  changes the copy paths).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import wrapt
import yaml
from prometheus_client import CollectorRegistry

import sglang.srt.mem_cache.memory_pool_host as mph
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool, DeepSeekV4SingleKVPool
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa
try:  # SGLang 0.5.21+
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
except ImportError:  # 0.5.18-0.5.20: no budget scope

    def host_memory_budget_scope(budget_bytes: int):
        return contextlib.nullcontext()


from dsv4_idxk_probe import safety
from dsv4_idxk_probe.hicache import forget
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics, process_labels

from .cpu_standins import Memory, make_standins

def _hicache_errors() -> dict[str, int]:
    return {k: v for k, v in safety.error_counts().items() if k.startswith("hicache.")}


HOOK_MODULE = "dsv4_idxk_probe.sglang.hicache"
BASE = process_labels(role="test")  # the process labels of ProbeMetrics(role="test")

#: (layout, io_backend) pairs the pool implements a page copy for, and the two it refuses.
SUPPORTED = [("layer_first", "kernel"), ("layer_first", "direct"), ("page_first", "kernel"), ("page_first_direct", "direct")]
UNSUPPORTED = [("page_first", "direct"), ("page_first_direct", "kernel")]

PAGE = 256  # tokens per HiCache page (SGLang's page_size for DSV4)
HOST_PAGES = 8
DEVICE_TOKENS = 1024
LAYERS = 2

#: What the release under test has (the matrix runs 0.5.18-0.5.22 too).
HAS_BACKUP_TOKENS = hasattr(mph.DeepSeekV4PagedHostPool, "backup_tokens_from_device_all_layer")  # 0.5.23+
HAS_FP4_INDEXER = "use_fp4_indexer" in inspect.signature(DeepSeekV4IndexerPool.__init__).parameters  # 0.5.21+


def accepted(cls, **kwargs) -> dict:
    """`kwargs` less those the release's `cls.__init__` does not take (a newer field)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def hicache_targets() -> list[dict]:
    """The HiCache entries of the target table, for the installed SGLang release."""
    from dsv4_idxk_probe.sglang.targets import load_target_file

    entries = [dict(vars(t), params=list(t.params)) for t in load_target_file("sglang")]
    return [t for t in entries if str(t.get("hook", "")).startswith(HOOK_MODULE + ":")]


class Env:
    """An installed probe: runtime, registry, records, and how to read metrics."""

    def __init__(self, settings: dict, journal=None):
        self.registry = CollectorRegistry()
        self.records: list[dict] = []
        self.runtime = SimpleNamespace(
            metrics=ProbeMetrics(self.registry, role="test"),
            config=SimpleNamespace(hicache=dict(settings)),
            emit=self.records.append,
            log=logging.getLogger("dsv4_idxk_probe.test.hicache"),
            journal=journal,  # diagnosis.PageJournal, or None (diagnosis off)
        )
        self.handles: list[tuple] = []
        self.allow_probe_errors = False  # set by tests that break the probe on purpose
        self.errors_at_start = _hicache_errors()

    def install(self) -> None:
        for target in hicache_targets():
            module = importlib.import_module(target["module"])
            factory_module, factory_name = target["hook"].split(":")
            factory = getattr(importlib.import_module(factory_module), factory_name)
            handle = wrapt.wrap_function_wrapper(module, target["qualname"], factory(self.runtime))
            self.handles.append((module, target["qualname"], handle))

    def uninstall(self) -> None:
        while self.handles:
            module, qualname, handle = self.handles.pop()
            wrapt.unwrap_object(module, qualname, handle)
        forget(self.runtime)

    @property
    def probe(self):
        from dsv4_idxk_probe.hicache import probe_for

        return probe_for(self.runtime)

    def value(self, metric: str, **labels) -> float | None:
        self.probe.publish()  # the flusher's job, done now
        suffix = "" if metric.endswith("_info") else "_total"
        return self.registry.get_sample_value(f"dsv4_idxk_probe_{metric}{suffix}", {**BASE, **labels})

    def samples(self, metric: str, **match) -> dict[tuple, float]:
        """All samples of a counter whose labels include `match`, keyed by the other labels."""
        self.probe.publish()
        out = {}
        name = f"dsv4_idxk_probe_{metric}_total"
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name != name or any(sample.labels.get(k) != v for k, v in match.items()):
                    continue
                rest = {k: v for k, v in sample.labels.items() if k not in BASE and k not in match}
                out[tuple(sorted(rest.items()))] = sample.value
        return out


@pytest.fixture
def hicache():
    """Install the probe with the given ``hicache`` settings; removed at teardown."""
    envs: list[Env] = []

    def install(journal=None, **settings) -> Env:
        settings.setdefault("flush_interval_s", 3600.0)  # tests flush explicitly
        env = Env(settings, journal)
        env.install()
        envs.append(env)
        return env

    yield install
    for env in envs:
        env.uninstall()
    for env in envs:
        if not env.allow_probe_errors:
            grown = {k: v for k, v in _hicache_errors().items() if v > env.errors_at_start.get(k, 0)}
            assert not grown, f"the probe failed internally (caught by safe_invoke): {grown}"


@pytest.fixture(scope="module", autouse=True)
def published():
    """A default ServerArgs published for one test module (restored after it): the
    device pools of 0.5.18-0.5.20 read it at construction, as tests/sglang's do."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args()
    override.install()
    yield
    override.restore()


@pytest.fixture
def standins(monkeypatch):
    """Inject the CPU copy ops into the pool's module; returns the `Memory`."""
    mem = Memory()
    mem.calls = []
    for name, fn in make_standins(mem).items():

        def logged(*args, _fn=fn, _name=name, **kwargs):
            mem.calls.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(mph, name, logged, raising=False)
    return mem


def indexer_region(indexer) -> tuple:
    """(name, device buffers, item bytes, slot page size, page_aligned_only) of the C4
    indexer's host pool, from SGLang's region helper (0.5.20+) or, on 0.5.18-0.5.19,
    as their stack builder computes it inline (the fused buffer, shape[1] * element size)."""
    if not hasattr(hpa, "_dsv4_indexer_regions"):
        fused = indexer.index_k_with_scale_buffer
        return "deepseek_v4_c4_indexer", fused, fused[0].shape[1] * fused[0].element_size(), PAGE, False
    (region,) = hpa._dsv4_indexer_regions(SimpleNamespace(c4_indexer_kv_pool=indexer), PAGE)
    return str(region.name), region.device_buffers, region.item_bytes, region.slot_page_size, region.page_aligned_only


def _device_pools(kind: str):
    """(region-like record, device pool) for one pool kind, built as SGLang builds them."""
    if kind in ("fp8_indexer", "fp4_indexer"):
        if kind == "fp4_indexer" and not HAS_FP4_INDEXER:
            pytest.skip("the fp4 indexer arrives in SGLang 0.5.21")
        device = DeepSeekV4IndexerPool(**accepted(
            DeepSeekV4IndexerPool, size=DEVICE_TOKENS, page_size=PAGE // 4, dtype=torch.uint8, index_head_dim=128,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False, use_fp4_indexer=kind == "fp4_indexer",
            global_page_size=PAGE,
        ))  # fmt: skip
        return indexer_region(device)
    kv = DeepSeekV4SingleKVPool(**accepted(
        DeepSeekV4SingleKVPool, size=DEVICE_TOKENS, page_size=PAGE // 4, dtype=torch.float8_e4m3fn,
        qk_nope_head_dim=448, qk_rope_head_dim=64, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        global_page_size=PAGE,
    ))  # fmt: skip
    if kind == "c4_kv":
        buffers, item_bytes = hpa._dsv4_compressed_region_buffers(SimpleNamespace(c4_kv_pool=kv, _unified_kv=False), 4)
        aligned_only = hpa._dsv4_page_aligned_only(kv) if hasattr(hpa, "_dsv4_page_aligned_only") else False
        return "deepseek_v4_c4", buffers, item_bytes, PAGE, aligned_only
    if kind == "hisparse_c4":  # as hisparse_coordinator builds it: compressed ids, C4 pages
        return "dsv4_hisparse_c4", kv.kv_buffer, kv.bytes_per_page_padded, kv.page_size, False
    raise ValueError(kind)


@pytest.fixture
def make_pool(standins):
    """make_pool(kind, layout) -> a real DeepSeekV4PagedHostPool with random device bytes."""
    gen = torch.Generator().manual_seed(1234)

    def build(kind: str, layout: str = "layer_first", **overrides):
        name, buffers, item_bytes, page_size, aligned_only = _device_pools(kind)
        for buf in buffers:
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
        args = dict(
            pool_name=name, device_buffers=buffers, item_bytes=item_bytes, num_host_pages=HOST_PAGES,
            slot_page_size=page_size, layout=layout, device="cpu", pin_memory=False, page_aligned_only=aligned_only,
        )  # fmt: skip
        args.update(overrides)
        with host_memory_budget_scope(1 << 40):  # page_aligned_only: 0.5.20+
            pool = mph.DeepSeekV4PagedHostPool(**accepted(mph.DeepSeekV4PagedHostPool, **args))
        standins.add_pool(pool)
        return pool

    return build


def host_row(pool, row: int, layer: int) -> torch.Tensor:
    """Host bytes of (row, layer), read the way each layout stores them."""
    if pool.layout == "layer_first":
        return pool.kv_buffer[layer][row]
    if pool.layout == "page_first":
        return pool.kv_buffer[row, layer]
    return pool.kv_buffer[row, layer, 0]


def device_row(pool, row: int, layer: int) -> torch.Tensor:
    return pool.device_buffers[layer].view(torch.uint8)[row]


def page_indices(rows, page: int = PAGE) -> torch.Tensor:
    """Token indices of whole pages `rows`, as the HiCache stack passes them."""
    return torch.cat([torch.arange(r * page, (r + 1) * page, dtype=torch.int64) for r in rows])
