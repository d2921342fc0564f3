"""What the bench scripts share: timing, call counting, pairing, plain-text tables, result files.

Standard library only at import time (numpy is imported where a percentile
needs it), so a script that must set up its process first (TRITON_INTERPRET,
stand-in modules) can import this before anything else.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

#: The repository root: where `python -m bench.NAME` runs, and the cwd / PYTHONPATH of child processes.
REPO = Path(__file__).resolve().parents[1]

NAN = float("nan")


# %% statistics


def median(values: Iterable[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    return statistics.median(values)


def median_us(seconds: Iterable[float]) -> float:
    """The median of samples in seconds, in microseconds."""
    return 1e6 * statistics.median(seconds)


def percentile(values, q: float) -> float:
    """The q-th percentile (numpy's linear interpolation); NaN for no values."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else NAN


def percentiles(values, qs: Iterable[int] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} of `values`."""
    return {f"p{q}": percentile(values, q) for q in qs}


# %% timing


def per_call_us(fn: Callable[[], Any], calls: int, *, chunks: int = 1, clock: Callable[[], float] = time.perf_counter) -> float:
    """Microseconds per call of `fn` by `clock` (seconds): `calls // chunks` calls per chunk
    (at least one), the median over `chunks` chunks (one chunk: the mean over `calls` calls).
    `clock=time.thread_time` measures the calling thread's CPU time."""
    chunk = max(1, calls // chunks)
    samples = []
    for _ in range(chunks):
        started = clock()
        for _ in range(chunk):
            fn()
        samples.append((clock() - started) / chunk * 1e6)
    return statistics.median(samples)


class PartTimer:
    """Adds the time spent in wrapped functions, by `clock` (seconds), to named totals."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = {}

    def timed(self, fn: Callable, label: str) -> Callable:
        """`fn`, adding the time each call takes to `totals[label]`."""
        clock = self.clock

        def timed(*args, **kwargs):
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + clock() - started

        return timed

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Replace `owner.name` by its timed version."""
        setattr(owner, name, self.timed(getattr(owner, name), label))


class CallCounter:
    """Counts, on the thread it is set on, Python functions entered and C functions called
    (as a profile function: `sys.setprofile(counter)`) and bytecodes executed (as a trace
    function: `sys.settrace(counter.trace)`)."""

    def __init__(self):
        self.calls = self.c_calls = self.opcodes = 0

    def __call__(self, frame, event, arg):
        if event == "call":
            self.calls += 1
        elif event == "c_call":
            self.c_calls += 1

    def trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.opcodes += 1
        return self.trace

    def count(self, make: Callable[[], Callable[[], Any]]) -> dict[str, int]:
        """Counts one call made by `make()` with the profiler, then another with the tracer
        (they cannot run together); `make` sets up each call outside the count."""
        self.calls = self.c_calls = self.opcodes = 0
        call = make()
        sys.setprofile(self)
        try:
            call()
        finally:
            sys.setprofile(None)
        calls, c_calls = self.calls, self.c_calls
        call = make()
        sys.settrace(self.trace)
        try:
            call()
        finally:
            sys.settrace(None)
        return {"python_calls": calls, "c_calls": c_calls, "opcodes": self.opcodes}


# %% pairing


def ratio(value: float, base: float) -> float:
    """value / base; NaN when base is not positive."""
    return value / base if base > 0 else NAN


def paired_ratios(runs: dict[str, list[dict]], key: str, base: str) -> dict[str, dict]:
    """For interleaved runs ({variant: [one sample per repetition]}): each variant's ratio of
    `key` to the base variant's in the same repetition, their median, min and max, and the
    ratio of the two medians."""
    out = {}
    for variant, samples in runs.items():
        if variant == base:
            continue
        per_pair = [s[key] / b[key] for s, b in zip(samples, runs[base]) if b[key] > 0]
        out[variant] = {
            "per_pair": per_pair,
            "median": statistics.median(per_pair) if per_pair else NAN,
            "min": min(per_pair, default=NAN),
            "max": max(per_pair, default=NAN),
            "ratio_of_medians": statistics.median(s[key] for s in samples) / statistics.median(b[key] for b in runs[base]),
        }
    return out


# %% plain-text tables

_SPEC = re.compile(r"^(?:(.)?([<>^=]))?(\d*)")  # [[fill]align][width]...


class Table:
    """Columns of a plain-text table, each (title, format spec): a row is the values
    formatted by their specs, the header the titles at the specs' widths (left-aligned
    where the spec says "<", centred for "^", else right), both joined by one space."""

    def __init__(self, *columns: tuple[str, str]):
        self.columns = columns

    def header(self) -> str:
        cells = []
        for title, spec in self.columns:
            _, align, width = _SPEC.match(spec).groups()
            cells.append(format(title, (align if align in ("<", "^") else ">") + width))
        return " ".join(cells)

    def row(self, *values: Any) -> str:
        return " ".join(format(value, spec) for value, (_, spec) in zip(values, self.columns, strict=True))


# %% results


def write_json(path: Path | str, data: Any, *, indent: int = 1, default: Callable | None = None) -> Path:
    """Write `data` as JSON to `path`, its folder made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=default))
    return path


def write_result(out_dir: Path | str, name: str, data: Any, **kwargs) -> Path:
    """Write a script's result file `name` under `out_dir` (made if missing); see write_json."""
    return write_json(Path(out_dir) / name, data, **kwargs)


def command_line(name: str, argv: list[str] | None = None) -> str:
    """How this run of bench script `name` was invoked, for its report."""
    args = sys.argv[1:] if argv is None else argv
    return f"python3 -m bench.{name}" + (f" {shlex.join(args)}" if args else "")


def module_command(name: str, *args: str) -> list[str]:
    """The command line of bench script `name` in a child process (run it with cwd=REPO)."""
    return [sys.executable, "-m", f"bench.{name}", *args]
