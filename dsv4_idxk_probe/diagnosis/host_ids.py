"""Page ids on their way to the host, without a host-device sync.

Hooks get page ids as device tensors, and diagnosis needs them as host
numbers, rarely and later (on the collector thread). Reading a device tensor
then (`.cpu()`) would wait for the whole stream, and would read the values as
they are then, not as they were at the hook. `capture` instead queues a copy
into pinned host memory on the current stream, at the hook, with an event
behind it: a few microseconds, no wait. `host_ints` waits for that event
only, off the serving thread.

Host containers (lists, arrays, CPU tensors) are kept as they are. torch is
not imported here: where it is not loaded no value can be a tensor, and the
log tools (`diff`, `report`) that import diagnosis stay light.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


def _tensor_type():
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


class HostIds:
    """A device tensor's values as the stream had them at `capture`: copied to pinned
    memory, readable once the copy's event has completed."""

    __slots__ = ("_host", "_event")

    def __init__(self, host: Any, event: Any):
        self._host, self._event = host, event

    def numpy(self) -> np.ndarray:
        """The values (waits for the copy: collector thread only)."""
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None
        return self._host.numpy().reshape(-1)

    @property
    def nbytes(self) -> int:
        return self._host.numel() * self._host.element_size()


def capture(values: Any) -> Any:
    """`values` as host memory will hold them: a `HostIds` for a CUDA tensor, else `values`."""
    tensor = _tensor_type()
    if tensor is None or not isinstance(values, tensor) or values.device.type != "cuda":
        return values
    torch = sys.modules["torch"]
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values.detach(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return HostIds(host, event)


def host_ints(values: Any) -> np.ndarray:
    """Flat int64 host array of `values` (None, a container, a tensor, `HostIds`, or
    anything with a `resolve()` giving one)."""
    if values is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(values, HostIds):
        return values.numpy().astype(np.int64, copy=False)
    if hasattr(values, "resolve"):
        return values.resolve()
    tensor = _tensor_type()
    if tensor is not None and isinstance(values, tensor):
        if values.device.type == "cuda":  # not captured at its hook: the copy and its event now
            return capture(values).numpy().astype(np.int64, copy=False)
        values = values.detach().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)
