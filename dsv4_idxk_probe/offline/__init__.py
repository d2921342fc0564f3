"""Offline analysis of room logs, for `dsv4-idxk-probe diff` and `report`.

Reads plain records only, never torch or SGLang, so the log tools run on a
laptop (tests/architecture checks it). One job per module:

- `validation`: the checks a record read from a log must pass (RecordError);
- `packed`: a digest packed into bytes, cheap to keep and to compare;
- `results`: the judged stages, rooms and summary that the tools read;
- `join`: `analyse`, the reference join: prefill and decode by (room, attempt[, cluster]), judged;
- `engine`: which join runs (`--engine auto|duckdb|reference`) and the options they share;
- `fleet`: the DuckDB join for a fleet's logs: clean rooms judged in SQL, the rest by `join`;
- `remote`: inputs named by URL (`s3://...`), fetched through DuckDB's httpfs;
- `printable`: what reaches a terminal or a page, with control and bidi characters escaped;
- `diff_output`: the diff's exit status and JSON document;
- `report_html`: the HTML report page.

The log line format, writer and reader stay in `roomlog/`.
"""
