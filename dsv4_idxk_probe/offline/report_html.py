"""The `report` page: one self-contained HTML file (inline CSS and SVG, no scripts,
nothing fetched), so it can be mailed, attached to an incident, or opened offline.

Sections: summary; an index of the bad rooms (numeric order within each
verdict, each a link to its block, with wall time and decode instance); a
cross-room (layer x page bucket) heat of where rooms first diverged; each bad
room with when, which pod, both sides' rids, one (layer x page) heatmap, of the
first stage that saw the difference, the stages listed, and what to check next
(`next_steps.py`); corrupt rooms over time per instance against request volume;
HiCache branch counts; skipped lines. Every string from the logs is escaped
(HTML, and `printable`: controls, bidi overrides, lone surrogates); the page's
frame and the next-steps tables are jinja2 templates with autoescape. Readable in
an 800 px window: wide tables scroll in their own box, pictures scale down.

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
from .next_steps import next_steps
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
MIN_CELL_PX = 4  # a red block is drawn at least this wide: one bad page of 512 stays visible scaled to 800 px
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
tr.alarm .bar{background:#d62728}code{font-size:12px;overflow-wrap:anywhere}
h1,p,li{overflow-wrap:anywhere}svg{max-width:100%;height:auto}
.index{max-width:100%;box-sizing:border-box}.scroll{max-width:100%;overflow-x:auto}
td{overflow-wrap:anywhere}table.next td{text-align:left}
@media (max-width:900px){body{margin:12px}.rooms .room{flex-basis:100%}}
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
        f"<div class=\"scroll\"><table><tr><th>stage</th>{head}</tr>{''.join(rows)}</table></div>"
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
        f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg" role="img">',
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
                f'<rect class="cell" x="{left + c0 * cw}" y="{top + r0 * ch}" width="{max(MIN_CELL_PX, (c1 - c0 + 1) * cw)}" '
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


def _key(room: RoomResult) -> tuple:
    return (room.room, room.attempt, room.cluster) if room.cluster else (room.room, room.attempt)


def _instance(a: Analysis, room: RoomResult) -> str:
    """The instance (host:pid) that logged the room's decode records (`Analysis.room_meta`)."""
    meta = a.room_meta.get(_key(room))
    return meta[0] if meta and meta[0] else "-"


def _wall(room: RoomResult) -> str:
    """When: the first divergence's wall time, else the room's first decode record's (UTC)."""
    first = room.first_divergence
    if first is not None and first.ts is not None:
        return _utc(first.ts)
    times = [s.ts for s in room.stages if s.ts is not None]
    return _utc(min(times)) if times else "-"


def _who(a: Analysis, room: RoomResult) -> str:
    """Wall time, pod (instance) and both sides' request ids: what the other logs are searched by."""
    return (f"at <b>{_e(_wall(room))}</b> on decode instance <b>{_c(_instance(a, room), 300)}</b>; "
            f"decode rid <code>{_c(room.decode_rid or '-', 300)}</code>, partner (prefill) rid "
            f"<code>{_c(room.prefill_rid or '-', 300)}</code>")


_NEXT = None


def _next_table(room: RoomResult) -> str:
    """What to check next for the kinds of the room's bad cells (offline/next_steps.py,
    docs/diagnosis.md), rendered by jinja2 with autoescape."""
    global _NEXT
    if room.verdict != "mismatch":
        return ""
    if _NEXT is None:
        import jinja2

        _NEXT = jinja2.Environment(autoescape=True).from_string(
            '<details class="next"><summary>what to check next ({{ rows|map("first")|join(", ") }})</summary>'
            '<div class="scroll"><table class="next"><tr><th>diagnosis</th><th>suspect</th><th>what to check next</th></tr>'
            "{% for kind, suspect, evidence in rows %}<tr><td>{{ kind }}</td><td>{{ suspect }}</td>"
            "<td>{{ evidence }}</td></tr>{% endfor %}</table></div></details>")
    first = room.first_divergence
    kinds = [cell.get("kind") for cell in (first.diagnosis or ())] if first is not None else []
    return _NEXT.render(rows=next_steps(kinds))


