"""`dsv4-idxk-probe report`: one self-contained page, opened in headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from tests.support.logdata import Fault, RoomPlan, hicache_record, room_records, roundtrip_record
from PIL import Image

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.offline.report_html import HEAT
from dsv4_idxk_probe.roomlog import RoomLogWriter

CHROMIUM_TIMEOUT_S = 90


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: run .ci/install-test-services.sh (make test does)")
    return path


def browse(tmp_path, page, *args):
    """Run headless Chromium on `page` with a throwaway profile; return stdout."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, timeout=CHROMIUM_TIMEOUT_S, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def heat_pixels(png) -> int:
    want = tuple(int(HEAT[i : i + 2], 16) for i in (1, 3, 5))
    image = Image.open(png).convert("RGB")
    return sum(n for n, rgb in image.getcolors(maxcolors=1 << 20) if all(abs(a - b) <= 3 for a, b in zip(rgb, want)))


def make_report(logs, tmp_path, plans, extra_decode=()):
    prefill, decode = logs(plans, extra_decode=list(extra_decode))
    out = tmp_path / "report.html"
    assert run(["report", str(prefill), str(decode), "-o", str(out)]) == 0
    return out


def test_report_renders_heatmaps_timeline_and_hicache(logs, tmp_path):
    plans = [RoomPlan(1), RoomPlan(2, fault=Fault(3, 2, 10, "decode_step")), RoomPlan(3, prefill=False)]
    extra = [hicache_record("deepseek_v4_c4_indexer", "token_dsv4_mla"), hicache_record("deepseek_v4_c4", "page", count=9)]
    page = make_report(logs, tmp_path, plans, extra)
    html = page.read_text()
    assert not re.search(r"<(script|link|img)\b|src=|href=\"http", html), "the page must not fetch or run anything"

    dom = browse(tmp_path, page, "--dump-dom")
    heatmaps = re.findall(r'<svg class="heatmap" data-room="([^"]+)" data-stage="([^"]+)" data-cells="(\d+)"', dom)
    # One heatmap per room: the stage that first saw it; the later mismatching stage is listed.
    assert heatmaps == [("2/0", "decode_step@40", "1")]
    assert dom.count('class="cell"') == 1
    assert "decode_finish mismatch" in dom
    for section in ("summary", "bad-rooms", "cross-room", "timeline", "hicache"):
        assert f'id="{section}"' in dom
    assert re.search(r'<tr class="alarm"><td>deepseek_v4_c4_indexer</td><td>d2h</td><td>token_dsv4_mla</td>', dom)
    assert "no prefill record" in dom  # room 3, unverified

    png = tmp_path / "shot.png"
    browse(tmp_path, page, f"--screenshot={png}", "--window-size=1200,2400")
    assert heat_pixels(png) > 50, "the diverging cells are not on screen"


def test_report_lists_hicache_round_trip_diagnoses(logs, tmp_path):
    page = make_report(logs, tmp_path, [RoomPlan(1)], [roundtrip_record()])
    html = page.read_text()
    assert 'id="hicache-roundtrip"' in html and "(1 broken host row)" in html
    assert ("<tr class=alarm><td>deepseek_v4_c4_indexer</td><td>5</td><td>1</td><td>6</td>"
            "<td>match</td><td>mismatch</td><td>match</td>") in html
    assert "hicache_backup &rarr; hicache_load" in html


def test_a_clean_run_draws_no_heat(logs, tmp_path):
    page = make_report(logs, tmp_path, [RoomPlan(1), RoomPlan(2)])
    png = tmp_path / "shot.png"
    browse(tmp_path, page, f"--screenshot={png}", "--window-size=1200,1600")
    assert heat_pixels(png) == 0
    assert "every verified room matched" in page.read_text()


def test_log_content_is_escaped(tmp_path):
    prefill, decode = room_records(RoomPlan(1, fault=Fault(0, 0, 0)))
    hostile = '<img src=x onerror="document.title=1">'
    writer = RoomLogWriter(tmp_path / "logs", "decode")
    for rec in prefill + decode:
        rec["room"] = hostile
        writer.emit(rec)
    writer.close()
    out = tmp_path / "r.html"
    assert run(["report", str(tmp_path / "logs"), "-o", str(out)]) == 0
    html = out.read_text()
    assert hostile not in html and "&lt;img src=x" in html


def test_report_without_records_is_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert run(["report", str(empty), "-o", str(tmp_path / "r.html")]) == 2
    assert not (tmp_path / "r.html").exists()
    assert "no records" in capsys.readouterr().err


