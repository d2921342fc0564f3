"""DuckDB, the optional engine: whether it is installed, the working connection, bulk inserts."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import numpy as np

DEFAULT_MEMORY_LIMIT = "1GB"


def available() -> bool:
    """Whether DuckDB is installed (the `fleet` extra), found without importing it: the
    import costs ~0.1 s, which the room table's route (no DuckDB) need not pay."""
    try:
        return importlib.util.find_spec("duckdb") is not None
    except (ImportError, ValueError):  # a module hidden as None, or a broken one
        return False


def connect(memory_limit: str, threads: int | None, temp_dir: str | None):
    """A DuckDB database in a fresh working folder under `temp_dir` (spill files beside it);
    returns (connection, folder). The caller removes the folder."""
    import duckdb

    workdir = tempfile.mkdtemp(prefix="dsv4-fleet-", dir=temp_dir)
    config = {"memory_limit": memory_limit, "temp_directory": os.path.join(workdir, "spill"),
              "preserve_insertion_order": False}
    if threads:
        config["threads"] = int(threads)
    con = duckdb.connect(os.path.join(workdir, "fleet.duckdb"), config=config)
    return con, workdir


def insert_rows(con, table: str, columns: tuple[str, ...], rows: list) -> None:
    """Rows into `table` through one registered NumPy frame (executemany costs ~50 us a row)."""
    if not rows:
        return
    frame = {name: np.array([r[i] for r in rows], dtype=object) for i, name in enumerate(columns)}
    con.register("rows_in", frame)
    try:
        cast = ", ".join(f"rows_in.{c}" for c in columns)
        con.execute(f"INSERT INTO {table} SELECT {cast} FROM rows_in").fetchall()
    finally:
        con.unregister("rows_in")
