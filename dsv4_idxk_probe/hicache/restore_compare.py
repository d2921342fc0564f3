"""Compare what a load wrote into device pages with what the backup read: plain data.

For each host row of a load: the kept digests of the row's backup (uint64 [layers,
segments], or None when none is kept) against the content digests of the device
page the load wrote it into (taken after the load, in its stream order). Each
(layer, segment) that differs is a cell: (pool layer, host row, device page,
segment). A row without a kept digest is not verified (`digest_lost`). No torch,
no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class RestoreCell:
    """One (layer, segment) of one loaded host row that differs from its backup."""

    pool_layer: int
    host_row: int
    device_page: int
    segment: str


@dataclass
class LoadComparison:
    rows: int = 0  # host rows in the load
    verified_rows: int = 0  # rows compared (a kept digest): matching or not
    mismatch_rows: list[int] = field(default_factory=list)  # host rows with at least one differing cell
    unverified_rows: list[int] = field(default_factory=list)  # host rows without a kept digest
    cells: list[RestoreCell] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """The load's verdict, as a room's: mismatch over unverified over match."""
        if self.mismatch_rows:
            return "mismatch"
        if self.unverified_rows or not self.rows:
            return "unverified"
        return "match"


def compare_load(expected: Sequence[np.ndarray | None], actual: np.ndarray, host_rows: Sequence[int],
                 device_pages: Sequence[int] | None, segments: Sequence[str]) -> LoadComparison:
    """`actual`: uint64 [layers, pages, segments], page j the device page of host row j.
    `device_pages` None: not read (a caller reads them only once a row differs); the cells
    then name device page -1."""
    n = len(host_rows)
    if device_pages is None:
        device_pages = [-1] * n
    if actual.ndim != 3 or actual.shape[1] != n or len(expected) != n or len(device_pages) != n:
        raise ValueError(f"a load of {n} host rows needs {n} kept entries, device pages and digests "
                         f"[layers, {n}, segments]; got {len(expected)}, {len(device_pages)}, {actual.shape}")
    if actual.shape[2] != len(segments):
        raise ValueError(f"{actual.shape[2]} segments digested, {len(segments)} named")
    out = LoadComparison(rows=n)
    for j, (want, row, page) in enumerate(zip(expected, host_rows, device_pages)):
        if want is None:
            out.unverified_rows.append(int(row))
            continue
        got = actual[:, j, :]
        if want.shape != got.shape:  # another layout or layer count since the backup
            out.unverified_rows.append(int(row))
            continue
        out.verified_rows += 1
        differs = np.argwhere(want != got)
        if differs.size:
            out.mismatch_rows.append(int(row))
            out.cells.extend(RestoreCell(int(layer), int(row), int(page), str(segments[seg])) for layer, seg in differs)
    return out


def row_bytes_split(comparison: LoadComparison, row_bytes: int, layers: int) -> tuple[int, int]:
    """(verified, unverified) index-K bytes of the load: each host row moves `layers` rows."""
    per_row = int(row_bytes) * int(layers)
    return comparison.verified_rows * per_row, len(comparison.unverified_rows) * per_row
