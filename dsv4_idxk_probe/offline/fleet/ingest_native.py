"""Into DuckDB from the native pass: the compact rows of a batch of fast files become
`rec` rows through one registered NumPy frame; odd lines go to the Python join as on
the pure-Python path (`ingest.note_odd_lines`). The batch's columns are dropped after.
"""

from __future__ import annotations

import numpy as np

from ...vocabulary import STAGES, VERDICTS
from ..diff_output import json_bytes
from .ingest import note_odd_lines
from .positions import LINE_BITS
from .scan import FileScan

_NUMERIC = {"line": np.int64, "attempt": np.int64, "step": np.int64, "ts": np.float64, "tokens": np.int64,
            "cells": np.int64, "dh": np.uint64, "flags": np.uint8, "stage": np.int8, "live": np.int8}
_TEXT = ("room", "instance", "layout", "rid")
_NULL = -(1 << 63)  # the pass's null for integers

_stage_list = "[" + ",".join(f"'{s}'" for s in STAGES) + "]"
_verdict_list = "[" + ",".join(f"'{v}'" for v in VERDICTS) + "]"

INSERT = f"""
INSERT INTO rec SELECT fid, (fid::BIGINT << {LINE_BITS}) | line, room, attempt, {_stage_list}[stage + 1],
       nullif(step, {_NULL}), CASE WHEN isnan(ts) THEN NULL ELSE ts END,
       CASE WHEN live >= 0 THEN {_verdict_list}[live + 1] END, rid, nullif(tokens, {_NULL}),
       CASE WHEN flags & 1 = 1 THEN dh END,
       CASE WHEN flags & 1 = 1 AND stage = 0 THEN flags & 2 = 2 END,
       instance, nullif(cells, {_NULL}), layout
FROM native_rows
"""


def frame(batch: list[FileScan]) -> dict:
    """The batch's rows as one frame of columns (NumPy arrays; strings as object arrays)."""
    chunks = [(s.order, cols) for s in batch for cols in s.rows]
    out = {"fid": np.concatenate([np.full(len(c["room"]), fid, np.int32) for fid, c in chunks])}
    for name, dtype in _NUMERIC.items():
        out[name] = np.concatenate([np.frombuffer(c[name], dtype) for _, c in chunks])
    for name in _TEXT:
        column = np.empty(len(out["fid"]), dtype=object)
        at = 0
        for _, c in chunks:
            column[at:at + len(c[name])] = c[name]
            at += len(c[name])
        out[name] = column
    return out


def ingest_native_batch(con, batch: list[FileScan], stats, py_keys: set) -> None:
    """One batch of fast files the native pass read: canonical rows into `rec`, odd lines noted."""
    for s in batch:
        con.execute("INSERT INTO files VALUES (?, ?, ?, ?)", [s.order, str(s.path), s.order,
                                                              json_bytes(s.name or str(s.path)).decode()[1:-1]])
    if any(s.rows for s in batch):
        rows = frame(batch)
        stats.canonical_records += len(rows["fid"])
        con.register("native_rows", rows)
        try:
            con.execute(INSERT)
        finally:
            con.unregister("native_rows")
        del rows
    odd = [(s.order, int(line)) for s in batch for chunk in s.odd for line in chunk]
    stats.odd_lines += len(odd)
    if odd:
        note_odd_lines(con, batch, odd, py_keys)
    for s in batch:
        s.rows, s.odd = [], []  # in DuckDB now
