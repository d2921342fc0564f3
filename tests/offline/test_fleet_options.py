"""The fleet options: time and instance filters, the per-instance summary, the fallback
without DuckDB, and the schema doc's example query (docs/fleet.md), run as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.logdata import Fault, RoomPlan, room_records

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.roomlog import encode_line

ROOT = Path(__file__).resolve().parents[2]
duckdb = pytest.importorskip("duckdb")


@pytest.fixture(autouse=True, params=["table", "native", "python"])
def line_pass(request, monkeypatch):
    """Every test on the fleet engine's three routes: native pass and room table, native
    pass and DuckDB, pure Python and DuckDB (test_fleet_native checks the native modules
    are built). `--per-instance` takes DuckDB on every route."""
    from dsv4_idxk_probe.offline.fleet import native, table_route

    monkeypatch.delenv(table_route.ENV, raising=False)
    if request.param == "python":
        monkeypatch.setenv(native.ENV, "0")
    else:
        monkeypatch.delenv(native.ENV, raising=False)
        if native.module() is None or (request.param == "table" and native.ctable is None):
            pytest.skip("the native line pass or room table is not built")
        if request.param == "native":
            monkeypatch.setenv(table_route.ENV, "0")
    return request.param


def fleet_logs(root: Path, n: int = 10, *, bad: int | None = None) -> tuple[Path, Path]:
    """Rooms 1..n: prefill on pod p-<i%2>, decode on pod d-<i%3>; room i's records at
    ts 1000 + 10 i (prefill) and 1000 + 10 i + 1.. (decode). Room `bad` mismatches at decode_finish."""
    pre, dec = [], []
    for i in range(1, n + 1):
        p, d = room_records(RoomPlan(i, fault=Fault(1, 1, 5, "decode_finish") if i == bad else None))
        for r in p:
            r["ts"], r["instance"] = 1000.0 + 10 * i, f"p-{i % 2}:1"
        for k, r in enumerate(d, 1):
            r["ts"], r["instance"] = 1000.0 + 10 * i + k, f"d-{i % 3}:7"
        pre += p
        dec += d
    (root / "p").mkdir(parents=True)
    (root / "d").mkdir(parents=True)
    (root / "p" / "prefill-a-1.000001.jsonl").write_bytes(b"".join(encode_line(r) for r in pre))
    (root / "d" / "decode-b-2.000001.jsonl").write_bytes(b"".join(encode_line(r) for r in dec))
    return root / "p", root / "d"


def diff_json(tmp_path, *args) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    status = run(["diff", *map(str, args), "--json", str(out)])
    return status, json.loads(out.read_text())


def test_since_and_until_select_rooms_by_their_decode_time(tmp_path, capsys):
    p, d = fleet_logs(tmp_path / "logs", bad=3)
    # the boundary falls between room 4 (decode at 1041..1043) and room 5 (1051..1053);
    # room 5's prefill record (ts 1050) is on the same side, room 4's prefill (1040) too
    status, report = diff_json(tmp_path, p, d, "--since", "1045")
    assert [r["room"] for r in report["rooms"]] == ["5", "6", "7", "8", "9", "10"]
    assert report["summary"]["room_verdicts"] == {"match": 6} and status == 0
    status, report = diff_json(tmp_path, p, d, "--until", "1045")
    assert [r["room"] for r in report["rooms"]] == ["1", "2", "3", "4"]
    assert report["summary"]["room_verdicts"] == {"match": 3, "mismatch": 1} and status == 1
    # a decode record after the boundary keeps its prefill record from before it: still a match
    status, report = diff_json(tmp_path, p, d, "--since", "1052", "--until", "1071.5")
    assert [r["room"] for r in report["rooms"]] == ["5", "6", "7"]
    assert report["summary"]["prefill_only_rooms"] == 0
    # ISO 8601 (UTC) is the same instant
    status, report = diff_json(tmp_path, p, d, "--since", "1970-01-01T00:17:25")
    assert [r["room"] for r in report["rooms"]] == ["5", "6", "7", "8", "9", "10"]


def test_instance_filter_and_per_instance_summary(tmp_path, capsys):
    p, d = fleet_logs(tmp_path / "logs", bad=3)
    status, report = diff_json(tmp_path, p, d, "--instance", "d-0:*", "--per-instance")
    assert [r["room"] for r in report["rooms"]] == ["3", "6", "9"] and status == 1
    rows = {(r["instance"], r["role"]): r for r in report["instances"]}
    assert rows[("d-0:7", "decode")]["rooms"] == 3
    assert rows[("d-0:7", "decode")]["room_verdicts"] == {"match": 2, "mismatch": 1}
    assert rows[("d-0:7", "decode")]["records"] == 9
    assert rows[("p-1:1", "prefill")]["room_verdicts"] == {"match": 1, "mismatch": 1}  # rooms 3 and 9
    out = capsys.readouterr().out
    assert "per instance" in out and "d-0:7" in out
    status, report = diff_json(tmp_path, p, d, "--per-instance")
    totals = {}
    for r in report["instances"]:
        totals[r["role"]] = totals.get(r["role"], 0) + r["rooms"]
    assert totals == {"prefill": 10, "decode": 10}


def test_fleet_options_need_duckdb_and_the_reference_runs_without_it(tmp_path):
    p, d = fleet_logs(tmp_path / "logs")
    hide = "import sys; sys.modules['duckdb'] = None; from dsv4_idxk_probe.cli.main import run; sys.exit(run(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", hide, "diff", str(p), str(d), "--engine", "duckdb"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0
    assert "DuckDB is not installed" in proc.stderr and "using the reference join" in proc.stderr
    proc = subprocess.run([sys.executable, "-c", hide, "diff", str(p), str(d), "--since", "1045"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "--since need DuckDB" in proc.stderr


def test_report_runs_on_the_fleet_engine(tmp_path, capsys):
    p, d = fleet_logs(tmp_path / "logs", bad=3)
    out = tmp_path / "r.html"
    assert run(["report", str(p), str(d), "-o", str(out), "--engine", "duckdb"]) == 0
    page = out.read_text()
    assert "room 3 attempt 0" in page and "Corrupt rooms over time, per instance" in page
    assert "(10 rooms, 1 not matching)" in capsys.readouterr().out


# %% the schema doc's example query


def doc_query() -> str:
    text = (ROOT / "docs" / "fleet.md").read_text()
    match = re.search(r"```sql duckdb\n(.*?)```", text, re.S)
    assert match, "docs/fleet.md has the DuckDB version of the example query"
    return match.group(1)


def test_the_documented_example_query_finds_the_changed_room(tmp_path):
    p, d = fleet_logs(tmp_path / "logs", bad=7)
    con = duckdb.connect()
    sql = doc_query().replace("'logs/**/*.jsonl*'", f"'{tmp_path / 'logs'}/**/*.jsonl*'")
    rows = con.execute(sql).fetchall()
    cols = [c[0] for c in con.description]
    found = [dict(zip(cols, r)) for r in rows]
    assert [(r["room"], r["attempt"], r["stage"]) for r in found] == [("7", 0, "decode_finish")]
    assert found[0]["prefill_instance"] == "p-1:1" and found[0]["decode_instance"] == "d-1:7"
    # and it sees nothing in logs where every digest matches
    clean = tmp_path / "clean"
    fleet_logs(clean)
    assert con.execute(doc_query().replace("'logs/**/*.jsonl*'", f"'{clean}/**/*.jsonl*'")).fetchall() == []


def test_a_url_without_httpfs_is_bad_input_naming_the_extension(tmp_path, capsys):
    # no network here: DuckDB is told never to download the extension, so this fails at once
    assert run(["diff", "s3://probe-logs/2026-12-03/*.jsonl.gz", "--engine", "duckdb"]) == 2
    err = capsys.readouterr().err
    assert "httpfs" in err and "Traceback" not in err
    p, d = fleet_logs(tmp_path / "logs")
    assert run(["diff", str(p), "s3://probe-logs/x.jsonl", "--engine", "reference"]) == 2
    assert "URLs need the DuckDB engine" in capsys.readouterr().err


def test_fetched_urls_are_named_by_their_url_everywhere(tmp_path, capsys, monkeypatch):
    """The URL route without a network: `remote`'s listing and copying stand in; the
    analysis must name the URLs, never the local copies."""
    from dsv4_idxk_probe.offline import remote

    p, d = fleet_logs(tmp_path / "logs", bad=4)
    files = {"s3://b/day/prefill-a-1.000001.jsonl": next(p.iterdir()), "s3://b/day/decode-b-2.000001.jsonl": next(d.iterdir())}
    monkeypatch.setattr(remote, "expand_urls", lambda args: sorted(files))

    def fetch(urls, folder):
        folder.mkdir(parents=True, exist_ok=True)
        out = []
        for i, url in enumerate(urls):
            local = folder / f"{i}.jsonl"
            local.write_bytes(files[url].read_bytes())
            out.append((local, url))
        return out

    monkeypatch.setattr(remote, "fetch", fetch)
    out = tmp_path / "o.json"
    assert run(["diff", "s3://b/day/*.jsonl", "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["inputs"] == sorted(files)
    wheres = {s["where"].rsplit(":", 1)[0] for r in report["rooms"] for s in r["stages"]}
    assert wheres == {"s3://b/day/decode-b-2.000001.jsonl"}
    assert [r["room"] for r in report["rooms"] if r["verdict"] == "mismatch"] == ["4"]


def test_the_reference_join_says_it_is_still_reading_when_it_runs_long(monkeypatch, capsys):
    """A reference join over minutes of logs is not silent (issue: no progress over 474 MB)."""
    import argparse
    import time

    from dsv4_idxk_probe.offline import engine

    monkeypatch.setattr(engine, "_heartbeat", _fast(engine._heartbeat))

    def slow(paths):
        time.sleep(0.35)
        return "analysis"

    args = argparse.Namespace(engine="reference", since=None, until=None, instance=None, per_instance=False)
    assert engine.run([], args, "dsv4-idxk-probe diff:", reference=slow) == "analysis"
    assert "reference join: still reading" in capsys.readouterr().err


def _fast(heartbeat):
    def quick(prefix, what):
        return heartbeat(prefix, what, first_s=0.05, every_s=0.1)
    return quick


def test_per_instance_keeps_two_clusters_rooms_apart(tmp_path):
    """Room ids are numbered per cluster: with `cluster` on the records, east's and west's
    rooms 1 and 2 are four rooms, and only west's pods see west's mismatch (the summary
    once joined on (room, attempt) and gave every pod all four rooms and the mismatch)."""
    pre, dec = [], []
    for cluster in ("east", "west"):
        for i in (1, 2):
            bad = cluster == "west" and i == 2
            p, d = room_records(RoomPlan(i, fault=Fault(1, 1, 5, "decode_finish") if bad else None))
            for r in p:
                r["cluster"], r["instance"] = cluster, f"p-{cluster}:1"
            for r in d:
                r["cluster"], r["instance"] = cluster, f"d-{cluster}:1"
            pre += p
            dec += d
    p3, d3 = room_records(RoomPlan(3))  # a room of no cluster, judged in SQL where it can be
    (tmp_path / "prefill-a-1.000001.jsonl").write_bytes(b"".join(encode_line(r) for r in pre + p3))
    (tmp_path / "decode-b-1.000001.jsonl").write_bytes(b"".join(encode_line(r) for r in dec + d3))
    status, report = diff_json(tmp_path, tmp_path / "prefill-a-1.000001.jsonl",
                               tmp_path / "decode-b-1.000001.jsonl", "--per-instance")
    assert status == 1
    rows = {(r["instance"], r["role"]): (r["records"], r["rooms"], r["room_verdicts"]) for r in report["instances"]}
    per_room = len(dec) // 4
    assert rows[("p-east:1", "prefill")] == (2, 2, {"match": 2})
    assert rows[("p-west:1", "prefill")] == (2, 2, {"match": 1, "mismatch": 1})
    assert rows[("d-east:1", "decode")] == (2 * per_room, 2, {"match": 2})
    assert rows[("d-west:1", "decode")] == (2 * per_room, 2, {"match": 1, "mismatch": 1})


@pytest.mark.parametrize("option, value, message", [
    ("--memory-limit", "garbage", "'garbage' is not a size (such as 512MB or 4GiB)"),
    ("--memory-limit", "1KB", "'1KB' is below 64MB, too little for the join"),
    ("--threads", "-1", "'-1' is not between 1 and 1024"),
    ("--threads", "100000", "'100000' is not between 1 and 1024"),
    ("--temp-dir", "/nonexistent-folder", "'/nonexistent-folder' is not a folder"),
])
def test_bad_fleet_options_are_refused_before_the_run(tmp_path, capsys, option, value, message):
    """Each was an internal error (exit 3) once DuckDB met it, leaving its temp folder
    behind; 100,000 threads ran for minutes on a small input (found by review)."""
    with pytest.raises(SystemExit) as exited:
        run(["diff", str(tmp_path), "--per-instance", option, value])
    assert exited.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err
