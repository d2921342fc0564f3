"""Page-group checks of copy indices, run on the indices' device without a host sync.

On the page path a pool turns each group of ``page_size`` indices into one
row number by reading the group's first index only, so a group that is not
one whole, aligned page is floored without any error and a page is dropped.
Checking that needs the index values, which live on the GPU: reading them on
the scheduler thread would synchronise it, and even one extra kernel launch
per copy costs more CPU time than the whole wrapper may add.

So the copy wrapper (`submit`) only queues the index tensors themselves with
their version counters and the current stream; CPU indices, which are cheap
to copy, are snapshotted instead. A daemon thread (`Flusher`) later waits on
its own stream for the copy stream, runs the checks for all queued calls of
one (pool, direction, side) at once, and accumulates the counts in one device
tensor, which it reads back with one copy per device per flush (polled, not
waited on).

Indices that are modified in place after the copy call (PyTorch bumps a
tensor's version on every in-place write, views included) are not checked:
an item whose version moved before the check ran, or before its result was
read back, is dropped and counted, never reported as a violation. Writes
that bypass PyTorch (a raw kernel writing through the pointer) are not seen.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..safety import safe_invoke
from .restore_rows import held

SIDES = ("host", "device")
CHECKS = ("not_whole_page", "unaligned", "out_of_range")
#: ``check`` label values, in report order.
CHECK_LABELS = tuple(f"{side}_{check}" for side in SIDES for check in CHECKS)


@dataclass(frozen=True)
class CheckSlot:
    """One (pool, direction) whose violations are reported together."""

    index: int
    pool: str
    direction: str
    page_size: int
    limits: tuple[int, int]  # first invalid index on the host and on the device side


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of(tensor: torch.Tensor) -> int | None:
    """Raw handle of the current stream on the tensor's GPU (None on the CPU).

    The raw query costs well under a microsecond; building a Stream object
    (``torch.cuda.current_stream``) costs several, on every copy call."""
    if not tensor.is_cuda:
        return None
    index = tensor.device.index
    return _RAW_STREAM(index) if _RAW_STREAM is not None else torch.cuda.current_stream(index).cuda_stream


def _violations(groups: torch.Tensor, page_size: int, limit: int, arange: torch.Tensor) -> torch.Tensor:
    """int64 [3]: groups that are not consecutive, whose first index is not
    page-aligned, and whose page lies outside [0, limit)."""
    first = groups[:, :1]
    not_whole = (groups - first).ne(arange).any(dim=1)
    head = first.squeeze(1)
    unaligned = head.remainder(page_size).ne(0)
    out_of_range = head.lt(0) | head.ge(limit)
    return torch.stack((not_whole.sum(), unaligned.sum(), out_of_range.sum()))


class _Batch:
    """The queued index tensors of one (device, slot, side), checked together."""

    __slots__ = ("slot", "side", "parts", "streams", "guards", "items")

    def __init__(self, slot: CheckSlot, side: int):
        self.slot, self.side = slot, side
        self.parts: list[torch.Tensor] = []
        self.streams: set = set()
        self.guards: list[tuple[torch.Tensor, int]] = []  # (queued tensor, its version then)
        self.items = 0

    def unchanged(self) -> bool:
        return all(t._version == v for t, v in self.guards)


class IndexChecker:
    """Queueing on the caller's thread; checks and readback on the flusher's."""

    def __init__(
        self,
        on_violations: Callable[[CheckSlot, dict[str, int]], None],
        on_drop: Callable[[int], None],
        queue_max: int = 4096,
        snapshot_cpu: bool = True,  # False: track CPU indices by version too (tests of the GPU path)
    ):
        self._snapshot_cpu = snapshot_cpu
        self._on_violations = on_violations
        self._on_drop = on_drop
        self._queue_max = queue_max
        self._pending: deque = deque()
        self._slots: list[CheckSlot] = []
        self._slot_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._aranges: dict[tuple, torch.Tensor] = {}
        self._streams: dict[torch.device, object] = {}
        self._external: dict[tuple, object] = {}
        self._pinned: dict[torch.device, torch.Tensor] = {}
        self.flushes = 0
        self.readbacks = 0  # device-to-host copies made by flushes
        self.dropped = 0

    def add_slot(self, pool: str, direction: str, page_size: int, host_limit: int, device_limit: int) -> CheckSlot:
        with self._slot_lock:
            slot = CheckSlot(len(self._slots), pool, direction, page_size, (host_limit, device_limit))
            self._slots.append(slot)
        return slot

    # -- caller's thread: no sync, no value reads, no kernel launch on a GPU (but an inference
    #    tensor's copy: `held`) --

    def submit(self, slot: CheckSlot, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Queue both index tensors of one page-path call for checking."""
        if len(self._pending) >= self._queue_max:
            self._drop(2)  # unit: index tensors left unchecked (host and device side)
            return
        host = host_indices if host_indices.dim() == 1 else host_indices.reshape(-1)
        device = device_indices if device_indices.dim() == 1 else device_indices.reshape(-1)
        if host.is_cuda or device.is_cuda or not self._snapshot_cpu:
            (host, host_v), (device, device_v) = held(host), held(device)
            self._pending.append((slot, host, device, host_v, device_v, _stream_of(host), _stream_of(device)))
        else:  # CPU indices: a copy costs less than tracking them
            self._pending.append((slot, torch.cat((host, device)), host.numel()))

    def _drop(self, n: int) -> None:
        self.dropped += n
        self._on_drop(n)

    # -- flusher's thread ---------------------------------------------------------

    def _arange(self, size: int, like: torch.Tensor) -> torch.Tensor:
        key = (size, like.device, like.dtype)
        if key not in self._aranges:
            self._aranges[key] = torch.arange(size, device=like.device, dtype=like.dtype)
        return self._aranges[key]

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _waitable(self, device: torch.device, raw: int):
        key = (device, raw)
        if key not in self._external:
            self._external[key] = torch.cuda.ExternalStream(raw, device=device)
        return self._external[key]

    def _batches(self, items: list) -> tuple[dict, int]:
        """Group queued items by (device, slot, side); drop those modified since."""
        batches: dict[tuple, _Batch] = {}
        dropped = 0
        for item in items:
            slot = item[0]
            if len(item) == 3:  # CPU snapshot
                snap, n = item[1], item[2]
                sides, streams, versions = (snap[:n], snap[n:]), (None, None), None
            else:
                _, host, device, host_v, device_v, host_s, device_s = item
                if (host_v is not None and host._version != host_v) or (
                        device_v is not None and device._version != device_v):
                    dropped += 2
                    continue
                sides, streams, versions = (host, device), (host_s, device_s), (host_v, device_v)
            for side in (0, 1):
                tensor = sides[side]
                batch = batches.get((tensor.device, slot.index, side))
                if batch is None:
                    batch = batches[(tensor.device, slot.index, side)] = _Batch(slot, side)
                batch.parts.append(tensor)
                batch.streams.add(streams[side])
                batch.items += 1
                if versions is not None and versions[side] is not None:
                    batch.guards.append((tensor, versions[side]))
        return batches, dropped

    def _check(self, device: torch.device, batch: _Batch) -> torch.Tensor:
        slot = batch.slot
        flat = batch.parts[0] if len(batch.parts) == 1 else torch.cat(batch.parts)
        groups = flat.view(-1, slot.page_size)
        return _violations(groups, slot.page_size, slot.limits[batch.side], self._arange(slot.page_size, groups))

    def _read_back(self, device: torch.device, counts: torch.Tensor) -> torch.Tensor:
        """Copy the counts to the host. On a GPU: into pinned memory on the
        flusher's stream, then poll an event, so not even this thread blocks in
        a synchronising call."""
        stream = self._side_stream(device)
        if stream is None:
            return counts
        pinned = self._pinned.get(device)
        if pinned is None or pinned.shape[0] < counts.shape[0]:
            pinned = self._pinned[device] = torch.empty((2 * counts.shape[0], 3), dtype=torch.int64, pin_memory=True)
        out = pinned[: counts.shape[0]]
        with torch.cuda.stream(stream):
            out.copy_(counts, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        while not done.query():
            time.sleep(0.0005)
        return out.clone()

    def _flush_device(self, device: torch.device, batches: list[_Batch]) -> torch.Tensor:
        """Check every batch of one device; one int64 [batches, 3] host tensor."""
        stream = self._side_stream(device)
        if stream is None:
            return torch.stack([self._check(device, b) for b in batches])
        with torch.cuda.stream(stream):
            for raw in set().union(*(b.streams for b in batches)) - {None}:
                stream.wait_stream(self._waitable(device, raw))
            counts = torch.stack([self._check(device, b) for b in batches])  # the device counter tensor
        return self._read_back(device, counts)

    def flush(self) -> None:
        """Check everything queued, read the counts back, report violations."""
        with self._flush_lock:
            items = []
            while self._pending:
                items.append(self._pending.popleft())
            batches, dropped = self._batches(items)
            totals: dict[int, list[int]] = {}
            by_device: dict[torch.device, list[_Batch]] = {}
            for (device, _, _), batch in batches.items():
                by_device.setdefault(device, []).append(batch)
            for device, group in by_device.items():
                counts = safe_invoke("hicache.index_check", self._flush_device, device, group)
                if counts is None:
                    continue
                self.readbacks += 1
                for batch, row in zip(group, counts.tolist()):
                    if not batch.unchanged():  # modified while being checked: the result may be stale
                        dropped += batch.items
                        continue
                    total = totals.setdefault(batch.slot.index, [0] * len(CHECK_LABELS))
                    for c, n in enumerate(row):
                        total[batch.side * len(CHECKS) + c] += n
            del items, batches, by_device  # references are released only after the readback completed
            self.flushes += 1
        if dropped:
            self._drop(dropped)
        for index, total in totals.items():
            counts = {label: n for label, n in zip(CHECK_LABELS, total) if n}
            if counts:
                safe_invoke("hicache.index_report", self._on_violations, self._slots[index], counts)

    def pending(self) -> int:
        return len(self._pending)


class Flusher:
    """Daemon thread that calls `flush` every ``interval_s``, and once more on stop."""

    def __init__(self, flush: Callable[[], None], interval_s: float):
        self._flush = flush
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsv4-idxk-probe-hicache-flush", daemon=True)

    def start(self) -> "Flusher":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            safe_invoke("hicache.flush", self._flush)
        safe_invoke("hicache.flush", self._flush)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
