"""Live progress of a rig run: a `rich` bar on a terminal, plain lines otherwise.

`rich` draws the bar because it redraws one line in place and degrades by
itself; it comes with SGLang's own dependencies. When it is missing, or
stdout is not a terminal (CI logs, pipes), one plain line is printed every
few seconds instead, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_PLAIN_EVERY_S = 2.0


class RigProgress:
    """Feed it the rig's events (`on_event`); use as a context manager."""

    def __init__(self, total_rooms: int, stream: TextIO | None = None, *, plain: bool | None = None):
        self.total = total_rooms
        self.stream = stream or sys.stdout
        self.counts = {"sent": 0, "received": 0, "finished": 0, "skipped": 0, "fault": 0, "corrupt": 0}
        self.started = time.monotonic()
        self._last_line = 0.0
        self._rich = None
        if plain is None:
            plain = not self.stream.isatty()
        if not plain:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                plain = True
            else:
                self._rich = Progress(
                    TextColumn("rooms verified"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[detail]}"), console=Console(file=self.stream), transient=False,
                )
        self._task = None

    def __enter__(self) -> "RigProgress":
        if self._rich is not None:
            self._rich.start()
            self._task = self._rich.add_task("rig", total=self.total, detail="starting prefill and decode...")
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._update(force=True)
            self._rich.stop()
        else:
            self._line(force=True)

    def on_event(self, event: tuple) -> None:
        kind = event[0]
        if kind in ("sent", "received", "finished", "skipped"):
            self.counts[kind] += 1
        elif kind == "fault" and event[2].get("applied"):
            self.counts["fault"] += 1
        elif kind == "oracle" and event[2]["cells"] and event[2]["stage"] == "decode_finish":
            self.counts["corrupt"] += 1
        elif kind == "killed":
            self.write(f"decode killed after {self.counts['finished']} rooms (as asked)")
        if self._rich is not None:
            self._update()
        else:
            self._line()

    def write(self, text: str) -> None:
        if self._rich is not None:
            self._rich.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def _detail(self) -> str:
        c = self.counts
        return (f"sent {c['sent']}  received {c['received']}  faults applied {c['fault']}  "
                f"rooms left corrupt {c['corrupt']}" + (f"  skipped {c['skipped']}" if c["skipped"] else ""))

    def _update(self, force: bool = False) -> None:
        self._rich.update(self._task, completed=self.counts["finished"] + self.counts["skipped"], detail=self._detail())

    def _line(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_line < _PLAIN_EVERY_S:
            return
        self._last_line = now
        done = self.counts["finished"] + self.counts["skipped"]
        print(f"[{now - self.started:6.1f}s] rooms verified {done}/{self.total}  {self._detail()}", file=self.stream, flush=True)