def test_wide_rooms_are_binned_and_say_so(tmp_path):
    """A 1500-page room: columns cover several pages, the picture stays a few hundred pixels wide."""
    import numpy as np

    from dsv4_idxk_probe.digest.result import RoomDigest
    from dsv4_idxk_probe.pd.records import room_record

    rng = np.random.default_rng(1)
    expected = RoomDigest("7/0", 1234, 1500 * 256, (0, 1), ("payload", "scale"),
                          rng.integers(0, 2**63, (2, 2), dtype=np.uint64), rng.integers(0, 2**63, 1500, dtype=np.uint64))
    observed = RoomDigest(**{**expected.__dict__, "pages": expected.pages.copy(), "layer_segment": expected.layer_segment.copy()})
    observed.pages[1234] ^= np.uint64(1)
    observed.layer_segment[1, 0] ^= np.uint64(1)
    writer = RoomLogWriter(tmp_path / "logs", "any")
    writer.emit(room_record(role="prefill", stage="prefill_send", room=7, attempt=0, digest=expected, layout="fp8"))
    writer.emit(room_record(role="decode", stage="decode_recv", room=7, attempt=0, digest=observed, layout="fp8"))
    writer.close()
    out = tmp_path / "r.html"
    assert run(["report", str(tmp_path / "logs"), "-o", str(out)]) == 0
    html = out.read_text()
    assert "each column covers 3 pages" in html and "pages [1234]" in html
    width = int(re.search(r'<svg class="heatmap"[^>]* width="(\d+)"', html).group(1))
    assert width < 1200
    assert re.search(r"<title>layer 1, page 1233-1235</title>", html)


def page_height(tmp_path, page, width: int) -> int:
    """The rendered document's height at a window `width`, read by a probe script in a copy of the page
    (the report itself runs no script)."""
    probe = tmp_path / f"measure-{width}.html"
    probe.write_text(page.read_text().replace(
        "</body>", "<script>document.body.dataset.height = document.documentElement.scrollHeight</script></body>"))
    dom = browse(tmp_path, probe, "--dump-dom", f"--window-size={width},900")
    return int(re.search(r'data-height="(\d+)"', dom).group(1))


def test_index_links_every_drawn_room_in_numeric_order(logs, tmp_path):
    rooms = [113, 12, 2, 11, 10]
    page = make_report(logs, tmp_path, [RoomPlan(r, fault=Fault(r % 3, 1, 5)) for r in rooms] + [RoomPlan(7)])
    dom = browse(tmp_path, page, "--dump-dom")
    links = re.findall(r'<a href="#(room-[^"]+)">([^<]+)</a>', dom)
    assert [name for _, name in links] == ["2/0", "10/0", "11/0", "12/0", "113/0"]
    for anchor, _ in links:
        assert f'id="{anchor}"' in dom
    assert len(re.findall(r'<svg class="heatmap"', dom)) == len(rooms)


def test_cross_room_heat_counts_rooms_per_layer_and_page_bucket(logs, tmp_path):
    # Three rooms differ in layer index 1 at page 1, one in layer index 0 at page 0 (logdata.LAYER_IDS: 0, 1, ...).
    plans = [RoomPlan(1, fault=Fault(1, 1, 3)), RoomPlan(2, fault=Fault(1, 1, 9)), RoomPlan(3, fault=Fault(1, 1, 40)),
             RoomPlan(4, fault=Fault(0, 0, 2))]
    page = make_report(logs, tmp_path, plans)
    html = page.read_text()
    cells = dict(re.findall(r'<title>layer (\d+, pages \d+)\.\.: (\d+) room\(s\)</title>', html))
    assert cells == {"1, pages 1": "3", "0, pages 0": "1"}, cells


def test_time_axis_has_readable_ticks(logs, tmp_path):
    page = make_report(logs, tmp_path, [RoomPlan(1), RoomPlan(2)])
    from dsv4_idxk_probe.offline.report_html import TIME_TICKS

    ticks = re.findall(r'<text class="tick"[^>]*>([^<]+)</text>', page.read_text())
    assert len(ticks) == TIME_TICKS + 1
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in ticks), ticks
    assert "time (UTC), from " in page.read_text()