def _room_block(room: RoomResult, a: Analysis | None = None) -> str:
    """One room: its verdict, when, where and which requests, the stages in order, and
    ONE heatmap, of the first stage that saw the difference (later stages are listed,
    and say when they localise differently), then what to check next. Lists are cut
    at MAX_LISTED, texts at MAX_TEXT."""
    first = room.first_divergence
    intact = room.last_match_before_divergence
    cluster = f" cluster {_c(room.cluster)}" if room.cluster else ""
    line = f"<b>room {_c(room.room, 300)} attempt {room.attempt}{cluster}</b>: {_e(room.verdict)}"
    if first is not None:
        line += f"; first divergence at <b>{_e(first.label)}</b>"
        line += f" (intact at {_e(intact.label)})" if intact else ""
    ordered = room.ordered
    shown, more = _more(ordered, MAX_LISTED)
    stages = ", ".join(f"{_e(s.label)} {_e(s.verdict)}" for s in shown) + more
    body = [f'<div class="room{"" if room.verdict == "mismatch" else " other"}" id="{_anchor(room)}">',
            f"<p>{line}</p>", f'<p class="note">{_who(a if a is not None else Analysis(), room)}; stages: {stages}</p>']
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
        body.append(f'<div class="scroll">{_diagnosis_table(first.diagnosis)}</div>')
    body.append(_next_table(room))
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


