"""The join on DuckDB: `diff` and `report` over a fleet's logs (10^7-10^8 records, thousands of files).

Same findings as the reference join (`join.analyse`), byte for byte in `diff --json`; what
changes is where the work is done (docs/fleet.md), one module per step:

1. `scan`: every line's checksum verified in Python; a file whose lines all hold is *fast*
   (DuckDB reads it), any other is *slow* (the reference reader reads it).
2. `ingest` (`ingest_sql`): DuckDB reads the fast files and proves each line canonical;
   canonical room records become compact rows, every other line is *odd*.
3. `classify`: keys (room, attempt) judged in SQL (*clean*: all-match, or prefill only)
   and the rest (*complex*).
4. `judge`: the complex keys, slow files and odd lines through the reference `join.Joiner`.
5. `summary`, `output`, `instances`: counts, the summary's orders, the JSON stream in the
   reference's room order, the per-instance summary and coverage.

Where the install built it, `native` (`cscan.c`, `ingest_native`) does steps 1 and 2 in one
compiled pass: checksum, canonical split, fields and digest checks, compact rows into DuckDB;
without it (or with DSV4_IDXK_PROBE_FLEET_NATIVE=0) the steps above run as written.
Where it also built the room table (`ctable.c`), `table_route` replaces steps 2, 3 and 5
for the clean keys (no DuckDB): the table judges and writes them, the joiner reads the
complex keys' records (not with `--per-instance`, nor past the table's memory budget,
nor with DSV4_IDXK_PROBE_FLEET_TABLE=0).

`pipeline.analyse_fleet` runs them with progress; `filters` holds `--since/--until/
--instance`; `duck` the optional DuckDB (`available()`: the CLI falls back to the
reference join without it).
"""

from . import native, table_route
from .analysis import FleetAnalysis, FleetStats
from .duck import DEFAULT_MEMORY_LIMIT, available
from .filters import Filters
from .output import write_fleet_json
from .pipeline import analyse_fleet

__all__ = ["DEFAULT_MEMORY_LIMIT", "Filters", "native", "table_route", "FleetAnalysis", "FleetStats", "analyse_fleet", "available",
           "write_fleet_json"]
