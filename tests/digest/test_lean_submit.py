"""The serving thread's submit (digest/launch.py): the compiled kernel's C launch function
called directly with its arguments packed once (`DirectLaunch`), the copy down left to
the collector where the engine says so, and digests that stay the reference's."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest.launch import FOLD_SLICES, DirectLaunch, HooksSet
from dsv4_idxk_probe.digest.reference import digest_room

LAYOUT = get_layout("fp8")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Launcher:
    """A stand-in for Triton's `CudaLauncher`: Python around a C launch function, which it
    calls with the grid, the stream, a run of constants, then the kernel's arguments one by
    one (`spread`, Triton up to 3.6) or as one tuple (later releases)."""

    global_scratch_size = profile_scratch_size = 0

    def __init__(self, spread: bool):
        self.spread, self.calls = spread, []
        self.launch = lambda *call: self.calls.append(call)  # the C function

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, *args):
        constants = (function, False, True, metadata, launch_metadata, enter, leave, None, None)
        self.launch(gx, gy, gz, stream, *constants, *(args if self.spread else (args,)))


class _Hooks:
    def __init__(self, enter=None, leave=None):
        self.launch_enter_hook, self.launch_exit_hook = enter, leave


class _Chain:  # Triton's HookChain: a list of hooks, empty when none is set
    def __init__(self):
        self.calls = []


def _compiled(spread: bool):
    class Compiled:
        function, packed_metadata = 0xF00, ("packed",)
        run = _Launcher(spread)

    return Compiled()


ARGS = (1000, 111, 2000, 2500, 3000, 7, 8, 5, 1200, 2112, 64, True, True, False)  # 9 varying, then constants


@pytest.mark.parametrize("spread", [True, False])
def test_a_learnt_launch_makes_the_very_call_tritons_launcher_makes(spread):
    compiled = _compiled(spread)
    hooks = _Hooks(_Chain(), _Chain())
    direct = DirectLaunch.learn(compiled, (1, 30, 17), 0xABC, ARGS, 9, hooks)
    assert direct is not None and direct.spread is spread and direct.tail == ARGS[9:]
    assert len(compiled.run.calls) == 1 and compiled.run.launch.__name__ == "<lambda>"  # launched once, unwrapped
    again = (1001, 111, 2001, 2501, 3001, 9, 4, 3, 700)
    compiled.run(2, 30, 3, 0xDEF, compiled.function, compiled.packed_metadata, None, None, None, *again, *ARGS[9:])
    if direct.spread:
        direct.fn(2, 30, 3, 0xDEF, *direct.head, *again, *direct.tail)
    else:
        direct.fn(2, 30, 3, 0xDEF, *direct.head, again + direct.tail)
    assert compiled.run.calls[-1] == compiled.run.calls[-2]  # the engine's call == Triton's
    assert direct.quiet(hooks)
    hooks.launch_enter_hook.calls.append(print)  # a profiler adds a hook: launches go Triton's way again
    assert not direct.quiet(hooks)


def test_a_launcher_that_asks_for_scratch_memory_or_a_set_hook_is_not_learnt_and_nothing_launched():
    compiled = _compiled(True)
    compiled.run.global_scratch_size = 64
    with pytest.raises(LookupError):
        DirectLaunch.learn(compiled, (1, 30, 1), 0, ARGS, 9, _Hooks())
    compiled = _compiled(True)
    with pytest.raises(HooksSet):
        DirectLaunch.learn(compiled, (1, 30, 1), 0, ARGS, 9, _Hooks(enter=print))
    assert compiled.run.calls == []


class _OtherLauncher(_Launcher):
    """A launcher that calls its C function in an order `DirectLaunch` does not know."""

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, leave, *args):
        self.launch(function, gx, gy, gz, stream, *args)


def test_a_call_it_does_not_understand_is_launched_once_and_not_learnt():
    compiled = _compiled(True)
    compiled.run = _OtherLauncher(True)
    assert DirectLaunch.learn(compiled, (1, 30, 1), 0, ARGS, 9, _Hooks()) is None
    assert len(compiled.run.calls) == 1


def test_the_engine_launches_direct_with_the_arguments_of_its_own_launch(random_buffers):
    """On the CUDA path (device calls faked as bench/hook_ops.py fakes them), a one-room
    and a several-room submit call the learnt C function with what `DigestKernel.launch`
    would have passed: the grid, the stream, then each address and the room by value."""
    from bench.hook_ops import fake_device_calls

    engine = fake_device_calls(DigestEngine(LAYOUT, [0, 1], random_buffers(LAYOUT, 2, 8, seed=1), backend="triton"))
    seen = []
    for one in (False, True):
        engine._direct[one].fn = lambda *call: seen.append(call)
    pages = torch.tensor([3, 1, 4], dtype=torch.int32)
    ticket = engine.submit_room("r", pages, 700, lambda _: None)
    grid, stream, head, args = seen[0][:3], seen[0][3], seen[0][4:7], seen[0][7:]
    base = ticket.staging.device_address
    # the room's fold (the kernel folds into the twin): 3 pages, FOLD_SLICES x 2 layers x 2 segments, 1 count
    cells, flags = base + 8 * 32, base + 8 * (32 + 3 + FOLD_SLICES * 2 * 2 + 1)
    contents = flags + 8  # one word of flags for 6 rows
    assert (grid, stream, head) == ((1, 2, 3), 7, engine._direct[1].head)
    assert args == engine._kernel.launch_args(base, cells, contents, flags, (pages.data_ptr(), 4, 3, 700))
    engine.submit([RoomRequest("a", pages, 700), RoomRequest("b", [5, 6], 300)], lambda _: None)
    grid, args = seen[1][:3], seen[1][7:]
    assert grid == (2, 2, 3) and args[5:] == engine._kernel.launch_args(0, 0, 0, 0)[5:]
    engine.close()


@pytest.mark.parametrize("download", ["submit", "collector"])
def test_digests_are_the_references_whoever_copies_the_outputs_down(download, random_buffers):
    buffers = [b.to(DEVICE) for b in random_buffers(LAYOUT, 2, 9, seed=2)]
    engine = DigestEngine(LAYOUT, [0, 3], buffers, backend="triton", download=download, contents=True)
    host = [b.cpu() for b in buffers]
    rooms = [RoomRequest("list", [4, 2, 8], 2 * 256 + 9),
             RoomRequest("device", torch.tensor([1, 5], dtype=torch.int32, device=DEVICE), 300),
             RoomRequest("numpy", np.array([6, 3, 0, 7]), 4 * 256)]
    got, done = [], threading.Event()
    batch = engine.submit(rooms, lambda b: (got.append(b), done.set()))
    one = engine.submit_room("one", torch.tensor([3, 4, 5], device=DEVICE), 3 * 256 - 7, got.append)
    snapshot = engine.submit_room("one", [3, 4, 5], 3 * 256 - 7, got.append, contents_only=True)
    assert done.wait(60)
    assert [int(v) for v in one.room_digests] == [digest_room(host, [3, 4, 5], 3 * 256 - 7, LAYOUT, [0, 3]).room]
    engine.close()
    for room, digest in zip(rooms, got[0].digests):
        pages = room.pages.cpu().numpy() if isinstance(room.pages, torch.Tensor) else room.pages
        assert digest.room == digest_room(host, pages, room.n_tokens, LAYOUT, [0, 3], key=room.key).room
    assert [int(v) for v in batch.room_digests] == [d.room for d in got[0].digests]
    assert got[2].digests == [] and np.array_equal(got[2].contents[0], got[1].contents[0])
    assert snapshot.ready() and one.download is None  # the collector copied both down


def test_a_later_submit_of_the_same_page_table_asks_the_tensor_nothing(random_buffers):
    """A room's receipt finds its page table on the device (address, bytes per id, pages:
    `PendingDigest.table`); its later digests pass that back and launch the same room
    without a call on the tensor, one by one and in a batch (decode's `_Room.table`)."""
    from types import SimpleNamespace

    from bench.hook_ops import fake_device_calls

    engine = fake_device_calls(DigestEngine(LAYOUT, [0, 1], random_buffers(LAYOUT, 2, 8, seed=3), backend="triton"))
    seen = []
    for one in (False, True):
        engine._direct[one].fn = lambda *call: seen.append(call[7:])
    pages = torch.tensor([3, 1, 4], dtype=torch.int64)
    first = engine.submit_room("r", pages, 700, lambda _: None)
    assert first.table == (pages.data_ptr(), 8, 3)

    class Untouchable:  # a page table that must not be asked anything
        def __getattr__(self, name):
            raise AssertionError(f"asked for {name}")

        def __len__(self):
            raise AssertionError("asked for its length")

    again = engine.submit_room("r", Untouchable(), 700, lambda _: None, table=first.table)
    assert seen[1][5:9] == seen[0][5:9] == (pages.data_ptr(), 8, 3, 700) and again.table == first.table
    rooms = [SimpleNamespace(key="r", pages=Untouchable(), n_tokens=700, table=first.table),
             SimpleNamespace(key="s", pages=[5, 6], n_tokens=300, table=None)]
    engine.submit(rooms, lambda _: None)
    engine.close()
    assert len(seen) == 3 and seen[2][5:9] == (0, 0, 0, 0)  # several rooms: read from the room table
    assert engine.stats.callback_errors == 0 and engine.stats.completed_rooms == 4  # the collector asked nothing either


class _BlockingLauncher(_Launcher):
    """Its C function holds its first call until `go` is set: a learn caught mid-launch."""

    def __init__(self):
        super().__init__(True)
        self.inside, self.go = threading.Event(), threading.Event()
        real = self.launch

        def launch(*call):
            if not self.inside.is_set():
                self.inside.set()
                assert self.go.wait(10)
            return real(*call)

        self.launch = launch


def test_two_engines_learning_the_same_kernel_at_once_each_learn_its_c_function():
    """Engines on two threads (PD's and a HiCache restore engine) learn the one compiled
    kernel: the second must not take the first's recorder, in place while it launches,
    for the C function (its every launch would be recorded, without bound)."""
    compiled = _compiled(True)
    compiled.run = _BlockingLauncher()
    c_function = compiled.run.launch
    learnt = {}

    def learn(name):
        learnt[name] = DirectLaunch.learn(compiled, (1, 30, 1), 0, ARGS, 9, _Hooks())

    first = threading.Thread(target=learn, args=("first",))
    first.start()
    assert compiled.run.inside.wait(10)
    second = threading.Thread(target=learn, args=("second",))
    second.start()
    second.join(0.5)  # learning beside the first (it may not: then it waits for it)
    compiled.run.go.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert learnt["first"] is not None and learnt["second"] is not None
    assert learnt["first"].fn is c_function and learnt["second"].fn is c_function
    assert compiled.run.launch is c_function, "the launcher was left wrapped"
