"""The parts of a submit that make it cheap: staging buffers read in place, the direct launch."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.digest import get_layout
from dsv4_idxk_probe.digest import kernel as kernel_module
from dsv4_idxk_probe.digest.pinned import StagingPool


def test_staging_pool_reuses_buffers_by_size_class():
    pool = StagingPool(torch.device("cpu"))
    first = pool.take(100)
    assert first.nbytes == StagingPool.size_class(100) and first.words.dtype == np.int64
    assert first.host_address == first.host.data_ptr()  # the kernel reads and stores here
    pool.give(first)
    assert pool.take(200) is first  # same class: no new allocation
    bigger = pool.take(first.nbytes + 1)
    assert bigger is not first and bigger.nbytes == 2 * first.nbytes
    assert pool.allocations == 2


class _FakeJit:
    """A fake of Triton's JIT entry point (no GPU here): records launches and returns a
    compiled kernel whose signature is `signature`."""

    def __init__(self, signature):
        self.jit_launches, self.direct_launches = [], []
        outer = self

        self.run_launches = []

        class Compiled:
            src = SimpleNamespace(signature=signature)
            function, packed_metadata = "cu-function", ("packed",)

            def __getitem__(self, grid):
                return lambda *args: outer.direct_launches.append((grid, args))

            def run(self, *args):  # Triton's C launcher for a compiled kernel
                outer.run_launches.append(args)

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return self.compiled

        return launch


class _Table:
    """Stands in for the layer table tensor: only its address is launched."""

    def data_ptr(self):
        return 111


def _kernel(monkeypatch, signature):
    fake = _FakeJit(signature)
    monkeypatch.setattr(kernel_module, "_digest_rooms_kernel", fake)
    return fake, kernel_module.DigestKernel(_Table(), 3, get_layout("fp8"), rows=2)


# The fp8 layout's compile-time constants, in the kernel's order: row words, slots, tokens
# per slot, segments; per segment (4) word offset, words per slot, tile; base alignment,
# rows per program, page-table entries per page.
_FP8_CONSTANTS = (2112, 64, 4, 2, 0, 32, 2048, 2048, 1, 64, 0, 1, 1, 0, 1, 1, 16, 2, 1)
_NO_ROOM = (0, 0, 0, 0)  # the by-value room fields of a launch of several rooms
# After the constants: ONE_ROOM, then CONTENTS (content digests stored: the default), then FOLD
# (cells stored, not folded on the device: a bare kernel's default; the engine's twin folds).


def test_later_launches_call_the_compiled_kernel_with_every_argument_in_order(monkeypatch):
    signature = {name: "i64" for name in kernel_module._ARG_NAMES}
    fake, kernel = _kernel(monkeypatch, signature)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=4, max_pages=5)
    kernel.launch(1001, 2001, 2501, 3001, n_rooms=2, max_pages=1)
    assert len(fake.jit_launches) == 1 and fake.jit_launches[0][0] == (4, 3, 3)
    grid, args = fake.direct_launches[0]
    assert grid == (2, 3, 1)
    assert args == (1001, 111, 2001, 2501, 3001, *_NO_ROOM, *_FP8_CONSTANTS, False, True, False, False)
    assert kernel.launch_args(1001, 2001, 2501, 3001) == args


def test_a_one_room_launch_passes_the_room_by_value_to_a_kernel_of_its_own(monkeypatch):
    signature = {name: "i64" for name in kernel_module._ARG_NAMES}
    fake, kernel = _kernel(monkeypatch, signature)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=2, max_pages=5)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=1, max_pages=5, one_room=(7000, 8, 5, 1200))
    assert [kw["ONE_ROOM"] for _, _, kw in fake.jit_launches] == [False, True]  # two compiled variants
    assert fake.jit_launches[1][1][5:9] == (7000, 8, 5, 1200)
    kernel.launch(1001, 2001, 2501, 3001, n_rooms=1, max_pages=3, one_room=(7001, 4, 3, 700))
    kernel.launch(1002, 2002, 2502, 3002, n_rooms=2, max_pages=3, one_room=(7002, 4, 3, 700))  # ignored: two rooms
    assert len(fake.jit_launches) == 2
    assert fake.direct_launches[0][1] == (1001, 111, 2001, 2501, 3001, 7001, 4, 3, 700, *_FP8_CONSTANTS, True, True, False, 0)
    assert fake.direct_launches[1][1] == (1002, 111, 2002, 2502, 3002, *_NO_ROOM, *_FP8_CONSTANTS, False, True, False, False)


@pytest.mark.parametrize("signature", [
    {name: "i64" for name in kernel_module._ARG_NAMES[:-1]},  # an argument fewer
    {name: "i64" for name in reversed(kernel_module._ARG_NAMES)},  # another order
    None,  # no signature to check (another Triton)
])
def test_a_compiled_kernel_that_does_not_fit_keeps_the_jit_entry_point(monkeypatch, signature):
    fake, kernel = _kernel(monkeypatch, signature)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=1, max_pages=1)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=1, max_pages=1)
    assert len(fake.jit_launches) == 2 and fake.direct_launches == []


def test_nothing_is_launched_for_empty_batches(monkeypatch):
    fake, kernel = _kernel(monkeypatch, {name: "i64" for name in kernel_module._ARG_NAMES})
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=0, max_pages=3)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=2, max_pages=0)
    assert fake.jit_launches == [] and fake.direct_launches == []


def test_the_argument_names_checked_are_the_kernels_own():
    import inspect

    assert tuple(inspect.signature(kernel_module._digest_rooms_kernel.fn).parameters) == kernel_module._ARG_NAMES


def test_a_launch_on_another_device_goes_through_the_jit(monkeypatch):
    signature = {name: "i64" for name in kernel_module._ARG_NAMES}
    fake, kernel = _kernel(monkeypatch, signature)
    monkeypatch.setattr(kernel_module, "_current_device", lambda: 0)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=1, max_pages=1)
    monkeypatch.setattr(kernel_module, "_current_device", lambda: 1)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=1, max_pages=1)
    assert len(fake.jit_launches) == 2 and fake.direct_launches == []


def test_a_launch_given_its_device_and_stream_calls_the_c_launcher_directly(monkeypatch):
    signature = {name: "i64" for name in kernel_module._ARG_NAMES}
    fake, kernel = _kernel(monkeypatch, signature)
    monkeypatch.setattr(kernel_module, "_current_device", lambda: 0)
    monkeypatch.setattr(kernel_module, "_launch_hooks_set", lambda: False)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=1, max_pages=1)  # the JIT compiles and loads it
    kernel.launch(1001, 2001, 2501, 3001, n_rooms=2, max_pages=3, device=0, stream=0xABC)
    assert fake.run_launches == [(2, 3, 2, 0xABC, "cu-function", ("packed",), None, None, None,
                                  1001, 111, 2001, 2501, 3001, *_NO_ROOM, *_FP8_CONSTANTS, False, True, False, False)]
    assert fake.direct_launches == []


def test_a_launch_hook_keeps_launches_on_tritons_own_path(monkeypatch):
    """A profiler's launch hooks are called by `CompiledKernel[grid]`, not by the C launcher."""
    signature = {name: "i64" for name in kernel_module._ARG_NAMES}
    fake, kernel = _kernel(monkeypatch, signature)
    monkeypatch.setattr(kernel_module, "_current_device", lambda: 0)
    monkeypatch.setattr(kernel_module, "_launch_hooks_set", lambda: True)
    kernel.launch(1000, 2000, 2500, 3000, n_rooms=1, max_pages=1)
    kernel.launch(1001, 2001, 2501, 3001, n_rooms=1, max_pages=1, device=0, stream=0xABC)
    assert fake.run_launches == [] and len(fake.direct_launches) == 1


def test_launch_hooks_are_read_where_this_triton_keeps_them(monkeypatch):
    import triton

    def hook(*args):
        pass

    assert kernel_module._launch_hooks_set() is False
    chain = triton.knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a chain of hooks, empty when unset
        chain.add(hook)
        try:
            assert kernel_module._launch_hooks_set() is True
        finally:
            chain.remove(hook)
        assert kernel_module._launch_hooks_set() is False
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hook)  # a plain attribute
    assert kernel_module._launch_hooks_set() is True
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    assert kernel_module._launch_hooks_set() is False
