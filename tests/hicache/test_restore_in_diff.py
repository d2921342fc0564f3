"""`diff` and `report` read what restore verification writes: a HiCache load that wrote
pages differing from their backup is printed with its pool, host rows and cells, listed
in the JSON, and makes `diff` exit 1, on both engines (the record as the real probe
emits it on SGLang's real pools, written by the real room-log writer)."""

from __future__ import annotations

import json

import pytest

from dsv4_idxk_probe.cli.main import run as cli
from dsv4_idxk_probe.roomlog.writer import RoomLogWriter

from .conftest import host_row
from .test_restore_pools import backup, findings, load, settle


def prefill_log_with_a_restore_mismatch(hicache, make_pool, tmp_path):
    """Prefill's room log holding what the probe wrote for a load of a changed host row (5)."""
    env = hicache()
    pool = make_pool("fp8_indexer", "layer_first")
    backup(pool)
    host_row(pool, 5, 1)[64 * 128 + 8] ^= 0x10
    load(pool, device_rows=[3, 7])
    settle(env)
    assert findings(env)
    writer = RoomLogWriter(tmp_path / "prefill", "prefill", max_bytes=1 << 20, max_files=10)
    for record in env.records:
        assert writer.emit(record)
    writer.close()
    return tmp_path / "prefill"


@pytest.mark.parametrize("engine", ["reference", "duckdb"])
def test_diff_reports_a_restore_mismatch_and_exits_1(hicache, make_pool, tmp_path, capsys, engine):
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    logs = str(prefill_log_with_a_restore_mismatch(hicache, make_pool, tmp_path))
    status = cli(["diff", "--engine", engine, logs])
    out = capsys.readouterr().out
    assert status == 1
    assert "hicache restore: 1 load(s)" in out
    assert "pool deepseek_v4_c4_indexer" in out and "host row 5 device page 7 scale" in out

    assert cli(["diff", "--engine", engine, "--json", "-", logs]) == 1
    summary = json.loads(capsys.readouterr().out)["summary"]["hicache_restore"]
    assert summary["mismatches"] == 1
    (found,) = summary["loads"]
    assert found["mismatch_rows"] == [5] and found["cells"][0]["device_page"] == 7


def test_a_malformed_restore_record_is_a_skipped_line_naming_the_field(tmp_path, capsys):
    writer = RoomLogWriter(tmp_path / "prefill", "prefill", max_bytes=1 << 20, max_files=10)
    assert writer.emit({"v": 1, "kind": "hicache", "time": 0.0, "event": "restore_mismatch",
                        "pool": "deepseek_v4_c4_indexer", "mismatch_rows": ["five"]})
    writer.close()
    status = cli(["diff", "--engine", "reference", str(tmp_path / "prefill")])
    captured = capsys.readouterr()
    assert "restore_mismatch.mismatch_rows" in captured.out + captured.err
    assert status != 1  # nothing judged bad from a line that was skipped


def test_the_report_lists_the_restore_mismatch_cells(hicache, make_pool, tmp_path):
    logs = prefill_log_with_a_restore_mismatch(hicache, make_pool, tmp_path)
    page = tmp_path / "report.html"
    assert cli(["report", str(logs), "-o", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    assert 'id="hicache-restore"' in html and "<td>5</td><td>7</td><td>scale</td>" in html