@pytest.mark.parametrize("width, bound", [(1400, 9000), (800, 16000)])
def test_a_hundred_persistently_corrupt_rooms_keep_the_page_bounded(logs, tmp_path, width, bound):
    """Every room corrupt at receipt and at every later stage: one heatmap each (50 drawn by default),
    the index scrolls in its own box, so the page stays a few screens tall at either width."""
    plans = [RoomPlan(r, fault=Fault(r % 4, (r // 4) % 3, r)) for r in range(1, 101)]
    page = make_report(logs, tmp_path, plans)
    html = page.read_text()
    assert html.count('<svg class="heatmap"') == 50 and html.count('<a href="#room-') == 50
    height = page_height(tmp_path, page, width)
    assert 1000 < height < bound, height


# %% Reliability round two: the page's size is bounded whatever the logs hold


def _digest(layers: int, pages: int, value: int) -> dict:
    """A digest as the logs carry it: every cell and page folded to `value`."""
    h = f"{value:016x}"
    return {"key": "1/0", "signature": "00000000000004d2", "n_tokens": pages * 256, "layer_ids": list(range(layers)),
            "segments": ["payload"], "room": h, "layer_segment": [[h] for _ in range(layers)], "pages": [h] * pages}


def _wholly_corrupt(room: int, layers: int, pages: int, rid: str | None = None) -> list[dict]:
    """A room whose every layer and page differs on decode: the largest heatmap it can draw."""
    base = {"v": 1, "kind": "room", "ts": 1.7e9, "instance": "h:1", "room": str(room), "attempt": 0, "step": None,
            "layout": "fp8", "verdict": "match", "reason": "", "rid": rid}
    return [dict(base, role="prefill", stage="prefill_send", digest=_digest(layers, pages, 0)),
            dict(base, role="decode", stage="decode_recv", digest=_digest(layers, pages, room))]


def _write(path, records):
    from dsv4_idxk_probe.roomlog import encode_line

    path.write_bytes(b"".join(encode_line(r) for r in records))
    return path


@pytest.mark.parametrize("shape", ["one room of 12,000 layers x 12,000 pages", "50 rooms of 64 layers x 512 pages"])
def test_a_hostile_megabyte_of_log_makes_a_bounded_page(tmp_path, shape):
    """1 MB of log made 1.16 GB of HTML (heatmaps were never binned: one rectangle per
    red cell) and 50 wholly corrupt rooms 171 MiB. Now a heatmap is at most MAX_HEAT_ROWS x
    MAX_COLUMNS bins in at most MAX_HEAT_RECTS rectangles, and the page at most MAX_REPORT_BYTES."""
    from dsv4_idxk_probe.offline.report_html import MAX_HEAT_RECTS, MAX_REPORT_BYTES

    if shape.startswith("one"):
        records = _wholly_corrupt(1, 12_000, 12_000)
    else:
        records = [r for room in range(1, 51) for r in _wholly_corrupt(room, 64, 512)]
    log = _write(tmp_path / "log.jsonl", records)
    assert 0.9e6 < log.stat().st_size < 1.3e6
    out = tmp_path / "r.html"
    assert run(["report", str(log), "-o", str(out)]) == 0
    size = out.stat().st_size
    assert size <= MAX_REPORT_BYTES and size < 2 << 20, f"{size:,} bytes"
    html = out.read_text()
    for svg in re.findall(r'<svg class="heatmap".*?</svg>', html):
        assert svg.count('class="cell"') <= MAX_HEAT_RECTS
        assert len(re.findall(r"<text ", svg)) <= 64 + 512
    assert html.count('<svg class="heatmap"') == (1 if shape.startswith("one") else 50)


def test_alternating_cells_are_binned_coarser_not_drawn_one_by_one(tmp_path):
    """Every other layer and every other page differs: the worst case for blocks of red cells."""
    from dsv4_idxk_probe.offline.report_html import MAX_HEAT_RECTS

    prefill, decode = _wholly_corrupt(1, 64, 4096)
    decode["digest"]["layer_segment"] = [["0" * 16] if i % 2 else ["1" * 16] for i in range(64)]
    decode["digest"]["pages"] = ["0" * 16 if i % 2 else "1" * 16 for i in range(4096)]
    out = tmp_path / "r.html"
    assert run(["report", str(_write(tmp_path / "log.jsonl", [prefill, decode])), "-o", str(out)]) == 0
    html = out.read_text()
    assert 0 < html.count('class="cell"') <= MAX_HEAT_RECTS and "each column covers" in html


def test_rooms_not_drawn_are_counted_and_a_rid_draws_one(tmp_path):
    records = [r for room in range(1, 6) for r in _wholly_corrupt(room, 4, 8, rid=f"req-{room}")]
    log = _write(tmp_path / "log.jsonl", records)
    out = tmp_path / "r.html"
    assert run(["report", str(log), "-o", str(out), "--max-rooms", "2"]) == 0
    html = out.read_text()
    assert html.count('<svg class="heatmap"') == 2
    assert "3 not drawn" in html and "report --rid RID" in html
    assert run(["report", str(log), "-o", str(out), "--max-rooms", "2", "--rid", "req-5"]) == 0
    drawn = re.findall(r'<svg class="heatmap" data-room="([^"]+)"', out.read_text())
    assert drawn == ["5/0"]
    assert run(["report", str(log), "-o", str(out), "--rid", "no-such-rid"]) == 2


def test_the_page_stops_drawing_rooms_at_its_size_cap(tmp_path, monkeypatch):
    from dsv4_idxk_probe.offline import report_html

    monkeypatch.setattr(report_html, "MAX_REPORT_BYTES", 120_000)
    records = [r for room in range(1, 41) for r in _wholly_corrupt(room, 16, 64, rid=f"req-{room}")]
    out = tmp_path / "r.html"
    assert run(["report", str(_write(tmp_path / "log.jsonl", records)), "-o", str(out)]) == 0
    html = out.read_text()
    assert out.stat().st_size <= 120_000
    drawn = html.count('<svg class="heatmap"')
    assert 0 < drawn < 40 and f"{40 - drawn} not drawn" in html and "stops drawing rooms" in html
