"""Reusable pinned host buffers and CUDA events.

Allocating pinned memory (cudaHostAlloc) costs hundreds of microseconds; a
digest batch needs one staging buffer in and one result buffer out, and one
event. All come back to their pool once the batch's event has completed, so
steady state allocates nothing and creates no event.
"""

from __future__ import annotations

import threading

import torch

_MIN_BYTES = 4096


class PinnedPool:
    """Free lists of uint8 host tensors by power-of-two size class."""

    def __init__(self, pin: bool, max_free_per_class: int = 64):
        self.pin = pin
        self.max_free_per_class = max_free_per_class
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocations = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(_MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())

    def reserve(self, nbytes: int, count: int) -> None:
        """Allocate ahead (at start-up, not on the hot path) `count` buffers for `nbytes`."""
        size = self.size_class(nbytes)
        buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for _ in range(count)]
        with self._lock:
            self.allocations += count
            self._free.setdefault(size, []).extend(buffers)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least `nbytes` (slice it); give it back when done.

        Takes the smallest free buffer that fits; allocates only when none does.
        """
        size = self.size_class(nbytes)
        with self._lock:
            for cls in sorted(c for c, free in self._free.items() if c >= size and free):
                return self._free[cls].pop()
            self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.numel(), [])
            if len(free) < self.max_free_per_class:
                free.append(buffer)


class EventPool:
    """CUDA events to record and give back; creating one is a driver call per batch."""

    def __init__(self, max_free: int = 256):
        self.max_free = max_free
        self._free: list = []
        self._lock = threading.Lock()

    def take(self, timing: bool = False):
        if not timing:
            with self._lock:
                if self._free:
                    return self._free.pop()
        return torch.cuda.Event(enable_timing=timing)

    def give(self, event) -> None:
        with self._lock:
            if len(self._free) < self.max_free:
                self._free.append(event)