def _index(bad: list[RoomResult], drawn: int, a: Analysis | None = None) -> str:
    a = a if a is not None else Analysis()
    rows = []
    for i, room in enumerate(bad[:MAX_INDEX_ROWS]):
        first = room.first_divergence
        c = first.comparison if first is not None else None
        name = _c(room.name, 100)
        link = f'<a href="#{_anchor(room)}">{name}</a>' if i < drawn else name
        rows.append(
            f"<tr><td>{link}</td><td>{_e(_wall(room))}</td><td>{_c(_instance(a, room), 120)}</td>"
            f"<td>{_c(', '.join(room.rids) or '-')}</td><td>{_e(room.verdict)}</td>"
            f"<td>{_e(first.label) if first else '-'}</td><td>{_c(_ranges(c.layers), 120) if c else '-'}</td>"
            f"<td>{_c(_ranges(c.pages), 120) if c else '-'}</td><td>{_c(', '.join(c.segments[:50]), 120) if c else '-'}</td>"
            f"<td>{_c(describe_room(first.diagnosis or ())) if first else '-'}</td></tr>"
        )
    more = f'<p class="note">... and {len(bad) - MAX_INDEX_ROWS:,} more (see `diff --json`).</p>' if len(bad) > MAX_INDEX_ROWS else ""
    return (
        '<div class="index"><table><tr><th>room/attempt</th><th>wall time</th><th>decode instance</th><th>rid</th>'
        '<th>verdict</th><th>first divergence</th>'
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
    budget -= _size(_index(bad, len(wanted), a)) + _size(cross) + 2048  # the index as it would be with every link
    blocks: list[str] = []
    for room in wanted:
        block = _room_block(room, a)
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
        f'<section id="bad-rooms"><h2>Rooms that did not match</h2><p class="note">{note}.</p>{_index(bad, drawn, a)}'
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
    parts = [f'<svg class="crossheat" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             'xmlns="http://www.w3.org/2000/svg" role="img">',
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


# %% corrupt rooms over time, per instance, against request volume

MAX_TIMELINE_INSTANCES = 12  # strips drawn; the rest are added up in one "other instances" strip
TIMELINE_WIDTH = 640  # drawing width: the page stays readable in an 800 px window
OUTLIER_SHARE = 0.005  # rooms this far out on either side may be left off an axis they would stretch


def _room_times(a: Analysis):
    """(start, instance, corrupt at) per room: its first decode record's time, the instance that
    logged it, and its first divergence's time when it mismatched (None otherwise). The fleet
    engine's clean rooms come as stubs of (ts, instance), verdict match."""
    meta = a.room_meta
    for item in a.rooms.values():
        if isinstance(item, RoomResult):
            times = [s.ts for s in item.stages if s.ts is not None]
            if not times:
                continue
            first = item.first_divergence if item.verdict == "mismatch" else None
            bad = (first.ts if first.ts is not None else min(times)) if first is not None else None
            m = meta.get(_key(item))
            yield min(times), (m[0] if m else ""), bad
        else:  # a chunk of clean rooms (fleet engine): one stub per room
            for stub in item.stages:
                if stub.ts is not None:
                    yield stub.ts, getattr(stub, "instance", "") or "", None


def _axis(times: list[float]) -> tuple[float, float, int]:
    """The time axis: every room's start, unless a few (a clock off, a record from another day)
    would stretch it more than tenfold: then the central rooms, and how many are left off."""
    times = sorted(times)
    t0, t1 = times[0], times[-1]
    k = int(len(times) * OUTLIER_SHARE)
    if k:
        c0, c1 = times[k], times[-1 - k]
        margin = 2 * max(c1 - c0, 1.0)
        if (t1 - t0) > 10 * max(c1 - c0, 1.0):
            kept = [t for t in times if c0 - margin <= t <= c1 + margin]
            return kept[0], kept[-1], len(times) - len(kept)
    return t0, t1, 0


def _nice(peak: int) -> int:
    """The y axis's top: 1, 2 or 5 times a power of ten, at least `peak`."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if m * step >= peak:
                return m * step
        step *= 10


def _timeline(a: Analysis) -> str:
    """Per instance (the pod and process that logged the rooms' decode records), rooms started
    (grey: request volume) and corrupt rooms (red: their first divergence) per time bucket, with
    a y axis of readable ticks; at most MAX_TIMELINE_INSTANCES strips (the busiest, then the rest
    added up)."""
    rows = list(_room_times(a))
    title = "<h2>Corrupt rooms over time, per instance, against request volume</h2>"
    if not rows:
        return f'<section id="timeline">{title}<p>No timestamps in the logs.</p></section>'
    t0, t1, left_off = _axis([t for t, _, _ in rows])
    span = max(t1 - t0, 1e-9)
    volume: dict[str, list[int]] = {}
    corrupt: dict[str, list[int]] = {}
    totals: Counter = Counter()
    bad_totals: Counter = Counter()

    def bucket(t: float) -> int | None:
        if t < t0 or t > t1:
            return None
        return min(TIME_BUCKETS - 1, int((t - t0) / span * TIME_BUCKETS))

    for start, instance, bad in rows:
        totals[instance] += 1
        i = bucket(start)
        if i is not None:
            volume.setdefault(instance, [0] * TIME_BUCKETS)[i] += 1
        if bad is not None:
            bad_totals[instance] += 1
            j = bucket(bad)
            if j is not None:
                corrupt.setdefault(instance, [0] * TIME_BUCKETS)[j] += 1
    order = sorted(totals, key=lambda n: (-bad_totals[n], -totals[n], n))
    shown, rest = order[:MAX_TIMELINE_INSTANCES], order[MAX_TIMELINE_INSTANCES:]
    strips = [(name, volume.get(name, [0] * TIME_BUCKETS), corrupt.get(name, [0] * TIME_BUCKETS)) for name in shown]
    if rest:
        add = lambda table: [sum(table.get(n, [0] * TIME_BUCKETS)[i] for n in rest) for i in range(TIME_BUCKETS)]
        strips.append((f"{len(rest):,} other instances", add(volume), add(corrupt)))
    bw = TIMELINE_WIDTH / TIME_BUCKETS
    left, h, gap, head = 48, 56, 30, 14
    height = len(strips) * (h + gap) + 40
    width = left + TIMELINE_WIDTH + 8
    parts = [f'<svg class="timeline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
             'xmlns="http://www.w3.org/2000/svg" role="img">']
    for k, (name, vol, bad) in enumerate(strips):
        top = k * (h + gap) + head
        label = name if k < len(shown) else name
        n_bad = sum(bad)
        parts.append(f'<text x="{left}" y="{top - 4}" font-size="11"><tspan font-weight="bold">'
                     f"{_c(label or '(no instance)', 80)}</tspan>: {sum(vol):,} rooms, "
                     f'<tspan fill="{VERDICT_COLOURS["mismatch"]}">{n_bad:,} corrupt</tspan></text>')
        top_value = _nice(max(max(vol), max(bad), 1))
        for value in (0, top_value // 2, top_value) if top_value >= 2 else (0, top_value):
            y = top + h - value / top_value * h
            parts.append(f'<line x1="{left - 3}" y1="{y:.1f}" x2="{left + TIMELINE_WIDTH}" y2="{y:.1f}" stroke="#e3e3e3"/>')
            parts.append(f'<text class="ytick" x="{left - 5}" y="{y + 3:.1f}" font-size="10" text-anchor="end">{value:,}</text>')
        for i in range(TIME_BUCKETS):
            x = left + i * bw
            if vol[i]:
                vh = vol[i] / top_value * h
                parts.append(f'<rect x="{x:.1f}" y="{top + h - vh:.1f}" width="{bw - 1:.1f}" height="{vh:.1f}" fill="#c7c7c7">'
                             f"<title>{vol[i]:,} rooms</title></rect>")
            if bad[i]:
                rh = max(3.0, bad[i] / top_value * h)
                parts.append(f'<rect class="corrupt" x="{x:.1f}" y="{top + h - rh:.1f}" width="{bw - 1:.1f}" '
                             f'height="{rh:.1f}" fill="{VERDICT_COLOURS["mismatch"]}"><title>{bad[i]:,} corrupt rooms'
                             "</title></rect>")
    base = (len(strips) - 1) * (h + gap) + head + h
    fmt = _tick_format(span)
    for k in range(TIME_TICKS + 1):
        x = left + k * TIMELINE_WIDTH / TIME_TICKS
        anchor = "start" if k == 0 else "end" if k == TIME_TICKS else "middle"
        parts.append(f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" stroke="#555"/>')
        parts.append(f'<text class="tick" x="{x:.1f}" y="{base + 16}" font-size="10" text-anchor="{anchor}">'
                     f"{_e(time.strftime(fmt, time.gmtime(t0 + span * k / TIME_TICKS)))}</text>")
    parts.append(f'<text x="{left + TIMELINE_WIDTH / 2}" y="{base + 32}" font-size="11" text-anchor="middle">'
                 f"time (UTC), from {_e(_utc(t0))} to {_e(_utc(t1))}</text>")
    parts.append("</svg>")
    off = (f" {left_off:,} rooms far outside the others' time range (a clock off, or another day's records) are "
           "left off the axis." if left_off else "")
    return (
        f'<section id="timeline">{title}<p class="note">Per instance that logged the rooms\' decode records: rooms '
        f"started (grey, the request volume) and corrupt rooms (red, at their first divergence) per "
        f"{span / TIME_BUCKETS:.3g} s bucket; each strip has its own scale.{off}</p>{''.join(parts)}</section>"
    )


# %% HiCache


def _hicache(a: Analysis) -> str:
    return _hicache_branches(a) + _hicache_restore(a) + _hicache_roundtrip(a)


def _hicache_restore(a: Analysis) -> str:
    """Loads restore verification found writing pages that differ from their backup (docs/hicache.md)."""
    if not a.restore_n:
        return ""
    rows = []
    for load in a.restore[:200]:
        for cell in load.get("cells", [])[:16]:
            rows.append(
                f"<tr class=alarm><td>{_c(str(load.get('pool')), 120)}</td><td>{_c(str(load.get('instance', '-')), 120)}</td>"
                + "".join(f"<td>{_e(str(cell.get(k, '-')))}</td>" for k in ("layer", "host_row", "device_page", "segment"))
                + "</tr>"
            )
    more = f"<p class=note>... {a.restore_n:,} loads in all (see diff --json).</p>" if a.restore_n > 200 else ""
    return (
        f'<section id="hicache-restore"><h2>HiCache restore ({a.restore_n:,} load{"s" if a.restore_n != 1 else ""} '
        "differing from the backup)</h2><p class=\"note\">Cells a load wrote that differ from what the backup of the "
        "same host row read: the host row changed while resident, or the load copied it wrong. The prefill log's "
        "record has the journal events of each device page.</p><div class=\"scroll\"><table><tr><th>pool</th>"
        "<th>instance</th><th>layer</th><th>host row</th><th>device page</th><th>segment</th></tr>"
        + "".join(rows)
        + f"</table></div>{more}</section>"
    )


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
        "are not C4 rows.</p><div class=\"scroll\"><table><tr><th>pool</th><th>direction</th><th>branch</th>"
        "<th>calls</th><th></th></tr>"
        + "".join(rows)
        + f"</table></div>{more}</section>"
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
        "the device page the row was loaded into, the last one the load.</p><div class=\"scroll\"><table><tr><th>pool</th>"
        "<th>host row</th><th>layer</th><th>device page</th><th>d2h</th><th>host</th><th>h2d</th><th>page events</th></tr>"
        + "".join(rows)
        + f"</table></div>{more}</section>"
    )


def _bad_lines(a: Analysis) -> str:
    if not a.n_errors:
        return ""
    items = "".join(f"<li><code>{_c(m, 500)}</code></li>" for m in a.errors[:200])
    more = f"<p class=note>... and {a.n_errors - 200:,} more.</p>" if a.n_errors > 200 else ""
    return f'<section id="bad-lines"><h2>Skipped lines ({a.n_errors:,})</h2><ul>{items}</ul>{more}</section>'


_PAGE_TEMPLATE = (
    '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>'
    "<style>{{ css }}</style></head><body><h1>{{ title }}</h1>"
    '<p class="note">Generated {{ generated }} from {{ n_files }} room logs.</p>'
    "{{ summary }}{{ bad_rooms }}{{ timeline }}{{ hicache }}{{ bad_lines }}"
    "<details><summary>Inputs</summary><ul>{% for f in files %}<li><code>{{ f }}</code></li>{% endfor %}"
    "{% if more %}<li>{{ more }}</li>{% endif %}</ul></details></body></html>\n"
)
_page = None


def _page_template():
    """The page's frame, rendered by jinja2 with autoescape: text from the logs (the title, file
    names) is escaped by the template; the sections come in as markup their builders escaped."""
    global _page
    if _page is None:
        import jinja2

        _page = jinja2.Environment(autoescape=True, keep_trailing_newline=True).from_string(_PAGE_TEMPLATE)
    return _page


def render(analysis: Analysis, *, title: str = "dsv4-idxk-probe report", max_rooms: int = 50) -> str:
    """The page, at most about MAX_REPORT_BYTES: every section but the room blocks is
    bounded by its own caps, and room blocks are drawn while the page stays under it."""
    from markupsafe import Markup

    files, more = _more(analysis.files, MAX_INPUTS_LISTED)
    values = {
        "title": clip(title, 300), "css": Markup(_CSS), "generated": _utc(time.time()), "n_files": len(analysis.files),
        "files": [clip(f, 500) for f in files], "more": more,
        "summary": Markup(_summary(analysis)), "timeline": Markup(_timeline(analysis)),
        "hicache": Markup(_hicache(analysis)), "bad_lines": Markup(_bad_lines(analysis)),
    }
    template = _page_template()
    budget = MAX_REPORT_BYTES - _size(template.render(values, bad_rooms=""))
    return template.render(values, bad_rooms=Markup(_bad_rooms(analysis, max_rooms, budget)))
