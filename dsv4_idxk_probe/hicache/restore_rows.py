"""Page numbers of a host-pool copy: made in stream order on the copying thread where the
digest needs them, read back by the digest engine's collector everywhere else.

A page-path copy names its pages as index tensors of `page_size` slots per page; the
pool's row of a page group is its first index over the page size. Restore verification
needs three things from them:

* the **device page ids** the digest reads, on the indices' device, before the digest's
  launch (`device_page_ids`: one strided view and one division, no read-back);
* the **host rows** that key the kept digests, and the device page numbers a finding
  names: plain ints, wanted only on the collector, after the digest's event. So the
  copying thread keeps a reference to the index tensor and its version counter
  (`Captured`: no device op) and the collector reads it (`read_rows`): a CPU tensor
  directly, a device tensor with a copy on a stream of its own, waited for there.

A tensor written in place after the copy (its version moved) cannot say which rows the
copy named: `read_rows` returns None and the caller counts the copy unverified.
"""

from __future__ import annotations

import threading
from typing import Any

_streams: dict[int, Any] = {}  # device index -> the collectors' side stream for read-backs
_streams_lock = threading.Lock()


class Captured:
    """An index tensor as a copy call passed it, and its version counter at that instant."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        self.tensor = tensor
        self.version = getattr(tensor, "_version", 0)

    def changed(self) -> bool:
        return getattr(self.tensor, "_version", 0) != self.version


def device_page_ids(indices, page_size: int):
    """Each page group's row (`indices.reshape(-1, P)[:, 0] // P`, as the pool computes it):
    a new tensor on the indices' device, made in stream order, never read on this thread."""
    return indices[::page_size].floor_divide(page_size)  # one C call (the `//` operator adds two Python frames)


def read_rows(captured: Captured, page_size: int | None) -> list[int] | None:
    """On the collector, once the stream has passed the copy (the digest's event, or an
    event recorded behind the copy): the page numbers as ints. `page_size` None: the
    tensor holds page ids already (`device_page_ids`' output). None when the tensor was
    written in place since the copy named it (its rows are unknown)."""
    if captured.changed():
        return None
    tensor = captured.tensor
    if getattr(tensor, "is_cuda", False):
        values = _device_read(tensor if page_size is None else tensor[::page_size])
    else:
        values = (tensor if page_size is None else tensor[::page_size]).tolist()
    if captured.changed():  # written while the copy ran: the values may be either
        return None
    return [int(v) // (page_size or 1) for v in values]


def _device_read(tensor) -> list:
    """A device tensor's values, copied on a side stream and waited for on this thread (the
    collector's) alone: the serving thread's streams never wait for it."""
    import torch

    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        with _streams_lock:
            stream = _streams.setdefault(index, torch.cuda.Stream(device=tensor.device))
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return host.tolist()
