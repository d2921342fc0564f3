"""Round-trip mode: follow each host row through backup, residence and load.

A debugging mode (off by default): it reads index values and rows back to the
host and synchronises the current (copy) stream, so it slows the copies.

Each (pool, host row, layer) cell is digested three times with the project's
row digest (digest/reference.py, one segment spanning the whole row):

* at backup, the device rows before the copy and the host rows after it;
  a difference blames the **device-to-host copy** (leg ``d2h``);
* at each per-layer load, the host rows before the copy against the digest
  kept since backup; a difference blames **host memory while resident**
  (leg ``host``); a row with no kept digest is ``unverified``;
* after the load, the device rows against the host rows; a difference blames
  the **host-to-device copy** (leg ``h2d``).

A write into a host page by the storage tier (L3) drops that page's digests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..digest.layout import RowLayout, Segment
from ..digest.reference import segment_digests
from .legs import LEG_NAMES, LEGS, VERDICTS  # noqa: F401  (re-exported: hicache.LEGS)



@dataclass(frozen=True)
class RowViews:
    """How to see one layer of a pool's rows, as 2-D uint8 tensors [rows, item_bytes]."""

    host_layer: Callable[[int], torch.Tensor]
    device_layer: Callable[[int], torch.Tensor]


def page_rows(indices: torch.Tensor, page_size: int) -> list[int]:
    """Row number of each page group, as the pool computes it (synchronises)."""
    return (indices.reshape(-1, page_size)[:, 0] // page_size).cpu().tolist()


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


class _Digester:
    """Whole-row digests with the project's definition, for one row size."""

    def __init__(self, item_bytes: int):
        self.item_bytes = item_bytes
        self.padded = -(-item_bytes // 4) * 4
        seg = Segment("row", 0, self.padded)
        self.layout = RowLayout(f"hicache-row-{item_bytes}", 1, 1, (seg,), self.padded)

    def __call__(self, layer_rows: torch.Tensor, rows: list[int]) -> list[int]:
        if not rows:
            return []
        index = torch.tensor(rows, dtype=torch.int64, device=layer_rows.device)
        data = layer_rows.index_select(0, index).cpu().numpy()
        if self.padded != data.shape[1]:
            data = np.pad(data, ((0, 0), (0, self.padded - data.shape[1])))
        return segment_digests(data, np.ones(len(rows), np.int64), self.layout)[:, 0].tolist()


class RoundTrip:
    """The digest table and the three comparisons."""

    def __init__(
        self,
        report: Callable[[Any, str, dict[str, int], list[dict]], None],
        on_evict: Callable[[int], None],
        max_entries: int = 1_000_000,
    ):
        self._report = report
        self._on_evict = on_evict
        self._max = max_entries
        self._table: dict[tuple[int, int, int], int] = {}
        # (pool, host row, layer) -> the d2h verdict of the backup that stored it, so a
        # load can say whether the row it reads matched when it was backed up
        self._at_backup: dict[tuple[int, int, int], str] = {}
        self._lock = threading.Lock()
        self._digesters: dict[int, _Digester] = {}

    def _digester(self, item_bytes: int) -> _Digester:
        if item_bytes not in self._digesters:
            self._digesters[item_bytes] = _Digester(item_bytes)
        return self._digesters[item_bytes]

    def _compare(self, pool, leg: str, expected: list, actual: list, cells: list[tuple[int, int, int]]) -> None:
        counts = dict.fromkeys(VERDICTS, 0)
        bad = []
        for want, got, (host_row, device_row, layer) in zip(expected, actual, cells):
            verdict = "unverified" if want is None else ("match" if want == got else "mismatch")
            counts[verdict] += 1
            if verdict == "mismatch":
                bad.append({"host_row": host_row, "device_row": device_row, "layer": layer})
        self._report(pool, leg, counts, bad)

    def _store(self, key: tuple[int, int, int], value: int, at_backup: str = "unverified") -> None:
        with self._lock:
            self._table.pop(key, None)
            self._table[key] = value
            self._at_backup[key] = at_backup
            evicted = 0
            while len(self._table) > self._max:
                self._at_backup.pop(gone := next(iter(self._table)), None)
                self._table.pop(gone)
                evicted += 1
        if evicted:
            self._on_evict(evicted)

    # -- backup -------------------------------------------------------------------

    def before_backup(self, pool, host_indices: torch.Tensor, device_indices: torch.Tensor):
        host_rows = page_rows(host_indices, pool.geom.page_size)
        device_rows = page_rows(device_indices, pool.geom.page_size)
        digest = self._digester(pool.geom.item_bytes)
        device = [digest(pool.views.device_layer(layer), device_rows) for layer in range(pool.geom.layers)]
        return host_rows, device_rows, device

    def after_backup(self, pool, context) -> None:
        host_rows, device_rows, device = context
        if pool.geom.layers:
            _sync(pool.views.device_layer(0))
        digest = self._digester(pool.geom.item_bytes)
        for layer in range(pool.geom.layers):
            host = digest(pool.views.host_layer(layer), host_rows)
            cells = [(h, d, layer) for h, d in zip(host_rows, device_rows)]
            self._compare(pool, "d2h", device[layer], host, cells)
            for host_row, value, want in zip(host_rows, host, device[layer]):
                self._store((pool.key, host_row, layer), value, "match" if want == value else "mismatch")

    # -- load ---------------------------------------------------------------------

    def before_load(self, pool, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int):
        host_rows = page_rows(host_indices, pool.geom.page_size)
        device_rows = page_rows(device_indices, pool.geom.page_size)
        host = self._digester(pool.geom.item_bytes)(pool.views.host_layer(layer), host_rows)
        with self._lock:
            kept = [self._table.get((pool.key, row, layer)) for row in host_rows]
            at_backup = [self._at_backup.get((pool.key, row, layer), "unverified") for row in host_rows]
        cells = [(h, d, layer) for h, d in zip(host_rows, device_rows)]
        self._compare(pool, "host", kept, host, cells)
        return host_rows, device_rows, layer, host, kept, at_backup

    def after_load(self, pool, context) -> dict[int, dict[str, str]]:
        """The h2d comparison; returns, per host row, what each leg found for this layer
        (the page journal shows it beside the load: docs/diagnosis.md)."""
        host_rows, device_rows, layer, host, kept, at_backup = context
        layer_rows = pool.views.device_layer(layer)
        _sync(layer_rows)
        device = self._digester(pool.geom.item_bytes)(layer_rows, device_rows)
        self._compare(pool, "h2d", host, device, [(h, d, layer) for h, d in zip(host_rows, device_rows)])
        return {
            row: {"d2h": backed, "host": "unverified" if want is None else ("match" if want == now else "mismatch"),
                  "h2d": "match" if now == landed else "mismatch"}
            for row, backed, want, now, landed in zip(host_rows, at_backup, kept, host, device)
        }

    # -- host writes from elsewhere -----------------------------------------------

    def invalidate(self, pool, host_rows: list[int]) -> int:
        """Forget the kept digests of these host rows (all layers)."""
        dropped = 0
        with self._lock:
            for row in host_rows:
                for layer in range(pool.geom.layers):
                    dropped += self._table.pop((pool.key, row, layer), None) is not None
                    self._at_backup.pop((pool.key, row, layer), None)
        return dropped

    def __len__(self) -> int:
        return len(self._table)
