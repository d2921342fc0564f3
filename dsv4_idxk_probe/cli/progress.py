"""Progress on stderr for any command step that can run longer than about two seconds.

An operator watching `check` import SGLang (15-24 s) or `diff` read a day of logs must
see that something is happening, and stdout must stay clean for `--json -` and pipes.
So every line goes to stderr and starts with the command's prefix:

    with Progress("check") as progress:
        with progress.step("importing SGLang"):      # a heartbeat while it blocks
            import_everything()
        for i, path in enumerate(files):
            progress.count(i + 1, len(files), "files")  # rate-limited

On a terminal one line is rewritten in place; otherwise (a pipe, `kubectl exec`
without -t, CI) a plain line is printed at most every `every_s` seconds. A step that
ends within `quiet_s` prints nothing at all, so fast runs stay as terse as before.
Nothing here raises: a closed stderr costs the progress, never the command.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterator

#: No line at all for work that ends sooner than this.
QUIET_S = 2.0
#: Plain (non-terminal) lines at most this often.
PLAIN_EVERY_S = 10.0
#: A terminal line is redrawn at most this often.
TTY_EVERY_S = 0.5


class Progress:
    """Progress lines for one command; see the module docstring."""

    def __init__(self, command: str, stream: IO[str] | None = None, *, enabled: bool = True,
                 quiet_s: float | None = None, every_s: float | None = None, width: int = 100) -> None:
        self.prefix = f"dsv4-idxk-probe {command}:"
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.quiet_s = QUIET_S if quiet_s is None else quiet_s
        self.tty = _isatty(self.stream)
        self.every_s = every_s if every_s is not None else (TTY_EVERY_S if self.tty else PLAIN_EVERY_S)
        self.width = width
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._last = -math.inf  # not 0.0: the monotonic clock starts near 0 at boot, and the first line must show
        self._open_line = False  # a terminal line waits for its end
        self._printed = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # %% what commands call

    @contextmanager
    def step(self, text: str) -> Iterator[None]:
        """A blocking step: after `quiet_s`, '<text> ... N s' (redrawn or repeated) until it
        ends, then '<text>: done in N s'. Silent when it ends sooner."""
        start = time.monotonic()
        stop = threading.Event()

        def beat() -> None:
            if stop.wait(self.quiet_s):
                return
            while not stop.is_set():
                self._show(f"{text} ... {time.monotonic() - start:.0f} s", force=True)
                stop.wait(self.every_s if not self.tty else 1.0)

        thread = threading.Thread(target=beat, name="dsv4-idxk-probe-progress", daemon=True)
        if self.enabled:
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if self.enabled:
                thread.join(timeout=1.0)
                elapsed = time.monotonic() - start
                if elapsed >= self.quiet_s:
                    self._show(f"{text}: done in {elapsed:.1f} s", force=True, final=True)

    def count(self, done: int, total: int | None = None, unit: str = "", what: str = "") -> None:
        """`done` of `total` units (total None: unknown), shown once the command has run
        `quiet_s`, then at most every `every_s`; the last one (done == total) always shows
        once anything was shown."""
        if not self.enabled:
            return
        now = time.monotonic()
        finished = total is not None and done >= total
        if now - self._started < self.quiet_s and not (finished and self._printed):
            return
        of = f"/{total:,}" if total is not None else ""
        pct = f" ({100 * done / total:.0f}%)" if total else ""
        label = f"{what}: " if what else ""
        self._show(f"{label}{done:,}{of} {unit}{pct}".rstrip(), force=finished, final=finished)

    def note(self, text: str) -> None:
        """One line now, whatever the time (a phase change worth telling)."""
        if self.enabled:
            self._show(text, force=True, final=True)

    def close(self) -> None:
        """End a terminal line left open, so the next output starts on its own line."""
        with self._lock:
            if self._open_line:
                self._write("\n")
                self._open_line = False

    # %% drawing

    def _show(self, text: str, *, force: bool = False, final: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last < self.every_s:
                return
            self._last = now
            line = f"{self.prefix} {text}"[: self.width - 1]
            if self.tty:
                self._write(f"\r\x1b[2K{line}" + ("\n" if final else ""))
                self._open_line = not final
            else:
                self._write(line + "\n")
            self._printed = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
