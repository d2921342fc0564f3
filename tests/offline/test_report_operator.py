"""The report as the on-call reads it at 3 a.m.: when each bad room happened, on which pod, the
partner side's rid, what to check next per diagnosis, corrupt rooms over time per instance
against request volume, a page that fits an 800 px window, and a file others can read."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from tests.support.logdata import Fault, RoomPlan, room_records

from dsv4_idxk_probe.cli.main import run
from dsv4_idxk_probe.offline.next_steps import NEXT_STEPS
from dsv4_idxk_probe.offline.report_html import HEAT
from dsv4_idxk_probe.roomlog import RoomLogWriter, encode_line
from dsv4_idxk_probe.vocabulary import DIAGNOSIS_KINDS

REPO = Path(__file__).resolve().parents[2]
T0 = 1_780_000_000.0  # 2026-05-28


def write(directory: Path, role: str, records: list[dict]) -> Path:
    writer = RoomLogWriter(directory, role, max_files=100)
    for rec in records:
        assert writer.emit(rec)
    writer.close()
    return directory


def logs(tmp_path: Path, plans, *, instance=lambda room: "decode-pod-a:4242", at=lambda room: T0 + room,
         diagnosis: dict | None = None) -> list[Path]:
    """Both sides' records for `plans`, with rids, instances, wall times, and (per room) a
    `diagnosis` kind on decode's mismatching records."""
    prefill, decode = [], []
    for plan in plans:
        pre, dec = room_records(plan)
        for rec in pre:
            rec.update(rid=f"prefill-rid-{plan.room}", instance="prefill-pod:1", ts=at(plan.room) - 0.5)
        for i, rec in enumerate(dec):
            rec.update(rid=f"decode-rid-{plan.room}", instance=instance(plan.room), ts=at(plan.room) + i)
            kind = (diagnosis or {}).get(plan.room)
            if kind and plan.fault is not None:
                rec["diagnosis"] = [{"layer": plan.fault.layer_index, "page": plan.fault.page, "segment": "payload",
                                     "kind": kind}]
        prefill += pre
        decode += dec
    return [write(tmp_path / "p", "prefill", prefill), write(tmp_path / "d", "decode", decode)]


def report(tmp_path: Path, inputs, *extra) -> str:
    out = tmp_path / "report.html"
    assert run(["report", *map(str, inputs), "-o", str(out), "--engine", "reference", *extra]) == 0
    return out.read_text()


def room_block(html: str, room: int) -> str:
    match = re.search(rf'<div class="room[^"]*" id="room-{room}-0">(.*?)</div>(?=<div class="room|</div></section>)',
                      html, re.S)
    assert match, f"no block for room {room}"
    return match.group(1)


def test_each_bad_room_says_when_on_which_pod_and_the_partner_rid(tmp_path):
    html = report(tmp_path, logs(tmp_path, [RoomPlan(1), RoomPlan(2, fault=Fault(1, 1, 3))]))
    block = room_block(html, 2)
    assert "at <b>2026-05-28 20:26:42 UTC</b> on decode instance <b>decode-pod-a:4242</b>" in block, block
    assert "decode rid <code>decode-rid-2</code>, partner (prefill) rid <code>prefill-rid-2</code>" in block
    index = re.search(r'<div class="index">(.*?)</div>', html, re.S).group(1)
    assert "<th>wall time</th><th>decode instance</th>" in index
    assert "<td>2026-05-28 20:26:42 UTC</td><td>decode-pod-a:4242</td>" in index


def test_what_to_check_next_per_diagnosis_kind(tmp_path):
    plans = [RoomPlan(1, fault=Fault(0, 0, 1)), RoomPlan(2, fault=Fault(1, 1, 2)), RoomPlan(3, fault=Fault(2, 2, 3))]
    html = report(tmp_path, logs(tmp_path, plans, diagnosis={1: "zeroed", 2: "unknown"}))
    for room, kind in ((1, "zeroed"), (2, "unknown"), (3, "mismatch")):  # room 3: not diagnosed
        block = room_block(html, room)
        suspect, evidence = NEXT_STEPS[kind]
        assert f"<summary>what to check next ({kind})</summary>" in block, block
        assert f"<td>{kind}</td><td>{suspect}</td><td>{evidence.replace(chr(39), '&#39;')}</td>" in block
    assert "DCGM" in room_block(html, 2) and "transfer engine" in room_block(html, 1)


