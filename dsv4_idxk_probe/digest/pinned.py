"""Reusable staging buffers and CUDA events.

Allocating pinned memory (cudaHostAlloc) costs hundreds of microseconds; a
digest batch needs one staging buffer (a pinned host half and its device
twin), and one event. Both come back to their pool once the batch's event
has completed, so steady state allocates nothing and creates no event; a
size class a submit found empty is topped up by the collector thread
(`StagingPool.refill`), not by the serving thread at its next burst.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..safety import record_error

# One size class covers every batch up to 128 KiB (a decode batch of 16 rooms of
# 30 layers x 9 pages, cells and their contents), so the buffers reserved at start-up serve nearly every
# batch and the serving thread never waits for a pinned allocation.
_MIN_BYTES = 128 * 1024


_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3  # CUpointer_attribute in the CUDA driver API (cuda.h)
_driver: list = []  # libcuda, loaded once (empty: not yet tried; [None]: not loadable)


def device_maps_host_pointer(address: int) -> bool:
    """Whether a kernel may read pinned host memory at `address` through that same address:
    the driver's device pointer for it (`cuPointerGetAttribute(DEVICE_POINTER)`, what
    `cudaHostGetDevicePointer` returns) is the host pointer itself, as it is for
    `cudaHostAlloc` memory under unified addressing (every 64-bit Linux GPU since Fermi).
    False on any doubt (no driver, an error, another pointer): the caller then copies
    its tables up instead. Called when a staging buffer is allocated, never per launch."""
    try:
        if not _driver:
            try:
                _driver.append(ctypes.CDLL("libcuda.so.1"))
            except OSError:
                _driver.append(None)
        driver = _driver[0]
        if driver is None:
            return False
        out = ctypes.c_uint64(0)
        status = driver.cuPointerGetAttribute(ctypes.byref(out), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                              ctypes.c_uint64(address))
        return status == 0 and out.value == address
    except Exception:
        record_error("digest.mapped_check")
        return False


@dataclass
class Staging:
    """A host buffer, its int64 NumPy view made once, and a device twin of the same size.

    The submit writes tables into `words`; the kernel reads them there through the
    host address (or, for big launches, from `device` once copied up) and stores
    its cells into the back of `device`, which
    one copy brings down into `host`. Why not have the kernel read and store
    pinned memory directly (the first design): its few bytes per row cross PCIe
    as small scattered writes, which made a large room take several times the
    kernel's own GPU time (bench/RESULTS.md). Without CUDA
    the twin is a second host buffer, so the same offsets and copies run (and
    are tested) under the interpreter."""

    host: torch.Tensor  # uint8, pinned on CUDA
    words: np.ndarray  # int64 view of `host`
    host_address: int = 0
    device: torch.Tensor | None = None  # uint8, same size, on the kernel's device
    device_address: int = 0
    # (destination, source) slices of a copy, by (start, end, down): made once per range,
    # so a submit's copy is one `copy_` call, not two slicings and a `copy_` (`pair`)
    pairs: dict = field(default_factory=dict, repr=False, compare=False)

    def upload(self, nbytes: int) -> None:
        """Copy the first `nbytes` (the tables) up, on the current stream."""
        self.device[:nbytes].copy_(self.host[:nbytes], non_blocking=True)

    def download(self, start: int, end: int) -> None:
        """Copy bytes [start, end) (the kernel's outputs) down, on the current stream."""
        self.host[start:end].copy_(self.device[start:end], non_blocking=True)

    def pair(self, start: int, end: int, down: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The (destination, source) slices of copying bytes [start, end) down (or up),
        made and kept (a few hundred ranges at most: room sizes repeat)."""
        pairs = self.pairs
        if len(pairs) >= 256:
            pairs.clear()
        host, device = self.host[start:end], self.device[start:end]
        pair = pairs[start, end, down] = (host, device) if down else (device, host)
        return pair

    @property
    def nbytes(self) -> int:
        return self.host.numel()


class StagingPool:
    """Free lists of `Staging` buffers by power-of-two size class."""

    def __init__(self, device: torch.device, max_free_per_class: int = 64, *, twin: bool = True,
                 mapped_check=device_maps_host_pointer, spare: int = 4):
        self.device = device
        self.pin = device.type == "cuda"
        self.twin = twin  # each buffer gets its device twin (the engine's outputs "device")
        # Whether every host half allocated so far can be read by a kernel at its own address
        # (`device_maps_host_pointer`): then a launch's room table is read there, not copied
        # up (launch.py). Host memory on a CPU pool is the kernel's own memory: True.
        self.mapped = True
        self._mapped_check = mapped_check if self.pin else None
        self.max_free_per_class = max_free_per_class
        # The smallest class's free list, never replaced: a submit pops from it directly
        # (one C call, atomic under the GIL), the collector appends to it (`give`).
        self.min_free: list[Staging] = []
        self._free: dict[int, list[Staging]] = {_MIN_BYTES: self.min_free}
        self._lock = threading.Lock()
        self.allocations = 0
        # Size classes a `take` found empty, so its caller (a serving thread) allocated:
        # the collector tops them up (`refill`), off that thread, before the next burst.
        self.short: set[int] = set()
        self.spare = spare  # buffers per `refill` of a class; 0: no refill, takes mark nothing

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(_MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())

    def _allocate(self, size: int) -> Staging:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        if self._mapped_check is not None and self.mapped and not self._mapped_check(host.data_ptr()):
            self.mapped = False  # one buffer that is not: no launch reads a table in place any more
        if not self.twin:
            return Staging(host, host.numpy().view(np.int64), host.data_ptr())
        # Zeroed on this thread's current stream: a kernel that folds adds into it. A submit's
        # own allocation launches on that same stream; `reserve` and `refill` wait for it.
        device = torch.zeros(size, dtype=torch.uint8, device=self.device)
        return Staging(host, host.numpy().view(np.int64), host.data_ptr(), device, device.data_ptr())

    def _zeroed(self) -> None:
        """Wait until buffers allocated on this thread are zero (`reserve`, `refill`: start-up
        and the collector, never a serving thread), so a kernel on any stream may use them."""
        if self.twin and self.pin:
            zeroed = torch.cuda.Event()  # an event's wait, not a stream's: no sync the audits flag
            zeroed.record(torch.cuda.current_stream(self.device))
            zeroed.synchronize()

    def reserve(self, nbytes: int, count: int) -> None:
        """Allocate ahead (at start-up, not on the hot path) `count` buffers for `nbytes`."""
        size = self.size_class(nbytes)
        buffers = [self._allocate(size) for _ in range(count)]
        self._zeroed()
        with self._lock:
            self.allocations += count
            self._free.setdefault(size, []).extend(buffers)

    def take(self, nbytes: int) -> Staging:
        """A buffer of at least `nbytes`; give it back once the GPU is done with it.

        Takes from the buffer's own size class first, then the smallest larger
        one; allocates only when none is free (its twin zeroed on the caller's
        current stream, the one its kernel launches on).
        """
        size = _MIN_BYTES if nbytes <= _MIN_BYTES else 1 << (int(nbytes) - 1).bit_length()  # `size_class`, inlined
        free = self._free.get(size)
        if free:  # its own class first, without the lock: a dict read and a list pop, each atomic under the GIL
            try:
                return free.pop()
            except IndexError:
                pass
        with self._lock:  # the smallest class is also popped without it (`min_free`): a pop may find it empty
            free = self._free.get(size)
            if free:
                try:
                    return free.pop()
                except IndexError:
                    pass
            for cls in sorted(c for c, f in self._free.items() if c > size and f):
                try:
                    return self._free[cls].pop()
                except IndexError:
                    continue
            self.allocations += 1
            if self.spare:
                self.short.add(size)
        return self._allocate(size)

    def refill(self) -> None:
        """Allocate `spare` more buffers of each class a `take` found empty (the collector
        calls this, never a serving thread): pinned allocation costs hundreds of
        microseconds, and a class that ran dry once (a step batch larger than the
        reserved class, a burst) will likely be asked for again. A few at a time: a
        collector busy allocating many falls behind, and the serving thread then finds
        the pool empty more often (measured: sizing a refill by the misses seen made
        the serving thread allocate more, not less)."""
        while self.short:
            try:
                size = self.short.pop()
            except KeyError:
                return
            buffers = [self._allocate(size) for _ in range(self.spare)]
            self._zeroed()
            with self._lock:
                self.allocations += len(buffers)
                self._free.setdefault(size, []).extend(buffers)

    def give(self, buffer: Staging) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.nbytes, [])
            if len(free) < self.max_free_per_class:
                free.append(buffer)


class EventPool:
    """CUDA events to record and give back; creating one is a driver call per batch.

    `blocking` events (cudaEventBlockingSync) make a thread that synchronises on
    them sleep until the GPU gets there, instead of spinning on a core.
    """

    def __init__(self, max_free: int = 256, *, blocking: bool = False):
        self.max_free = max_free
        self.blocking = blocking
        # Free events. A list's pop and append are each atomic under the GIL, so a submit
        # pops without a lock (one C call) and the collector gives back without one.
        self._free: list = []

    def reserve(self, count: int, device: torch.device) -> None:
        """Create `count` events now, at start-up: a torch event creates its CUDA event at
        its first record, so each is recorded once on `device`'s current stream (never
        waited on). A failure leaves them to be created on first use."""
        try:
            stream = torch.cuda.current_stream(device)
            events = [torch.cuda.Event(blocking=self.blocking) for _ in range(count)]
            for event in events:
                event.record(stream)
        except Exception:
            record_error("digest.events")
            return
        self._free.extend(events)

    def take(self, timing: bool = False):
        if not timing:
            try:
                return self._free.pop()
            except IndexError:
                pass
        return torch.cuda.Event(enable_timing=timing, blocking=self.blocking)

    def give(self, event) -> None:
        if len(self._free) < self.max_free:  # one giver (the collector): the bound holds
            self._free.append(event)
