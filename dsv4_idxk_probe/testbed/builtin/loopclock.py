"""Where a rig process's serving loop spends its time with the probe on.

Two ways the probe can slow a serving loop: time inside its calls on the
loop's thread, and late wake-ups from the model-time sleep when the probe's
background threads hold the GIL. Both are measured here, per kind of call,
and reported with the process's counters, so a benchmark can say which one
costs what (a mean far above the median means rare long calls: a pinned
allocation, a wait for the GIL).
"""

from __future__ import annotations

import statistics
import time


class _Timing:
    """Wall and thread-CPU time of one call: wall far above CPU means the loop waited
    (for the GIL, a lock, a blocking driver call), not that the probe computed."""

    def __init__(self, durations: list, cpu: list):
        self.durations, self.cpu = durations, cpu
        self.started = self.cpu_started = 0.0

    def __enter__(self):
        self.started, self.cpu_started = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.durations.append(time.perf_counter() - self.started)
        self.cpu.append(time.thread_time() - self.cpu_started)


class LoopClock:
    def __init__(self):
        self.calls: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.parts: dict[str, list[float]] = {}
        self.phases: dict[str, list[float]] = {}
        self.phase_cpu: dict[str, list[float]] = {}
        self.batches: list[tuple[float, int]] = []  # (wall time since the previous batch, rooms in it)
        self.running_sum = 0  # rooms running, summed over every batch
        self._last_batch = None
        self.sleep_late_s = 0.0
        self.slept_s = 0.0
        self.slept_cpu_s = 0.0  # thread CPU while passing model time (a driver spin-wait counts)
        self.sleeps = 0

    def probe(self, kind: str) -> _Timing:
        """`with clock.probe("receive"):` around one probe call on the loop's thread."""
        return _Timing(self.calls.setdefault(kind, []), self.cpu.setdefault(kind, []))

    def phase(self, name: str) -> _Timing:
        """`with clock.phase("room"):` around a part of the loop's own work, timed with the
        probe off and on alike: a part that grows with the probe on, while the probe's
        calls inside it do not, points at the probe's background threads."""
        return _Timing(self.phases.setdefault(name, []), self.phase_cpu.setdefault(name, []))

    def time_parts(self, engine, monitor=None) -> None:
        """Also time the parts of every digest submit in this process: a benchmark's
        question (where does a submit's time go inside a serving process?), not a
        serving feature. Wraps the engine's own objects where the serving thread's
        path calls them: `submit_room` and `submit` (marked, so a one-room submit keeps
        its one-room path), the one-room and batch launches, the compiled kernel's
        direct C launcher (learnt at warm-up, maybe after this call), Triton's own
        launch, the event record the engine calls, the staging take and the hand-off.
        The collector's parts are timed in thread CPU: what it holds the GIL for, per batch."""
        parts = [(engine, "submit", "submit (all)"), (engine, "submit_room", "submit (all)"),
                 (engine, "_launch", "digest or device calls (batch)"),
                 (engine, "_launch_one", "digest or device calls (one room)"),
                 (engine._tickets, "put", "hand-off to the collector")]
        if engine.backend == "triton":
            parts += [(engine._kernel, "launch", "kernel launch (Triton's path)"),
                      (engine, "_record", "event record"), (engine._staging, "take", "staging take")]
        for owner, name, label in parts:
            if hasattr(owner, name):
                self._wrap(owner, name, label)
        if engine.backend == "triton":
            self._time_direct_launches(engine)
        collector = [(engine, "_await", "collector: wait for the event (CPU)"),
                     (engine, "_finish", "collector: fold the cells (CPU)")]
        for name in ("_on_results", "_on_result"):  # decode's per batch, prefill's
            if monitor is not None and hasattr(monitor, name):
                collector.append((monitor, name, f"collector: verdicts, records, metrics (CPU, {name})"))
                break
        for owner, name, label in collector:
            self._wrap(owner, name, label, time.thread_time)

    def _time_direct_launches(self, engine) -> None:
        """Time the direct C launchers (`launch.DirectLaunch.fn`) learnt now or later."""
        clock = self

        class _TimedSlots(list):
            def __setitem__(self, index, direct):
                if direct is not None:
                    clock._wrap(direct, "fn", "kernel launch (direct)")
                super().__setitem__(index, direct)

        slots = _TimedSlots(engine._direct)
        for index, direct in enumerate(engine._direct):
            slots[index] = direct
        engine._direct = slots

    def _wrap(self, owner, name: str, label: str, clock=time.perf_counter) -> None:
        original, durations = getattr(owner, name), self.parts.setdefault(label, [])

        def timed(*args, **kwargs):
            started = clock()
            try:
                return original(*args, **kwargs)
            finally:
                durations.append(clock() - started)

        timed.times_only = True  # DigestEngine.submit_room: a timer, not a replacement
        setattr(owner, name, timed)

    def batch_done(self, rooms: int) -> None:
        """End of one decode batch of `rooms` rooms: its wall time since the previous one."""
        now = time.perf_counter()
        self.running_sum += rooms
        if self._last_batch is not None:
            self.batches.append((now - self._last_batch, rooms))
        self._last_batch = now

    def busy_batches(self, share: float = 0.8) -> list[float]:
        """Wall times of the batches that ran at least `share` of the most rooms any batch
        ran: the steady state, without the ramp-up and drain whose smaller batches blur
        a whole run's mean."""
        return [wall for wall, _ in self._busy(share)]

    def busy_tokens_per_s(self, share: float = 0.8) -> float:
        """Decode tokens per second over the busy batches (one token per room per batch).

        Why: a run's rooms/s counts whole rooms, ~1% each when ~100 finish in a run;
        tokens/s in the steady state resolves a much smaller change in the same run.
        """
        busy = self._busy(share)
        wall = sum(w for w, _ in busy)
        return sum(rooms for _, rooms in busy) / wall if wall > 0 else 0.0

    def _busy(self, share: float) -> list[tuple[float, int]]:
        if not self.batches:
            return []
        most = max(rooms for _, rooms in self.batches)
        return [(wall, rooms) for wall, rooms in self.batches if rooms >= share * most]

    def sleep(self, seconds: float, wait=time.sleep) -> None:
        """The model's forward, which the rig does not run, passed by `wait`
        (see modeltime.py); counts how late it ends."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        wait(seconds)
        waited = time.perf_counter() - started
        self.slept_cpu_s += time.thread_time() - cpu_started
        self.slept_s += waited
        self.sleep_late_s += max(0.0, waited - seconds)
        self.sleeps += 1

    def stats(self) -> dict:
        busy = self.busy_batches()
        by_kind = {
            kind: {"calls": len(d), "total_s": sum(d), "median_us": 1e6 * statistics.median(d),
                   "max_us": 1e6 * max(d), "cpu_median_us": 1e6 * statistics.median(self.cpu[kind])}
            for kind, d in self.calls.items() if d
        }
        return {"probe_s": sum(k["total_s"] for k in by_kind.values()),
                "probe_cpu_s": sum(sum(cpu) for cpu in self.cpu.values()), "slept_cpu_s": self.slept_cpu_s,
                "probe_calls": sum(k["calls"] for k in by_kind.values()), "probe_by_kind": by_kind,
                "sleep_late_s": self.sleep_late_s, "slept_s": self.slept_s, "sleeps": self.sleeps,
                "running_sum": self.running_sum, "busy_batches": len(busy),
                "busy_batch_median_us": 1e6 * statistics.median(busy) if busy else 0.0,
                "busy_tokens_per_s": self.busy_tokens_per_s(),
                "phases": {name: {"calls": len(d), "total_s": sum(d), "median_us": 1e6 * statistics.median(d),
                                  "cpu_median_us": 1e6 * statistics.median(self.phase_cpu[name])}
                           for name, d in self.phases.items() if d},
                "parts": {label: {"calls": len(d), "median_us": 1e6 * statistics.median(d), "mean_us": 1e6 * sum(d) / len(d)}
                          for label, d in self.parts.items() if d}}
