"""The `report` page: one self-contained HTML file (inline CSS and SVG, no scripts,
nothing fetched), so it can be mailed, attached to an incident, or opened offline.

Sections: summary; an index of the bad rooms (numeric order within each
verdict, each a link to its block); a cross-room (layer x page bucket) heat of
where rooms first diverged; each bad room with one (layer x page) heatmap, of
the first stage that saw the difference, and the stages listed; verdicts over
time; HiCache branch counts; skipped lines. Every string from the logs is escaped
(HTML, and `printable`: controls, bidi overrides, lone surrogates).

Bounded on any input (docs/security.md): a heatmap draws at most MAX_HEAT_ROWS x
MAX_COLUMNS bins (layers and pages binned beyond) in at most MAX_HEAT_RECTS
rectangles (bins coarsened beyond), at most `max_rooms` rooms are drawn, every list
and text from the logs is cut to a stated length, and the page stops drawing rooms
at MAX_REPORT_BYTES: the index still lists them, and `report --rid RID` draws one.
"""

from __future__ import annotations

import hashlib
import html
import math
import time
from collections import Counter

from ..diagnosis.diagnose import describe_room
from ..hicache.culprit import summarise as summarise_roundtrip
from ..metrics.definitions import page_bucket
from ..vocabulary import DECODE_STAGES, VERDICTS
from .printable import clip, printable
from .results import Analysis, RoomResult, StageResult

HEAT = "#b2182b"  # a diverging (layer, page) cell; used nowhere else on the page
VERDICT_COLOURS = {
    "match": "#2ca02c",
    "mismatch": "#d62728",
    "not_comparable": "#ff7f0e",
    "unverified": "#7f7f7f",
    "skipped": "#bcbd22",
}
MAX_COLUMNS = 512  # wider rooms are binned: a column then covers several pages
MAX_HEAT_ROWS = 64  # taller rooms (more layers) are binned: a row then covers several layers
MAX_HEAT_RECTS = 1024  # rectangles drawn per heatmap; a picture that needs more is binned coarser
MAX_REPORT_BYTES = 16 << 20  # the page's size cap: rooms beyond it are listed, not drawn
MAX_TEXT = 200  # characters of one text from the logs (a reason, a list of layers) on the page
MAX_LISTED = 40  # stages, notes, table rows of one room block
MAX_TABLE_ROWS = 500  # HiCache branch rows
MAX_INPUTS_LISTED = 1000
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
    return html.escape(printable(value), quote=True)


def _c(value, limit: int = MAX_TEXT) -> str:
    """`_e`, cut to `limit` characters (with a count of the rest)."""
    return html.escape(clip(value, limit), quote=True)


def _more(items, limit: int) -> tuple[list, str]:
    """The first `limit` items, and a note of how many were left out."""
    items = list(items) if not isinstance(items, list) else items
    return items[:limit], (f" ... and {len(items) - limit:,} more" if len(items) > limit else "")


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
        + (f"<p>Diagnosis: {_c('; '.join(s['diagnosis']['lines']), 2000)}.</p>" if s["diagnosis"]["lines"] else "")
        + "</section>"
    )


# %% bad rooms


def _bin(n: int, limit: int) -> int:
    """Items per bin, so that `n` items fit in `limit` bins."""
    return max(1, math.ceil(n / limit))


