"""Reusable staging buffers and CUDA events.

Allocating pinned memory (cudaHostAlloc) costs hundreds of microseconds; a
digest batch needs one staging buffer (a pinned host half and its device
twin), and one event. Both come back to their pool once the batch's event
has completed, so steady state allocates nothing and creates no event.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

# One size class covers every batch up to 128 KiB (a decode batch of 16 rooms of
# 30 layers x 9 pages, cells and their contents), so the buffers reserved at start-up serve nearly every
# batch and the serving thread never waits for a pinned allocation.
_MIN_BYTES = 128 * 1024


@dataclass
class Staging:
    """A host buffer, its int64 NumPy view made once, and a device twin of the same size.

    The submit writes tables into `words` and copies them up into `device`; the
    kernel reads them there and stores its cells into the back of `device`, which
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

    def __init__(self, device: torch.device, max_free_per_class: int = 64, *, twin: bool = True):
        self.device = device
        self.pin = device.type == "cuda"
        self.twin = twin  # each buffer gets its device twin (the engine's outputs "device")
        self.max_free_per_class = max_free_per_class
        # The smallest class's free list, never replaced: a submit pops from it directly
        # (one C call, atomic under the GIL), the collector appends to it (`give`).
        self.min_free: list[Staging] = []
        self._free: dict[int, list[Staging]] = {_MIN_BYTES: self.min_free}
        self._lock = threading.Lock()
        self.allocations = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(_MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())

    def _allocate(self, size: int) -> Staging:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        if not self.twin:
            return Staging(host, host.numpy().view(np.int64), host.data_ptr())
        device = torch.empty(size, dtype=torch.uint8, device=self.device)
        return Staging(host, host.numpy().view(np.int64), host.data_ptr(), device, device.data_ptr())

    def reserve(self, nbytes: int, count: int) -> None:
        """Allocate ahead (at start-up, not on the hot path) `count` buffers for `nbytes`."""
        size = self.size_class(nbytes)
        buffers = [self._allocate(size) for _ in range(count)]
        with self._lock:
            self.allocations += count
            self._free.setdefault(size, []).extend(buffers)

    def take(self, nbytes: int) -> Staging:
        """A buffer of at least `nbytes`; give it back once the GPU is done with it.

        Takes from the buffer's own size class first, then the smallest larger
        one; allocates only when none is free.
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
        return self._allocate(size)

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
