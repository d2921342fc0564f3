"""Page ids on their way to the host, without a host-device sync.

Hooks get page ids as device tensors, and diagnosis needs them as host
numbers, rarely and later (on the collector thread). Reading a device tensor
(`.cpu()`) would wait for the whole stream. `capture` instead queues a copy
into pinned host memory on the current stream, with an event behind it: no
wait; `host_ints` waits for that event only, off the serving thread. A page
table's values are fixed once the stream has computed it, so the copy need
not be made at the hook: decode's monitor has the collector make it, on the
collector's own stream, once a digest of the room (whose event was recorded
behind the table) is back, and the serving thread copies nothing (pd/decode.py).
Where a hook has to copy (an allocation with no digest to follow it), it does
so here with an event of its own; `capture(..., deferred=True)` and
`HostIds.settle(batch_event)` let such a copy ride on the event of a launch
queued right after it, on the same stream.

Host containers (lists, arrays, CPU tensors) are kept as they are. torch is
not imported here: where it is not loaded no value can be a tensor, and the
log tools (`diff`, `report`) that import diagnosis stay light.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def tensor_type():
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


_UNSETTLED = object()  # a deferred capture's event, until `settle` names one


class HostIds:
    """A device tensor's values as the stream had them at `capture`: copied to pinned
    memory, readable once the copy's event has completed."""

    __slots__ = ("_host", "_event")

    def __init__(self, host: Any, event: Any):
        self._host, self._event = host, event

    def settle(self, event: Any = None) -> None:
        """A deferred capture's event: `event`, recorded on the copy's stream after it (a
        pooled event recycled later only waits longer), or, when None, one of its own now."""
        if self._event is not _UNSETTLED:
            return
        if event is None:
            event = sys.modules["torch"].cuda.Event()
            event.record()
        self._event = event

    def numpy(self) -> np.ndarray:
        """The values (waits for the copy: collector thread only)."""
        event = self._event
        if event is _UNSETTLED:
            raise RuntimeError("captured page ids read before their copy's event was settled")
        if event is not None:
            event.synchronize()
            self._event = None
        return self._host.numpy().reshape(-1)

    @property
    def nbytes(self) -> int:
        return self._host.numel() * self._host.element_size()


def capture(values: Any, *, deferred: bool = False) -> Any:
    """`values` as host memory will hold them: a `HostIds` for a CUDA tensor, else `values`.
    `deferred`: no event yet; the caller settles it (`HostIds.settle`) before it returns."""
    tensor = tensor_type()
    if tensor is None or not isinstance(values, tensor) or values.device.type != "cuda":
        return values
    torch = sys.modules["torch"]
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values.detach(), non_blocking=True)
    # The copy may run on another stream than the one `values` was made on (the decode
    # collector's own): its memory is not handed out again before the copy has run.
    values.record_stream(torch.cuda.current_stream(values.device))
    ids = HostIds(host, _UNSETTLED)
    if not deferred:
        ids.settle()  # its own event, right behind the copy
    return ids


def host_ints(values: Any) -> np.ndarray:
    """Flat int64 host array of `values` (None, a container, a tensor, `HostIds`, or
    anything with a `resolve()` giving one)."""
    if values is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(values, HostIds):
        return values.numpy().astype(np.int64, copy=False)
    if hasattr(values, "resolve"):
        return values.resolve()
    tensor = tensor_type()
    if tensor is not None and isinstance(values, tensor):
        if values.device.type == "cuda":  # not captured at its hook: the copy and its event now
            return capture(values).numpy().astype(np.int64, copy=False)
        values = values.detach().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)