def _runs(sorted_values: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct integers as (first, last) runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for v in sorted_values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def _heatmap(room: RoomResult, stage: StageResult) -> str:
    """Rows are layers, columns logical pages; red cells may differ.

    The digest keeps a per-layer and a per-page fold, so the diverging cells
    are bounded by (differing layers) x (differing pages): exact for one cell,
    candidates otherwise; the caption says which. At most MAX_HEAT_ROWS rows and
    MAX_COLUMNS columns (a row or column then covers several layers or pages),
    drawn as at most MAX_HEAT_RECTS rectangles, one per block of adjacent red
    cells (bins are widened until the picture fits), whatever the log holds.
    """
    c = stage.comparison
    layer_ids = list(room.layer_ids)
    n_pages = max(room.n_pages, (max(c.pages) + 1) if c.pages else 0, 1)
    per_row = _bin(len(layer_ids), MAX_HEAT_ROWS)
    per_col = _bin(n_pages, MAX_COLUMNS)
    row_of = {layer: i for i, layer in enumerate(layer_ids)}
    bad_layer_rows = sorted({row_of[layer] for layer in c.layers if layer in row_of})
    while True:
        bad_rows = sorted({i // per_row for i in bad_layer_rows})
        bad_cols = sorted({p // per_col for p in c.pages})
        row_runs, col_runs = _runs(bad_rows), _runs(bad_cols)
        if len(row_runs) * len(col_runs) <= MAX_HEAT_RECTS:
            break
        if len(col_runs) >= len(row_runs):
            per_col *= 2
        else:
            per_row *= 2
    rows = max(math.ceil(len(layer_ids) / per_row), 0)
    cols = math.ceil(n_pages / per_col)
    cw = max(2, min(24, 720 // cols))
    ch = max(4, min(16, 400 // max(rows, 1)))
    left, top = 44, 18
    width, height = left + cols * cw + 4, top + rows * ch + 4
    parts = [
        f'<svg class="heatmap" data-room="{_c(room.name, 300)}" data-stage="{_e(stage.label)}" '
        f'data-cells="{len(bad_rows) * len(bad_cols)}" width="{width}" height="{height}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img">',
        f'<rect x="{left}" y="{top}" width="{cols * cw}" height="{rows * ch}" fill="#eef1f5"/>',
    ]
    label_every = 1 if ch >= 10 else 5
    bad_row_set = set(bad_rows) if len(bad_rows) <= 8 else set()  # a few red rows are named; many would overlap
    for i in range(rows):
        if i % label_every == 0 or i in bad_row_set:
            parts.append(f'<text x="{left - 4}" y="{top + i * ch + ch - 2}" font-size="10" '
                         f'text-anchor="end">L{layer_ids[i * per_row]}</text>')
    col_every = max(1, 60 // cw)
    for j in range(0, cols, col_every):
        parts.append(f'<text x="{left + j * cw}" y="{top - 5}" font-size="10">{j * per_col}</text>')
    for r0, r1 in row_runs:
        first, last = layer_ids[r0 * per_row], layer_ids[min(len(layer_ids), (r1 + 1) * per_row) - 1]
        layers = f"layer {first}" if first == last else f"layers {first}-{last}"
        for c0, c1 in col_runs:
            pages = f"page {c0 * per_col}" + (f"-{c1 * per_col + per_col - 1}" if per_col > 1 or c1 > c0 else "")
            parts.append(
                f'<rect class="cell" x="{left + c0 * cw}" y="{top + r0 * ch}" width="{(c1 - c0 + 1) * cw}" '
                f'height="{(r1 - r0 + 1) * ch}" fill="{HEAT}"><title>{layers}, {pages}</title></rect>'
            )
    parts.append("</svg>")
    kind = "exactly this cell" if c.exact else f"candidate cells (at most {c.cells_bound} differ)"
    binned = (f"; each column covers {per_col} pages" if per_col > 1 else "") + (
        f"; each row covers {per_row} layers" if per_row > 1 else "")
    caption = (
        f'<p class="note">{_e(stage.label)}: layers {_e(c.layers[:50])}{" ..." if len(c.layers) > 50 else ""}, '
        f"pages {_e(c.pages[:50])}{' ...' if len(c.pages) > 50 else ''}, "
        f"segments {_c(', '.join(c.segments[:50]))}{' ...' if len(c.segments) > 50 else ''}: {kind}{binned}.</p>"
    )
    return caption + "".join(parts)


def _anchor(room: RoomResult) -> str:
    """A fragment id for the room's block: only safe characters, unique per (room, attempt,
    cluster); a long name is cut and a hash of it keeps it unique."""
    name = f"{room.room}@{room.cluster}" if room.cluster else room.room
    safe = "".join(c if c.isalnum() or c == "-" else f"_{ord(c):x}" for c in name)
    if len(safe) > 64:
        digest = hashlib.blake2s(name.encode("utf-8", "backslashreplace"), digest_size=6).hexdigest()
        safe = f"{safe[:40]}-{digest}"
    return f"room-{safe}-{room.attempt}"


def _room_block(room: RoomResult) -> str:
    """One room: its verdict, rids, the stages in order, and ONE heatmap, of the
    first stage that saw the difference (later stages are listed, and say when
    they localise differently). Lists are cut at MAX_LISTED, texts at MAX_TEXT."""
    first = room.first_divergence
    intact = room.last_match_before_divergence
    cluster = f" cluster {_c(room.cluster)}" if room.cluster else ""
    line = f"<b>room {_c(room.room, 300)} attempt {room.attempt}{cluster}</b>: {_e(room.verdict)}"
    if first is not None:
        line += f"; first divergence at <b>{_e(first.label)}</b>"
        line += f" (intact at {_e(intact.label)})" if intact else ""
    rids = f' <span class="note">rid {_c(", ".join(room.rids), 600)}</span>' if room.rids else ""
    ordered = room.ordered
    shown, more = _more(ordered, MAX_LISTED)
    stages = ", ".join(f"{_e(s.label)} {_e(s.verdict)}" for s in shown) + more
    body = [f'<div class="room{"" if room.verdict == "mismatch" else " other"}" id="{_anchor(room)}">',
            f"<p>{line}{rids}</p>", f'<p class="note">stages: {stages}</p>']
    drawn = first if first is not None and first.comparison is not None else None
    if drawn is not None:
        body.append(_heatmap(room, drawn))
        c = drawn.comparison
        moved = [s.label for s in ordered if s is not drawn and s.comparison is not None
                 and s.comparison.verdict == "mismatch"
                 and (s.comparison.layers, s.comparison.pages, s.comparison.segments) != (c.layers, c.pages, c.segments)]
        if moved:
            body.append(f'<p class="note">localised differently at {_c(", ".join(moved))} (see `diff --json`).</p>')
    if first is not None and first.diagnosis:
        body.append(_diagnosis_table(first.diagnosis))
    notes = 0
    for stage in ordered:
        if notes >= MAX_LISTED:
            body.append('<p class="note">... more stages (see `diff --json`).</p>')
            break
        if stage.verdict not in ("match", "mismatch") and stage.reason:
            body.append(f'<p class="note">{_e(stage.label)}: {_c(stage.reason)} <code>{_c(stage.where, 300)}</code></p>')
            notes += 1
        elif stage.verdict == "mismatch" and stage.comparison is None and stage is first:
            body.append(f'<p class="note">{_e(stage.label)}: {_c(stage.reason or "not localised")}</p>')
            notes += 1
    body.append("</div>")
    return "".join(body)


MAX_DIAGNOSIS_ROWS = 32
MAX_CELL_ITEMS = 8  # other rooms and page events shown per diagnosed cell


def _diagnosis_table(cells: list[dict]) -> str:
    """What each bad cell's bytes became, and the page's events before it (docs/diagnosis.md)."""
    rows = []
    for cell in cells[:MAX_DIAGNOSIS_ROWS]:
        named, more_rooms = _more(cell.get("rooms") or (), MAX_CELL_ITEMS)
        rooms = ", ".join(_c(str(r.get("room")), 80) + (f" P{r['page']}" if r.get("page") is not None else "")
                          for r in named) + more_rooms
        listed, more_events = _more(cell.get("events") or (), MAX_CELL_ITEMS)
        events = " &rarr; ".join(_c(e.get("event", "?"), 80) + (f" ({_c(str(e['room']), 80)})" if e.get("room") else "")
                                 + (f" host row {e['host_row']}" if e.get("host_row") is not None else "")
                                 for e in listed) + more_events
        rows.append(f"<tr><td>L{cell.get('layer')} P{cell.get('page')} {_c(cell.get('segment', ''), 80)}</td>"
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
        name = _c(room.name, 100)
        link = f'<a href="#{_anchor(room)}">{name}</a>' if i < drawn else name
        rows.append(
            f"<tr><td>{link}</td><td>{_c(', '.join(room.rids) or '-')}</td><td>{_e(room.verdict)}</td>"
            f"<td>{_e(first.label) if first else '-'}</td><td>{_c(_ranges(c.layers), 120) if c else '-'}</td>"
            f"<td>{_c(_ranges(c.pages), 120) if c else '-'}</td><td>{_c(', '.join(c.segments[:50]), 120) if c else '-'}</td>"
            f"<td>{_c(describe_room(first.diagnosis or ())) if first else '-'}</td></tr>"
        )
    more = f'<p class="note">... and {len(bad) - MAX_INDEX_ROWS:,} more (see `diff --json`).</p>' if len(bad) > MAX_INDEX_ROWS else ""
    return (
        '<div class="index"><table><tr><th>room/attempt</th><th>rid</th><th>verdict</th><th>first divergence</th>'
        f"<th>layers</th><th>pages</th><th>segments</th><th>diagnosis</th></tr>{''.join(rows)}</table></div>{more}"
    )


def _size(text: str) -> int:
    return len(text.encode("utf-8", "replace"))


def _bad_rooms(a: Analysis, max_rooms: int, budget: int = MAX_REPORT_BYTES) -> str:
    """The index, the cross-room heat, and a block for each of the first `max_rooms` bad
    rooms as long as the page stays within `budget` bytes; the note says how many are
    not drawn, and how to draw one (`--rid`)."""
    bad = a.bad_rooms()
    if not bad:
        return '<section id="bad-rooms"><h2>Rooms that did not match</h2><p>None: every verified room matched.</p></section>'
    wanted = bad[:max(0, max_rooms)]
    cross = _cross_room_heat(bad)
    budget -= _size(_index(bad, len(wanted))) + _size(cross) + 2048  # the index as it would be with every link
    blocks: list[str] = []
    for room in wanted:
        block = _room_block(room)
        budget -= _size(block)
        if budget < 0:
            break
        blocks.append(block)
    drawn = len(blocks)
    note = f"{len(bad):,} rooms, worst first, numeric within a verdict; {drawn:,} drawn below"
    if drawn < len(bad):
        why = ("raise --max-rooms for more" if drawn == len(wanted)
               else f"the page stops drawing rooms at {MAX_REPORT_BYTES >> 20} MiB")
        note += (f" ({why}); {len(bad) - drawn:,} not drawn: `report --rid RID` draws a room's, "
                 "`diff --json` lists them all")
    return (
        f'<section id="bad-rooms"><h2>Rooms that did not match</h2><p class="note">{note}.</p>{_index(bad, drawn)}'
        f"{cross}<h3>Each room</h3>"
        + '<div class="rooms">' + "".join(blocks) + "</div></section>"
    )


def _cross_room_heat(bad: list[RoomResult]) -> str:
    """Where rooms first diverged, across all of them: (layer x page bucket), each
    cell counting the rooms whose first-divergence candidates include it. Page
    buckets are the metrics' (`page_bucket`: [b, 2b)), so this reads like the
    dashboard's heat panels, but from every room in the logs. More than
    MAX_HEAT_ROWS layers are binned (a row covers several)."""
    candidates = []
    all_layers: set = set()
    for room in bad:
        first = room.first_divergence
        c = first.comparison if first is not None else None
        if c is not None and c.layers and c.pages:
            candidates.append(c)
            all_layers.update(c.layers)
    if not candidates:
        return ""
    ordered_layers = sorted(all_layers)
    per_row = _bin(len(ordered_layers), MAX_HEAT_ROWS)
    row_of = {layer: i // per_row for i, layer in enumerate(ordered_layers)}
    counts: Counter = Counter()
    for c in candidates:
        buckets = {page_bucket(p) for p in c.pages}
        for row in {row_of[layer] for layer in c.layers}:
            for bucket in buckets:
                counts[(row, bucket)] += 1
    n_rows = math.ceil(len(ordered_layers) / per_row)
    rows = sorted({row for row, _ in counts})
    buckets = sorted({b for _, b in counts}, key=int)
    peak = max(counts.values())
    cw, ch, left, top = 44, max(6, min(16, 480 // len(rows))), 44, 30
    width, height = left + len(buckets) * cw + 4, top + len(rows) * ch + 4
    parts = [f'<svg class="crossheat" width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" role="img">',
             f'<rect x="{left}" y="{top}" width="{len(buckets) * cw}" height="{len(rows) * ch}" fill="#f4f6f9"/>']
    for j, bucket in enumerate(buckets):
        parts.append(f'<text x="{left + j * cw + 2}" y="{top - 6}" font-size="10">p{_e(bucket)}+</text>')
    label_every = 1 if ch >= 10 else max(1, 10 // ch)
    for i, row in enumerate(rows):
        first = ordered_layers[row * per_row]
        last = ordered_layers[min(len(ordered_layers), (row + 1) * per_row) - 1]
        layers = f"layer {first}" if first == last else f"layers {first}-{last}"
        if i % label_every == 0:
            parts.append(f'<text x="{left - 4}" y="{top + i * ch + ch - 2}" font-size="10" text-anchor="end">L{first}</text>')
        for j, bucket in enumerate(buckets):
            n = counts.get((row, bucket), 0)
            if n:
                parts.append(
                    f'<rect class="xcell" x="{left + j * cw}" y="{top + i * ch}" width="{cw - 1}" height="{ch - 1}" '
                    f'fill="{CROSS_SCALE}" fill-opacity="{0.15 + 0.85 * n / peak:.2f}"><title>{layers}, pages '
                    f"{_e(bucket)}..: {n} room(s)</title></rect>"
                )
    parts.append("</svg>")
    binned = f" Each row covers {per_row} layers ({n_rows} rows)." if per_row > 1 else ""
    return (
        '<section id="cross-room"><h3>Where rooms first diverged, all rooms</h3><p class="note">Rows are layers, columns '
        "power-of-two page buckets (pN+ holds pages N to 2N-1); darker means more rooms, "
        f"at most {peak}. Candidate cells of each room's first divergence.{binned}</p>{''.join(parts)}</section>"
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
    items = sorted(a.hicache.items())
    more = ""
    if len(items) > MAX_TABLE_ROWS:  # alarms first, then the most calls; shown in the usual order
        kept = sorted(items, key=lambda item: (not _alarm(item[0][0], item[0][2]), -item[1]))[:MAX_TABLE_ROWS]
        more = f'<p class="note">... and {len(items) - MAX_TABLE_ROWS:,} more rows (see `diff --json`).</p>'
        items = sorted(kept)
    for (pool, direction, branch), n in items:
        rows.append(
            f'<tr{" class=alarm" if _alarm(pool, branch) else ""}><td>{_c(pool, 120)}</td><td>{_c(direction, 120)}</td>'
            f'<td>{_c(branch, 120)}</td><td>{n:,}</td>'
            f'<td style="text-align:left"><span class="bar" style="width:{max(1, round(n / peak * 300))}px"></span></td></tr>'
        )
    return (
        '<section id="hicache"><h2>HiCache branches</h2><p class="note">Copy calls per host pool, direction and '
        "branch. A token-granular branch on an indexer pool (red) applies the C4 row geometry to rows that "
        "are not C4 rows.</p><table><tr><th>pool</th><th>direction</th><th>branch</th><th>calls</th><th></th></tr>"
        + "".join(rows)
        + f"</table>{more}</section>"
    )


def _alarm(pool: str, branch: str) -> bool:
    return branch.startswith("token") and "indexer" in pool


def _hicache_roundtrip(a: Analysis) -> str:
    """Host rows round-trip mode found broken at a load (docs/diagnosis.md)."""
    if not a.roundtrip_n:
        return ""
    rows = []
    for d in a.roundtrip[:200]:
        checks = d.get("checks") or {}
        listed, more_events = _more(d.get("events") or (), 16)
        events = (" &rarr; ".join(_c(str(e.get("event")), 80) for e in listed) + more_events) or "-"
        rows.append(
            f"<tr class=alarm><td>{_c(str(d.get('pool')), 120)}</td><td>{d.get('host_row')}</td><td>{d.get('layer')}</td>"
            f"<td>{_e(str(d.get('device_page', '-')))}</td>"
            + "".join(f"<td>{_e(str(checks.get(leg, '-')))}</td>" for leg in ("d2h", "host", "h2d"))
            + f'<td style="text-align:left">{events}</td></tr>'
        )
    summary = "; ".join(summarise_roundtrip(a.roundtrip))
    more = f"<p class=note>... {a.roundtrip_n:,} in all (see diff --json).</p>" if a.roundtrip_n > len(rows) else ""
    return (
        f'<section id="hicache-roundtrip"><h2>HiCache round trip ({a.roundtrip_n:,} broken host row{"s" if a.roundtrip_n != 1 else ""})</h2>'
        f'<p class="note">{_c(summary, 2000)}. Checks per host row: d2h (matched its device rows at backup), host '
        "(unchanged while resident), h2d (copied faithfully by the load); the events are the journal's for "
        "the device page the row was loaded into, the last one the load.</p><table><tr><th>pool</th>"
        "<th>host row</th><th>layer</th><th>device page</th><th>d2h</th><th>host</th><th>h2d</th><th>page events</th></tr>"
        + "".join(rows)
        + f"</table>{more}</section>"
    )


def _bad_lines(a: Analysis) -> str:
    if not a.n_errors:
        return ""
    items = "".join(f"<li><code>{_c(m, 500)}</code></li>" for m in a.errors[:200])
    more = f"<p class=note>... and {a.n_errors - 200:,} more.</p>" if a.n_errors > 200 else ""
    return f'<section id="bad-lines"><h2>Skipped lines ({a.n_errors:,})</h2><ul>{items}</ul>{more}</section>'


def render(analysis: Analysis, *, title: str = "dsv4-idxk-probe report", max_rooms: int = 50) -> str:
    """The page, at most about MAX_REPORT_BYTES: every section but the room blocks is
    bounded by its own caps, and room blocks are drawn while the page stays under it."""
    files, more = _more(analysis.files, MAX_INPUTS_LISTED)
    inputs = "".join(f"<li><code>{_c(f, 500)}</code></li>" for f in files) + (f"<li>{more}</li>" if more else "")
    head = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_c(title, 300)}</title>'
        f"<style>{_CSS}</style></head><body><h1>{_c(title, 300)}</h1>"
        f'<p class="note">Generated {_e(_utc(time.time()))} from {len(analysis.files)} room logs.</p>'
    )
    summary, timeline, hicache, bad_lines = _summary(analysis), _timeline(analysis), _hicache(analysis), _bad_lines(analysis)
    tail = f"{bad_lines}<details><summary>Inputs</summary><ul>{inputs}</ul></details></body></html>\n"
    budget = MAX_REPORT_BYTES - sum(map(_size, (head, summary, timeline, hicache, tail)))
    return f"{head}{summary}{_bad_rooms(analysis, max_rooms, budget)}{timeline}{hicache}{tail}"
