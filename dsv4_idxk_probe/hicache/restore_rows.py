"""Page numbers of a host-pool copy: made in stream order on the copying thread where the
digest needs them, read back by the digest engine's collector everywhere else.

A page-path copy names its pages as index tensors of `page_size` slots per page; the
pool's row of a page group is its first index over the page size. Restore verification
needs three things from them:

* the **device page ids** the digest reads, in stream order: the digest kernel reads
  every P-th device index and divides it itself (`DigestEngine(page_id_stride=P)`: what
  `indices.reshape(-1, P)[:, 0] // P` gives, as the pool computes it), so the copying
  thread hands it the index tensor as it is; an engine without the stride gets
  `indices[::P].floor_divide(P)`, made by the copying thread (`restore.RestoreVerifier`);
* the **host rows** that key the kept digests: plain ints, wanted only on the
  collector, after the digest's event. So the copying thread keeps a reference to the
  index tensor and its version counter (no device op) and the collector reads it
  (`read_rows`): a CPU tensor directly, a device tensor with a copy on a stream of its
  own, waited for there;
* the **device page numbers** a finding names: read by the collector only when a load
  differs from its backup (from the device index tensor, unless it was rewritten since).

A tensor written in place after the copy (its version moved) cannot say which rows the
copy named: `read_rows` returns None and the caller counts the copy unverified. One with no
version counter (an inference tensor) is copied at the copy instead (`held`).
"""

from __future__ import annotations

import threading
from typing import Any

_sides: dict[tuple[int, int], Any] = {}  # (collector thread, device index) -> its `_SideRead`
_sides_lock = threading.Lock()


def held(tensor) -> tuple[Any, int | None]:
    """A copy's index tensor as `read_rows` reads it later, and its version counter now. An
    inference tensor (SGLang's scheduler under `torch.inference_mode`, as
    SGLANG_ENABLE_TORCH_INFERENCE_MODE runs it) keeps no version counter: it is copied now,
    in stream order, into a tensor of the probe's own, never written (version None): one
    device op more per copy, in that mode only."""
    if tensor.is_inference():
        return tensor.clone(), None
    return tensor, tensor._version


def read_rows(tensor, version: int | None, page_size: int | None) -> list[int] | None:
    """On the collector, once the stream has passed the copy (the digest's event, or an
    event recorded behind the copy): the page numbers as ints. `version`: the tensor's
    version counter when the copy named it (None: the probe's own tensor, never written).
    `page_size` None: the tensor holds page ids already (the device page ids). None
    when the tensor was written in place since the copy named it (its rows are unknown)."""
    if version is not None and tensor._version != version:
        return None
    if getattr(tensor, "is_cuda", False):
        values = _device_read(tensor if page_size is None else tensor[::page_size])
    else:
        values = (tensor if page_size is None else tensor[::page_size]).tolist()
    if version is not None and tensor._version != version:  # written while the copy ran: either values
        return None
    if page_size is None:
        return [int(v) for v in values]
    return [int(v) // page_size for v in values]


class _SideRead:
    """One collector thread's read-back tools on one device, made once and reused: a side
    stream, an event and a pinned buffer that grows to the largest read (each read waits
    for its copy before the next one reuses the buffer)."""

    __slots__ = ("stream", "done", "host")

    def __init__(self, device):
        import torch

        self.stream = torch.cuda.Stream(device=device)
        self.done = torch.cuda.Event()
        self.host = torch.empty(256, dtype=torch.int64, pin_memory=True)  # 256 page ids; grown when needed

    def read(self, tensor) -> list:
        import torch

        n = tensor.numel()
        host = self.host
        if host.dtype != tensor.dtype or host.numel() < n:
            host = self.host = torch.empty(max(n, 2 * host.numel(), 256), dtype=tensor.dtype, pin_memory=True)
        out = host[:n].view(tensor.shape)
        with torch.cuda.stream(self.stream):
            out.copy_(tensor, non_blocking=True)
            self.done.record(self.stream)
        self.done.synchronize()
        return out.tolist()


def _device_read(tensor) -> list:
    """A device tensor's values, copied on a side stream and waited for on this thread (the
    collector's) alone: the serving thread's streams never wait for it. Each collector
    thread keeps its own stream, event and pinned buffer per device (`_SideRead`)."""
    import torch

    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    key = (threading.get_ident(), index)
    side = _sides.get(key)
    if side is None:
        with _sides_lock:
            side = _sides.setdefault(key, _SideRead(tensor.device))
    return side.read(tensor)
