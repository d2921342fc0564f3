"""Which GPU this process runs on, for `dsv4_idxk_probe_gpu_info` (docs/observability.md).

"Is this hardware?" is the first question about a corrupt room: the answer is in DCGM's
XID and ECC counters of that rank's GPU, which DCGM's exporter labels by ``UUID``
(``GPU-5fd4e1f5-...``), ``Hostname`` and ``gpu`` (the index nvidia-smi shows, not the
CUDA index inside a process that sees a subset of GPUs). The UUID is the one label that
means the same on both sides, so this names it.

Read once when the probe's metrics are built, from torch's device properties: a host-side
query (cudaGetDeviceProperties, cached by torch), no kernel, no stream, no host sync. Only
where this process has already initialised CUDA (SGLang's scheduler has, by then): the
probe never initialises CUDA itself. Without CUDA (CPU, the rig) it returns None and
nothing is published.
"""

from __future__ import annotations

import socket
import sys


def gpu_identity() -> dict[str, str] | None:
    """{"gpu_uuid", "hostname", "cuda_device"} of the current CUDA device, or None."""
    torch = sys.modules.get("torch")  # never imported here: a process without torch has no GPU to name
    if torch is None:
        return None
    cuda = torch.cuda
    if not cuda.is_available() or not cuda.is_initialized():
        return None
    index = cuda.current_device()
    uuid = str(getattr(cuda.get_device_properties(index), "uuid", "") or "")
    if not uuid:
        return None
    if not uuid.startswith("GPU-"):  # torch prints the bare UUID; DCGM and nvidia-smi prefix it
        uuid = f"GPU-{uuid}"
    return {"gpu_uuid": uuid, "hostname": socket.gethostname(), "cuda_device": str(index)}
