"""The `report` page: one self-contained HTML file (inline CSS and SVG, no scripts,
nothing fetched), so it can be mailed, attached to an incident, or opened offline.

Sections: summary; an index of the bad rooms (numeric order within each
verdict, each a link to its block); a cross-room (layer x page bucket) heat of
where rooms first diverged; each bad room with one (layer x page) heatmap, of
the first stage that saw the difference, and the stages listed; verdicts over
time; HiCache branch counts; skipped lines. Every string from the logs is escaped.
"""

from __future__ import annotations

import html
import math
import time
from collections import Counter

from ..diagnosis.diagnose import describe_room
from ..hicache.culprit import summarise as summarise_roundtrip
from ..metrics.definitions import page_bucket
from ..vocabulary import DECODE_STAGES, VERDICTS
from .analysis import Analysis, RoomResult, StageResult

HEAT = "#b2182b"  # a diverging (layer, page) cell; used nowhere else on the page
VERDICT_COLOURS = {
    "match": "#2ca02c",
    "mismatch": "#d62728",
    "not_comparable": "#ff7f0e",
    "unverified": "#7f7f7f",
    "skipped": "#bcbd22",
}
MAX_COLUMNS = 512  # wider rooms are binned: a column then covers several pages
TIME_BUCKETS = 60
TIME_TICKS = 6
MAX_INDEX_ROWS = 1000  # the index scrolls inside a box of fixed height; beyond this, a count
CROSS_SCALE = "#08519c"  # the cross-room heat: blue, so it is never mistaken for a room's red cells

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}.note{color:#555;font-size:13px}
.room{margin:10px 0;padding:6px 12px;border-left:4px solid #d62728;background:#fafafa}
.room.other{border-left-color:#ff7f0e}svg{display:block;margin:6px 0}.room p{margin:4px 0}
.index{max-height:360px;overflow:auto;border:1px solid #ddd;display:inline-block}.index table{margin:0}
.rooms{display:flex;flex-wrap:wrap;gap:0 16px}.rooms .room{flex:1 1 560px;min-width:0;overflow-x:auto}
tr.alarm td{background:#fde0dd;font-weight:bold}.bar{display:inline-block;height:10px;background:#4c78a8}
tr.alarm .bar{background:#d62728}code{font-size:12px}
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _tick_format(span: float) -> str:
    """Time-axis labels as short as the run allows: seconds for a short run, dates for a long one."""
    if span >= 2 * 86400:
        return "%m-%d %H:%M"
    if span >= 600:
        return "%H:%M"
    return "%H:%M:%S"


# %% summary


def _summary(a: Analysis) -> str:
    s = a.summary()
    head = "".join(f"<th>{_e(v)}</th>" for v in VERDICTS)
    rows = []
    for stage in DECODE_STAGES:
        counts = s["stage_verdicts"][stage]
        rows.append(f"<tr><td>{stage}</td>" + "".join(f"<td>{counts.get(v, 0):,}</td>" for v in VERDICTS) + "</tr>")
    rooms = s["room_verdicts"]
    rows.append("<tr><th>rooms (worst stage)</th>" + "".join(f"<th>{rooms.get(v, 0):,}</th>" for v in VERDICTS) + "</tr>")
    first = ", ".join(f"{stage} {s['first_divergence'].get(stage, 0):,}" for stage in DECODE_STAGES)
    kinds = ", ".join(f"{_e(k)} {n:,}" for k, n in sorted(s["records"].items())) or "none"
    return (
        f'<section id="summary"><h2>Summary</h2>'
        f"<p>{s['files']} files; records: {kinds}; <b>{s['rooms']:,}</b> rooms seen on decode; "
        f"{s['prefill_only_rooms']:,} only on prefill; {s['bad_lines']:,} lines skipped; "
        f"{s['live_verdict_disagreements']:,} live verdicts disagree with the logs.</p>"
        f"<table><tr><th>stage</th>{head}</tr>{''.join(rows)}</table>"
        f"<p>First divergence: {first}.</p>"
        + (f"<p>Diagnosis: {_e('; '.join(s['diagnosis']['lines']))}.</p>" if s["diagnosis"]["lines"] else "")
        + "</section>"
    )


# %% bad rooms


def _heatmap(room: RoomResult, stage: StageResult) -> str:
    """Rows are layers, columns logical pages; red cells may differ.

    The digest keeps a per-layer and a per-page fold, so the diverging cells
    are bounded by (differing layers) x (differing pages): exact for one cell,
    candidates otherwise; the caption says which.
    """
    c = stage.comparison
    layer_ids = list(room.layer_ids)
    n_pages = max(room.n_pages, 1)
    per_col = math.ceil(n_pages / MAX_COLUMNS)
    cols = math.ceil(n_pages / per_col)
    cw = max(2, min(24, 720 // cols))
    ch = max(4, min(16, 400 // max(len(layer_ids), 1)))
    left, top = 44, 18
    width, height = left + cols * cw + 4, top + len(layer_ids) * ch + 4
    row_of = {layer: i for i, layer in enumerate(layer_ids)}
    bad_rows = sorted({row_of[layer] for layer in c.layers if layer in row_of})
    bad_cols = sorted({p // per_col for p in c.pages})
    parts = [
        f'<svg class="heatmap" data-room="{_e(room.room)}/{room.attempt}" data-stage="{_e(stage.label)}" '
        f'data-cells="{len(bad_rows) * len(bad_cols)}" width="{width}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img">',
        f'<rect x="{left}" y="{top}" width="{cols * cw}" height="{len(layer_ids) * ch}" fill="#eef1f5"/>',
    ]
    label_every = 1 if ch >= 10 else 5
    for i, layer in enumerate(layer_ids):
        if i % label_every == 0 or i in bad_rows:
            parts.append(f'<text x="{left - 4}" y="{top + i * ch + ch - 2}" font-size="10" text-anchor="end">L{layer}</text>')
    col_every = max(1, 60 // cw)
    for j in range(0, cols, col_every):
        parts.append(f'<text x="{left + j * cw}" y="{top - 5}" font-size="10">{j * per_col}</text>')
    for i in bad_rows:
        for j in bad_cols:
            tip = f"layer {layer_ids[i]}, page {j * per_col}" + (f"-{j * per_col + per_col - 1}" if per_col > 1 else "")
            parts.append(
                f'<rect class="cell" x="{left + j * cw}" y="{top + i * ch}" width="{cw}" height="{ch}" fill="{HEAT}">'
                f"<title>{_e(tip)}</title></rect>"
            )
    parts.append("</svg>")
    kind = "exactly this cell" if c.exact else f"candidate cells (at most {c.cells_bound} differ)"
    binned = f"; each column covers {per_col} pages" if per_col > 1 else ""
    caption = (
        f'<p class="note">{_e(stage.label)}: layers {_e(c.layers)}, pages {_e(c.pages[:50])}'
        f"{' ...' if len(c.pages) > 50 else ''}, segments {_e(', '.join(c.segments))}: {kind}{binned}.</p>"
    )
    return caption + "".join(parts)


def _anchor(room: RoomResult) -> str:
    """A fragment id for the room's block: only safe characters, unique per (room, attempt)."""
    safe = "".join(c if c.isalnum() or c in "-_" else f"_{ord(c):x}" for c in room.room)
    return f"room-{safe}-{room.attempt}"


def _room_block(room: RoomResult) -> str:
    """One room: its verdict, rids, the stages in order, and ONE heatmap, of the
    first stage that saw the difference (later stages are listed, and say when
    they localise differently)."""
    first = room.first_divergence
    intact = room.last_match_before_divergence
    line = f"<b>room {_e(room.room)} attempt {room.attempt}</b>: {_e(room.verdict)}"
    if first is not None:
        line += f"; first divergence at <b>{_e(first.label)}</b>"
        line += f" (intact at {_e(intact.label)})" if intact else ""
    rids = f' <span class="note">rid {_e(", ".join(room.rids))}</span>' if room.rids else ""
    stages = ", ".join(f"{_e(s.label)} {_e(s.verdict)}" for s in room.ordered)
    body = [f'<div class="room{"" if room.verdict == "mismatch" else " other"}" id="{_anchor(room)}">',
            f"<p>{line}{rids}</p>", f'<p class="note">stages: {stages}</p>']
    drawn = first if first is not None and first.comparison is not None else None
    if drawn is not None:
        body.append(_heatmap(room, drawn))
        c = drawn.comparison
        moved = [s.label for s in room.ordered if s is not drawn and s.comparison is not None
                 and s.comparison.verdict == "mismatch"
                 and (s.comparison.layers, s.comparison.pages, s.comparison.segments) != (c.layers, c.pages, c.segments)]
        if moved:
            body.append(f'<p class="note">localised differently at {_e(", ".join(moved))} (see `diff --json`).</p>')
    if first is not None and first.diagnosis:
        body.append(_diagnosis_table(first.diagnosis))
    for stage in room.ordered:
        if stage.verdict not in ("match", "mismatch") and stage.reason:
            body.append(f'<p class="note">{_e(stage.label)}: {_e(stage.reason)} <code>{_e(stage.where)}</code></p>')
        elif stage.verdict == "mismatch" and stage.comparison is None and stage is first:
            body.append(f'<p class="note">{_e(stage.label)}: {_e(stage.reason or "not localised")}</p>')
    body.append("</div>")
    return "".join(body)


MAX_DIAGNOSIS_ROWS = 32


def _diagnosis_table(cells: list[dict]) -> str:
    """What each bad cell's bytes became, and the page's events before it (docs/diagnosis.md)."""
    rows = []
    for cell in cells[:MAX_DIAGNOSIS_ROWS]:
        rooms = ", ".join(_e(str(r.get("room"))) + (f" P{r['page']}" if r.get("page") is not None else "")
                          for r in cell.get("rooms") or ())
        events = " &rarr; ".join(_e(e.get("event", "?")) + (f" ({_e(str(e['room']))})" if e.get("room") else "")
                                 + (f" host row {e['host_row']}" if e.get("host_row") is not None else "")
                                 for e in cell.get("events") or ())
        rows.append(f"<tr><td>L{cell.get('layer')} P{cell.get('page')} {_e(cell.get('segment', ''))}</td>"
                    f"<td>{_e(cell.get('kind', ''))}{'' if cell.get('exact', True) else ' (in bound)'}</td>"
                    f"<td>{rooms or '-'}</td><td>{cell.get('physical_page', '-')}</td><td>{events or '-'}</td></tr>")
    more = f'<p class="note">... and {len(cells) - MAX_DIAGNOSIS_ROWS} more cells.</p>' if len(cells) > MAX_DIAGNOSIS_ROWS else ""
    return ('<table class="diagnosis"><tr><th>cell</th><th>diagnosis</th><th>room(s)</th><th>physical page</th>'
            f"<th>page events since the last match</th></tr>{''.join(rows)}</table>{more}")


def _ranges(values) -> str:
    values = sorted(set(int(v) for v in values))
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def _index(bad: list[RoomResult], drawn: int) -> str:
    rows = []
    for i, room in enumerate(bad[:MAX_INDEX_ROWS]):
        first = room.first_divergence
        c = first.comparison if first is not None else None
        name = f"{_e(room.room)}/{room.attempt}"
        link = f'<a href="#{_anchor(room)}">{name}</a>' if i < drawn else name
        rows.append(
            f"<tr><td>{link}</td><td>{_e(', '.join(room.rids) or '-')}</td><td>{_e(room.verdict)}</td>"
            f"<td>{_e(first.label) if first else '-'}</td><td>{_e(_ranges(c.layers)) if c else '-'}</td>"
            f"<td>{_e(_ranges(c.pages)) if c else '-'}</td><td>{_e(', '.join(c.segments)) if c else '-'}</td>"
            f"<td>{_e(describe_room(first.diagnosis or ())) if first else '-'}</td></tr>"
        )
    more = f'<p class="note">... and {len(bad) - MAX_INDEX_ROWS:,} more (see `diff --json`).</p>' if len(bad) > MAX_INDEX_ROWS else ""
    return (
        '<div class="index"><table><tr><th>room/attempt</th><th>rid</th><th>verdict</th><th>first divergence</th>'
        f"<th>layers</th><th>pages</th><th>segments</th><th>diagnosis</th></tr>{''.join(rows)}</table></div>{more}"
    )


def _bad_rooms(a: Analysis, max_rooms: int) -> str:
    bad = a.bad_rooms()
    if not bad:
        return '<section id="bad-rooms"><h2>Rooms that did not match</h2><p>None: every verified room matched.</p></section>'
    shown = bad[:max_rooms]
    note = (f"{len(bad):,} rooms, worst first, numeric within a verdict; {len(shown)} drawn below"
            + (" (raise --max-rooms for more)" if len(bad) > len(shown) else ""))
    return (
        f'<section id="bad-rooms"><h2>Rooms that did not match</h2><p class="note">{note}.</p>{_index(bad, len(shown))}'
        f"{_cross_room_heat(bad)}<h3>Each room</h3>"
        + '<div class="rooms">' + "".join(_room_block(r) for r in shown) + "</div></section>"
    )


def _cross_room_heat(bad: list[RoomResult]) -> str:
    """Where rooms first diverged, across all of them: (layer x page bucket), each
    cell counting the rooms whose first-divergence candidates include it. Page
    buckets are the metrics' (`page_bucket`: [b, 2b)), so this reads like the
    dashboard's heat panels, but from every room in the logs."""
    counts: Counter = Counter()
    for room in bad:
        first = room.first_divergence
        c = first.comparison if first is not None else None
        if c is None:
            continue
        for layer in set(c.layers):
            for bucket in {page_bucket(p) for p in c.pages}:
                counts[(layer, bucket)] += 1
    if not counts:
        return ""
    layers = sorted({layer for layer, _ in counts})
    buckets = sorted({b for _, b in counts}, key=int)
    peak = max(counts.values())
    cw, ch, left, top = 44, max(6, min(16, 480 // len(layers))), 44, 30
    width, height = left + len(buckets) * cw + 4, top + len(layers) * ch + 4
    parts = [f'<svg class="crossheat" width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" role="img">',
             f'<rect x="{left}" y="{top}" width="{len(buckets) * cw}" height="{len(layers) * ch}" fill="#f4f6f9"/>']
    for j, bucket in enumerate(buckets):
        parts.append(f'<text x="{left + j * cw + 2}" y="{top - 6}" font-size="10">p{_e(bucket)}+</text>')
    label_every = 1 if ch >= 10 else max(1, 10 // ch)
    for i, layer in enumerate(layers):
        if i % label_every == 0:
            parts.append(f'<text x="{left - 4}" y="{top + i * ch + ch - 2}" font-size="10" text-anchor="end">L{layer}</text>')
        for j, bucket in enumerate(buckets):
            n = counts.get((layer, bucket), 0)
            if n:
                parts.append(
                    f'<rect class="xcell" x="{left + j * cw}" y="{top + i * ch}" width="{cw - 1}" height="{ch - 1}" '
                    f'fill="{CROSS_SCALE}" fill-opacity="{0.15 + 0.85 * n / peak:.2f}"><title>layer {layer}, pages '
                    f"{_e(bucket)}..: {n} room(s)</title></rect>"
                )
    parts.append("</svg>")
    return (
        '<section id="cross-room"><h3>Where rooms first diverged, all rooms</h3><p class="note">Rows are layers, columns '
        "power-of-two page buckets (pN+ holds pages N to 2N-1); darker means more rooms, "
        f"at most {peak}. Candidate cells of each room's first divergence.</p>{''.join(parts)}</section>"
    )


# %% verdicts over time


def _timeline(a: Analysis) -> str:
    points = [(s.ts, s.verdict) for r in a.rooms.values() for s in r.stages if s.ts is not None]
    if not points:
        return '<section id="timeline"><h2>Verdicts over time</h2><p>No timestamps in the logs.</p></section>'
    t0 = min(t for t, _ in points)
    t1 = max(t for t, _ in points)
    span = max(t1 - t0, 1e-9)
    buckets = [Counter() for _ in range(TIME_BUCKETS)]
    for t, verdict in points:
        buckets[min(TIME_BUCKETS - 1, int((t - t0) / span * TIME_BUCKETS))][verdict] += 1
    peak = max(sum(b.values()) for b in buckets) or 1
    bw, h, left, top = 14, 160, 40, 10
    parts = [f'<svg class="timeline" width="{left + TIME_BUCKETS * bw + 40}" height="{h + 50}" xmlns="http://www.w3.org/2000/svg">']
    for i, bucket in enumerate(buckets):
        y = top + h
        for verdict in VERDICTS:
            n = bucket.get(verdict, 0)
            if not n:
                continue
            bh = n / peak * h
            y -= bh
            parts.append(
                f'<rect x="{left + i * bw}" y="{y:.1f}" width="{bw - 2}" height="{bh:.1f}" fill="{VERDICT_COLOURS[verdict]}">'
                f"<title>{n} {verdict}</title></rect>"
            )
    parts.append(f'<text x="{left - 4}" y="{top + 8}" font-size="10" text-anchor="end">{peak}</text>')
    fmt = _tick_format(span)
    for k in range(TIME_TICKS + 1):
        x = left + k * TIME_BUCKETS * bw / TIME_TICKS
        anchor = "start" if k == 0 else "end" if k == TIME_TICKS else "middle"
        parts.append(f'<line x1="{x:.1f}" y1="{top + h}" x2="{x:.1f}" y2="{top + h + 4}" stroke="#555"/>')
        parts.append(f'<text class="tick" x="{x:.1f}" y="{top + h + 16}" font-size="10" text-anchor="{anchor}">'
                     f"{_e(time.strftime(fmt, time.gmtime(t0 + span * k / TIME_TICKS)))}</text>")
    parts.append(f'<text x="{left + TIME_BUCKETS * bw / 2}" y="{top + h + 32}" font-size="11" text-anchor="middle">'
                 f"time (UTC), from {_e(_utc(t0))} to {_e(_utc(t1))}</text>")
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="color:{VERDICT_COLOURS[v]}">&#9632;</span> {v}' for v in VERDICTS
    )
    return (
        f'<section id="timeline"><h2>Verdicts over time</h2><p class="note">Decode-stage verdicts per '
        f"{span / TIME_BUCKETS:.3g} s bucket. {legend}</p>{''.join(parts)}</section>"
    )


# %% HiCache


def _hicache(a: Analysis) -> str:
    return _hicache_branches(a) + _hicache_roundtrip(a)


def _hicache_branches(a: Analysis) -> str:
    if not a.hicache:
        return '<section id="hicache"><h2>HiCache branches</h2><p>No HiCache branch records in the logs.</p></section>'
    peak = max(a.hicache.values()) or 1
    rows = []
    for (pool, direction, branch), n in sorted(a.hicache.items()):
        alarm = branch.startswith("token") and "indexer" in pool
        rows.append(
            f'<tr{" class=alarm" if alarm else ""}><td>{_e(pool)}</td><td>{_e(direction)}</td><td>{_e(branch)}</td>'
            f'<td>{n:,}</td><td style="text-align:left"><span class="bar" style="width:{max(1, round(n / peak * 300))}px"></span></td></tr>'
        )
    return (
        '<section id="hicache"><h2>HiCache branches</h2><p class="note">Copy calls per host pool, direction and '
        "branch. A token-granular branch on an indexer pool (red) applies the C4 row geometry to rows that "
        "are not C4 rows.</p><table><tr><th>pool</th><th>direction</th><th>branch</th><th>calls</th><th></th></tr>"
        + "".join(rows)
        + "</table></section>"
    )


def _hicache_roundtrip(a: Analysis) -> str:
    """Host rows round-trip mode found broken at a load (docs/diagnosis.md)."""
    if not a.roundtrip_n:
        return ""
    rows = []
    for d in a.roundtrip[:200]:
        checks = d.get("checks") or {}
        events = " &rarr; ".join(_e(str(e.get("event"))) for e in d.get("events") or ()) or "-"
        rows.append(
            f"<tr class=alarm><td>{_e(str(d.get('pool')))}</td><td>{d.get('host_row')}</td><td>{d.get('layer')}</td>"
            f"<td>{_e(str(d.get('device_page', '-')))}</td>"
            + "".join(f"<td>{_e(str(checks.get(leg, '-')))}</td>" for leg in ("d2h", "host", "h2d"))
            + f'<td style="text-align:left">{events}</td></tr>'
        )
    summary = "; ".join(summarise_roundtrip(a.roundtrip))
    more = f"<p class=note>... {a.roundtrip_n:,} in all (see diff --json).</p>" if a.roundtrip_n > len(rows) else ""
    return (
        f'<section id="hicache-roundtrip"><h2>HiCache round trip ({a.roundtrip_n:,} broken host row{"s" if a.roundtrip_n != 1 else ""})</h2>'
        f'<p class="note">{_e(summary)}. Checks per host row: d2h (matched its device rows at backup), host '
        "(unchanged while resident), h2d (copied faithfully by the load); the events are the journal's for "
        "the device page the row was loaded into, the last one the load.</p><table><tr><th>pool</th>"
        "<th>host row</th><th>layer</th><th>device page</th><th>d2h</th><th>host</th><th>h2d</th><th>page events</th></tr>"
        + "".join(rows)
        + f"</table>{more}</section>"
    )


def _bad_lines(a: Analysis) -> str:
    if not a.n_errors:
        return ""
    items = "".join(f"<li><code>{_e(m)}</code></li>" for m in a.errors[:200])
    more = f"<p class=note>... and {a.n_errors - 200:,} more.</p>" if a.n_errors > 200 else ""
    return f'<section id="bad-lines"><h2>Skipped lines ({a.n_errors:,})</h2><ul>{items}</ul>{more}</section>'


def render(analysis: Analysis, *, title: str = "dsv4-idxk-probe report", max_rooms: int = 50) -> str:
    inputs = "".join(f"<li><code>{_e(f)}</code></li>" for f in analysis.files)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"
        f'<p class="note">Generated {_e(_utc(time.time()))} from {len(analysis.files)} room logs.</p>'
        f"{_summary(analysis)}{_bad_rooms(analysis, max_rooms)}{_timeline(analysis)}{_hicache(analysis)}"
        f"{_bad_lines(analysis)}<details><summary>Inputs</summary><ul>{inputs}</ul></details></body></html>\n"
    )
