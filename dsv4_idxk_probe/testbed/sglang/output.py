"""Inside the rig's servers: the records the oracle, the injector and the hooks write.

One append-only JSONL file per (process, kind) in the driver's output folder
(``DSV4_IDXK_RIG_OUT``), which the driver (`run`) reads back.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


class Out:
    """Append-only JSONL files of this process, one line per record, flushed."""

    def __init__(self, folder: Path, role: str):
        self._folder = folder
        self._role = role
        self._files: dict[str, Any] = {}  # opened on first record: only the scheduler writes any
        self._lock = threading.Lock()

    def write(self, kind: str, record: dict) -> None:
        with self._lock:
            f = self._files.get(kind)
            if f is None:
                self._folder.mkdir(parents=True, exist_ok=True)
                f = self._files[kind] = open(self._folder / f"{self._role}-{os.getpid()}-{kind}.jsonl", "a")
            f.write(json.dumps(record) + "\n")
            f.flush()