def test_the_next_steps_table_is_the_one_in_docs():
    text = (REPO / "docs" / "diagnosis.md").read_text()
    section = text.split("## What to check next", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    assert rows == NEXT_STEPS
    assert set(DIAGNOSIS_KINDS) <= set(NEXT_STEPS)


def test_the_page_is_written_0644_whatever_the_umask(tmp_path):
    inputs = logs(tmp_path, [RoomPlan(1)])
    old = os.umask(0o077)
    try:
        report(tmp_path, inputs)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.html").stat().st_mode) == 0o644


def _timeline(html: str) -> str:
    return re.search(r'<section id="timeline">(.*?)</section>', html, re.S).group(1)


def test_corrupt_rooms_over_time_per_instance_against_request_volume(tmp_path):
    plans = [RoomPlan(r, fault=Fault(0, 0, r) if r in (3, 17, 18) else None) for r in range(1, 31)]
    inputs = logs(tmp_path, plans, instance=lambda room: "decode-a:1" if room <= 20 else "decode-b:2",
                  at=lambda room: T0 + 60 * room)
    timeline = _timeline(report(tmp_path, inputs))
    assert "Corrupt rooms over time, per instance, against request volume" in timeline
    strips = re.findall(r'<tspan font-weight="bold">([^<]+)</tspan>: (\d+) rooms, <tspan[^>]*>(\d+) corrupt', timeline)
    assert strips == [("decode-a:1", "20", "3"), ("decode-b:2", "10", "0")], strips
    assert sum(int(n) for n in re.findall(r"<title>(\d+) corrupt rooms</title>", timeline)) == 3
    assert sum(int(n) for n in re.findall(r"<title>(\d+) rooms</title>", timeline)) == 30
    # y ticks per strip: 0 first, the top on a 1-2-5 scale, at least the strip's tallest bar
    svg_strips = timeline.split('<text x="48" y=')[1:]
    assert len(svg_strips) == 2
    for strip in svg_strips:
        ticks = [int(t.replace(",", "")) for t in re.findall(r'<text class="ytick"[^>]*>([\d,]+)</text>', strip)]
        bars = [int(n) for n in re.findall(r"<title>(\d+) rooms</title>", strip)]
        assert len(ticks) >= 2 and ticks[0] == 0 and ticks == sorted(ticks), ticks
        assert ticks[-1] >= max(bars) and re.fullmatch(r"[125]0*", str(ticks[-1])), (ticks, bars)


def test_a_stray_record_far_off_does_not_stretch_the_time_axis(tmp_path):
    plans = [RoomPlan(r) for r in range(1, 241)]
    inputs = logs(tmp_path, plans, at=lambda room: T0 - 86400 * 400 if room == 240 else T0 + room)
    timeline = _timeline(report(tmp_path, inputs))
    assert "time (UTC), from 2026-05-28 " in timeline, timeline[-600:]
    assert "1 rooms far outside the others' time range" in timeline


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: run .ci/install-test-services.sh (make test does)")
    return path


def browse(tmp_path: Path, page: Path, *args) -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, timeout=90, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


# Elements wider than the window, outside a box that scrolls on its own (the index, a wide table).
_MEASURE = """<script>
const w = window.innerWidth, out = [];
for (const el of document.body.querySelectorAll('*')) {
  const r = el.getBoundingClientRect();
  if (r.right > w + 0.5 && !el.closest('.scroll, .index, .rooms .room')) out.push(el.tagName + '.' + (el.getAttribute('class') || ''));
}
document.body.dataset.scrollwidth = document.documentElement.scrollWidth;
document.body.dataset.innerwidth = w;
document.body.dataset.overflow = out.slice(0, 20).join(' ');
</script></body>"""


def test_the_report_fits_an_800_px_window(tmp_path):
    """Long pod names and rids, many instances, a wide room, HiCache rows: at 800 px nothing sticks
    out of the window (a wide table scrolls in its own box), and the red cells are on screen."""
    plans = [RoomPlan(r, fault=Fault(r % 4, r % 3, r) if r % 5 == 0 else None) for r in range(1, 41)]
    inputs = logs(tmp_path, plans, instance=lambda room: f"sglang-decode-deployment-7f9c5d8b6-x{room % 14}q.example:{40000 + room}",
                  at=lambda room: T0 + 30 * room)
    page = tmp_path / "report.html"
    report(tmp_path, inputs, "--title", "incident 4711 " + "very-long-title-" * 8)
    html = page.read_text()
    probe = tmp_path / "measure.html"
    probe.write_text(html.replace("</body>", _MEASURE))
    dom = browse(tmp_path, probe, "--dump-dom", "--window-size=800,1200")
    inner = int(re.search(r'data-innerwidth="(\d+)"', dom).group(1))
    assert inner == 800
    scroll = int(re.search(r'data-scrollwidth="(\d+)"', dom).group(1))
    overflow = re.search(r'data-overflow="([^"]*)"', dom).group(1)
    assert scroll <= inner and not overflow, (scroll, overflow)
    png = tmp_path / "shot.png"
    browse(tmp_path, page, f"--screenshot={png}", "--window-size=800,6000")
    image = Image.open(png).convert("RGB")
    assert image.size[0] == 800
    want = tuple(int(HEAT[i: i + 2], 16) for i in (1, 3, 5))
    red = sum(n for n, rgb in image.getcolors(maxcolors=1 << 20) if all(abs(a - b) <= 3 for a, b in zip(rgb, want)))
    assert red > 20, "the diverging cells are not on screen"


def test_heatmaps_of_large_grids_are_binned_within_the_bound_and_scale_to_the_window(tmp_path):
    from dsv4_idxk_probe.offline.report_html import MAX_HEAT_RECTS

    h = lambda v: f"{v:016x}"
    digest = lambda pages, value: {"key": "1/0", "signature": "00000000000004d2", "n_tokens": pages * 256,
                                   "layer_ids": list(range(96)), "segments": ["payload"], "room": h(value),
                                   "layer_segment": [[h(value)] for _ in range(96)], "pages": [h(value)] * pages}
    base = {"v": 1, "kind": "room", "ts": T0, "instance": "h:1", "room": "1", "attempt": 0, "step": None,
            "layout": "fp8", "verdict": "match", "reason": "", "rid": None}
    log = tmp_path / "log.jsonl"
    log.write_bytes(encode_line(dict(base, role="prefill", stage="prefill_send", digest=digest(3000, 0)))
                    + encode_line(dict(base, role="decode", stage="decode_recv", digest=digest(3000, 1))))
    html = report(tmp_path, [log])
    svg = re.search(r'<svg class="heatmap"[^>]*>', html).group(0)
    width, height = (int(x) for x in re.search(r'width="(\d+)" height="(\d+)"', svg).groups())
    assert f'viewBox="0 0 {width} {height}"' in svg
    assert "each column covers" in html and "each row covers" in html
    cells = re.search(r'<svg class="heatmap".*?</svg>', html, re.S).group(0)
    assert 0 < cells.count('class="cell"') <= MAX_HEAT_RECTS


def test_both_engines_draw_the_same_timeline(tmp_path):
    """The fleet engine's clean rooms come from DuckDB as one (time, instance) each."""
    pytest.importorskip("duckdb")
    plans = [RoomPlan(r, fault=Fault(0, 0, r) if r % 7 == 0 else None) for r in range(1, 25)]
    inputs = logs(tmp_path, plans, instance=lambda room: f"decode-{room % 3}:1", at=lambda room: T0 + 45 * room)
    sections = []
    for engine in ("reference", "duckdb"):
        out = tmp_path / f"{engine}.html"
        assert run(["report", *map(str, inputs), "-o", str(out), "--engine", engine]) == 0
        sections.append(_timeline(out.read_text()))
    assert sections[0] == sections[1]
    assert "decode-0:1</tspan>: 8 rooms" in sections[0]


def test_the_title_and_file_names_are_escaped_by_the_page_template(tmp_path):
    hostile = '<script>alert(1)</script>\x1b]0;x\x07'
    directory = tmp_path / "<b>logs"
    inputs = logs(directory, [RoomPlan(1)])
    html = report(tmp_path, inputs, "--title", hostile)
    assert "<script" not in html and "\x1b" not in html
    assert "<title>&lt;script&gt;alert(1)&lt;/script&gt;\\x1b]0;x\\x07</title>" in html
    assert "&lt;b&gt;logs" in html and "<b>logs" not in html
