"""How the rig's decode loop passes the time of a model forward it does not run.

The rig runs no model, so each decode batch waits for `decode_step_ms`
instead. How it waits changes what the probe's calls after it cost, so the
choice is named in the rig's config (`decode_step_wait`):

- "sleep": the thread sleeps; its core and the GPU idle.
- "spin": the thread stays on its core and gives up the GIL every turn.
- "gpu": a kernel keeps the GPU busy for the step's time and the thread waits
  on an event, GIL released, as a scheduler thread waits for its forward
  (the CUDA driver spin-waits when cores outnumber GPUs). Closest to serving;
  needs CUDA, and two GPUs to keep prefill's work off decode's GPU.

On H200s a digest submit after a model step of any of these costs several
times one made right after another (the caches and clocks cool): benchmarks
must pass model time, and say how (bench/RESULTS.md has the measurements).
"""

from __future__ import annotations

import time
from collections.abc import Callable

STEP_WAITS = ("sleep", "spin", "gpu")


def spin(seconds: float) -> None:
    """Busy-wait on the core; `time.sleep(0)` releases the GIL every turn."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        time.sleep(0)


class GpuForward:
    """A kernel that keeps the GPU busy for a given time, then a wait for it.

    `torch.cuda._sleep` spins the GPU for a number of clock cycles; the rate
    is measured once here, because the clock differs between GPUs.
    """

    def __init__(self, device):
        import torch

        self._torch = torch
        self.device = device
        self._done = torch.cuda.Event()
        self.cycles_per_s = self._calibrate()

    def _calibrate(self, cycles: int = 4_000_000) -> float:
        torch = self._torch
        with torch.cuda.device(self.device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            rate = 0.0
            for _ in range(3):  # the first run also loads the kernel
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                rate = cycles / (start.elapsed_time(end) / 1e3)
        return rate

    def __call__(self, seconds: float) -> None:
        with self._torch.cuda.device(self.device):
            self._torch.cuda._sleep(int(seconds * self.cycles_per_s))
            self._done.record()
            self._done.synchronize()


def step_wait(how: str, device=None) -> Callable[[float], None]:
    """The function that passes a decode step's model time, by its config name;
    `device` is the rig's ("cpu", "cuda:N" or a torch.device)."""
    if how == "sleep":
        return time.sleep
    if how == "spin":
        return spin
    if how == "gpu":
        if device is None or not str(device).startswith("cuda"):
            raise ValueError(f"decode_step_wait 'gpu' needs the rig on CUDA, got device {device}")
        return GpuForward(device)
    raise ValueError(f"decode_step_wait must be one of {', '.join(STEP_WAITS)}, got {how!r}")
