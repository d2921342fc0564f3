"""Fixtures for the SGLang adapter tests: the real sglang==0.5.23 on CPU.

`worlds` builds a prefill and a decode side from real SGLang pool, allocator,
request-to-token and metadata objects (tests/sglang/pdworld.py) while a
default ServerArgs is published, as SGLang's pools need at construction.
`probe` is a Runtime with a fresh Prometheus registry, records collected in a
list, and the exchange bound to loopback.
"""

from __future__ import annotations

import pdworld
import pytest
from pd_testkit import make_runtime


@pytest.fixture(scope="module")
def published():
    """A default ServerArgs published for one test module (restored after it)."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args()
    override.install()
    yield
    override.restore()


@pytest.fixture
def worlds(published):
    prefill = pdworld.make_side(seed=1, pages=pdworld.PREFILL_PAGES)
    decode = pdworld.make_side(seed=2, pages=pdworld.DECODE_PAGES)
    return prefill, decode


@pytest.fixture
def probe():
    runtime, sink, registry = make_runtime()
    yield runtime, sink, registry
    runtime.close()
