"""Did the probe find what the rig did, and nothing else?

Runs the product's `diff` over the run's room logs (its JSON is the
evidence), then checks three things against what the rig knows:

* every injected fault whose change reached frozen bytes is reported at the
  stage the timing rules predict, localised to its (layer, page, segment);
* every mismatch the diff reports is explained by an injected fault;
* every probe verdict agrees with the rig's byte-level oracle, stage by stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...offline.diff_output import exit_status, write_json
from ...offline.join import DECISIVE, analyse
from ...roomlog.reader import expand_inputs

STAGE_RANK = {"decode_recv": 0, "decode_step": 1, "decode_finish": 2}


def stage_key(stage: str, step: int | None, transfer: int = 0) -> tuple[int, int, int]:
    """Order of a digest point: transfer (a rebootstrapped room is sent again), stage, step."""
    return transfer, STAGE_RANK[stage], step or 0


def _transfer(transfers: dict, room: int, tokens: int | None) -> int:
    """Which transfer of `room` had `tokens` tokens (the diff lists them for rooms sent more than once)."""
    sent = transfers.get(room) or []
    return sent.index(tokens) if tokens in sent else 0


def stage_label(stage: str | None, step: int | None) -> str:
    if stage is None:
        return "-"
    return f"{stage}@{step}" if step is not None else stage


@dataclass
class FaultCheck:
    """One (fault, room): what it changed, where the probe had to see it, what it saw."""

    record: dict
    expected: list[dict]  # effects with visible changes: room, layers, page, segments, stage, step
    seen: str = "-"
    localised: str = "-"
    diagnosed: str = "-"  # what the probe said the bytes became, where the rig expects a diagnosis
    ok: bool = False
    note: str = ""

    @property
    def label(self) -> str:
        r = self.record
        when = f"after_step {r['after_step']}" if r["when"] == "after_step" else r["when"]
        return f"#{r['fault']} {r['name']}: {r['kind']} @ {when}"


@dataclass
class Verification:
    diff_status: int
    diff_json: Path
    checks: list[FaultCheck] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    oracle_checked: int = 0
    oracle_disagreements: list[str] = field(default_factory=list)
    unfinished: list[int] = field(default_factory=list)  # planned rooms without a decode_finish verdict
    verdicts: dict = field(default_factory=dict)
    # digest points where decode's own verdict (what its log, metrics and alerts said) is not the
    # one the diff recomputes from both sides' digests: the checks above judge the diff's
    live_disagreements: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        applied = [c for c in self.checks if c.record["applied"]]
        return all(c.ok for c in applied) and not (self.unexplained or self.oracle_disagreements or self.unfinished
                                                   or self.live_disagreements)


def run_diff(log_dir: Path) -> tuple[int, dict]:
    """The diff over every log in `log_dir`, through its JSON output (written next to the logs)."""
    analysis = analyse(expand_inputs([str(log_dir)]))
    status = exit_status(analysis)
    out = Path(log_dir) / "diff.json"
    write_json(analysis, str(out), status)
    return status, json.loads(out.read_text())


def verify(log_dir: Path, faults: list[dict], oracle: list[dict], planned: list[int],
           only_rooms: set[int] | None = None) -> Verification:
    """`only_rooms`: judge only these rooms (servers shared by several runs log others too)."""
    status, doc = run_diff(log_dir)
    rooms = {int(r["room"]): r for r in doc["rooms"] if r["attempt"] == 0}
    verdicts = doc["summary"]["room_verdicts"]
    if only_rooms is not None:
        rooms = {room: r for room, r in rooms.items() if room in only_rooms}
        verdicts = {}
        for r in rooms.values():
            verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
        status = 1 if verdicts.get("mismatch") else 0
    result = Verification(status, Path(log_dir) / "diff.json", verdicts=verdicts)
    stages = {room: {stage_key(s["stage"], s["step"], s.get("transfer", 0)): s for s in r["stages"]}
              for room, r in rooms.items()}
    transfers = {room: r.get("transfers") for room, r in rooms.items()}
    faults = [dict(f, effects=[dict(e, transfer=_transfer(transfers, e["room"], e.get("tokens"))) for e in f["effects"]])
              for f in faults]
    oracle = [dict(o, transfer=_transfer(transfers, o["room"], o.get("n_tokens"))) for o in oracle]
    earliest = _earliest(faults)
    roundtrip = doc["summary"].get("hicache_roundtrip", {}).get("rows", [])
    result.checks = [_check_fault(rec, stages, earliest, roundtrip)
                     for rec in sorted(faults, key=lambda f: (f["fault"], f["room"] or 0))]
    result.unexplained = _unexplained(stages, faults)
    result.oracle_checked, result.oracle_disagreements = _against_oracle(stages, oracle, _upstream(faults))
    result.unfinished = sorted(
        room for room in planned if not any(k[1:] == stage_key("decode_finish", None)[1:] for k in stages.get(room, {}))
    )
    result.live_disagreements = [
        f"room {room} {s['stage']} step {s['step']}: decode said {s['live_verdict']}, the digests say {s['verdict']}"
        for room, r in sorted(rooms.items()) for s in r["stages"]
        if s.get("live_verdict") in DECISIVE and s["verdict"] in DECISIVE and s["live_verdict"] != s["verdict"]
    ]
    return result


def _cells(localisation: dict | None) -> set[tuple[int, int, str]]:
    """The (layer, page, segment) cells a localisation bounds."""
    if not localisation:
        return set()
    return {(int(layer), int(page), seg) for layer, seg in localisation["layer_segments"] for page in localisation["pages"]}


def _effect_cells(effect: dict) -> set[tuple[int, int, str]]:
    return {(layer, effect["page"], seg) for layer in effect["layers"] for seg in effect["segments"]}


def _check_fault(record: dict, stages: dict, earliest: dict, roundtrip: list[dict] = ()) -> FaultCheck:
    """`earliest`: (room, cell) -> the earliest expected stage of any fault changing that cell;
    `roundtrip`: the diff's HiCache round-trip diagnoses (checked for an in_host_pool fault)."""
    visible = [e for e in record["effects"] if e["stage"] is not None]
    check = FaultCheck(record, visible)
    if not record["applied"]:
        check.note = f"not applied: {record['reason']}"
        check.ok = True
        return check
    if not visible:
        check.note = "changed no frozen byte, or only a page already sent: must not be reported"
        touched = {(layer, e["page"]) for e in record["effects"] for layer in e["layers"]}
        rooms = {e["room"] for e in record["effects"]} or {record["room"]}
        reported = any(
            (c[0], c[1]) in touched for room in rooms for s in stages.get(room, {}).values() for c in _cells(s.get("localisation"))
        )
        check.ok = not reported
        check.seen = "REPORTED" if reported else "not reported"
        if record.get("roundtrip"):
            _check_roundtrip(check, record, roundtrip, reported)
        return check
    problems, seen, where, diagnosed = [], [], [], []
    for effect in visible:
        room_stages = stages.get(effect["room"], {})
        want = stage_key(effect["stage"], effect["step"], effect.get("transfer", 0))
        cells = _effect_cells(effect)
        # a cell another fault changed earlier may show before this fault's own stage
        allowed = min(earliest.get((effect["room"], c), want) for c in cells)
        hits = sorted(k for k, s in room_stages.items() if cells <= _cells(s.get("localisation")))
        if want not in hits:
            problems.append(f"room {effect['room']}: not reported at {stage_label(effect['stage'], effect['step'])}")
        elif effect.get("diagnosis") is not None:
            said, problem = _diagnosis_check(effect, room_stages[want].get("diagnosis"))
            diagnosed.append(said)
            if problem:
                problems.append(f"room {effect['room']}: {problem}")
        if not hits:
            continue
        first = room_stages[hits[0]]
        seen.append(stage_label(first["stage"], first["step"]))
        loc = first["localisation"]
        where.append(f"room {effect['room']} L{_join(loc['layers'])} P{_join(loc['pages'])} {','.join(loc['segments'])}")
        if not allowed <= hits[0] <= want:
            problems.append(
                f"room {effect['room']}: first seen at {seen[-1]}, expected {stage_label(effect['stage'], effect['step'])}"
            )
    check.seen = "; ".join(dict.fromkeys(seen)) or "-"
    check.localised = "; ".join(dict.fromkeys(where)) or "-"
    check.diagnosed = "; ".join(dict.fromkeys(diagnosed)) or "-"
    check.ok = not problems
    check.note = "; ".join(problems)
    return check


def _check_roundtrip(check: FaultCheck, record: dict, rows: list[dict], reported: bool) -> None:
    """An in_host_pool fault: no digest point may report it (both sides digest the changed
    bytes), the oracle must see them on decode (the load carried them into the room), and
    round-trip mode must name the host row, say it matched at backup and blame the leg
    expected, with the load into the device page as that page's last journal event."""
    from ...hicache.culprit import describe

    problems = ["a digest point reported it, though both sides digest the changed bytes"] if reported else []
    if not any(e.get("oracle_stage") for e in record["effects"]):
        problems.append("the oracle never saw the changed bytes on decode (the load did not carry them)")
    said = []
    for want in record["roundtrip"]:
        label = f"host row {want['host_row']} layer {want['layer']}"
        hit = next((r for r in rows if (r.get("pool"), r.get("host_row"), r.get("layer")) ==
                    (want["pool"], want["host_row"], want["layer"])), None)
        if hit is None:
            problems.append(f"round trip did not report {label}")
            continue
        said.append(describe(hit))
        last = (hit.get("events") or [{}])[-1]
        if hit.get("leg") != want["leg"]:
            problems.append(f"{label}: blamed on {hit.get('leg')}, expected {want['leg']}")
        if (hit.get("checks") or {}).get("d2h") != want["at_backup"]:
            problems.append(f"{label}: {(hit.get('checks') or {}).get('d2h')} at backup, expected {want['at_backup']}")
        if hit.get("device_page") != want["device_page"]:
            problems.append(f"{label}: loaded into device page {hit.get('device_page')}, expected {want['device_page']}")
        if (last.get("event"), last.get("host_row"), last.get("pool")) != ("hicache_load", want["host_row"], want["pool"]) or \
                (last.get("host_row_checks") or {}).get(want["leg"]) != "mismatch":
            problems.append(f"{label}: the device page's last journal event is not its load with the row's checks")
    check.seen = "; ".join(["round trip"] + [f"host row {w['host_row']}" for w in record["roundtrip"]])
    check.localised = "-"
    check.diagnosed = "; ".join(said) or "-"
    check.ok = not problems
    check.note = "; ".join(problems)


def _upstream(faults: list[dict]) -> dict[int, set]:
    """room -> cells changed before prefill's digest: the oracle sees them, no digest may."""
    out: dict[int, set] = {}
    for record in faults:
        for e in record["effects"]:
            if e.get("upstream"):
                out.setdefault(e["room"], set()).update(_effect_cells(e))
    return out


def _diagnosis_check(effect: dict, cells: list[dict] | None) -> tuple[str, str]:
    """(what the probe said of the effect's cell, a problem or ""): the kind must be the one
    the rig's bytes show, and a named culprit room must be among the rooms the probe names."""
    want = effect["diagnosis"]
    layer, page, segment = effect["layers"][0], effect["page"], effect["segments"][0]
    cell = next((c for c in cells or () if (c.get("layer"), c.get("page"), c.get("segment")) == (layer, page, segment)),
                None)
    label = f"L{layer} P{page} {segment}"
    if cell is None:
        return f"{label} undiagnosed", f"{label}: no diagnosis, expected {want['kind']}"
    rooms = [r.get("room") for r in cell.get("rooms") or ()]
    said = cell["kind"] + (f" {rooms[0]}" if rooms and want.get("room") not in rooms else
                           f" {want['room']}" if want.get("room") in rooms else "")
    events = cell.get("events") or ()
    if events:  # the last operation on the page before the bad digest
        said += f" after {events[-1].get('event')}"
    if cell["kind"] != want["kind"]:
        return said, f"{label}: diagnosed {cell['kind']}, expected {want['kind']}"
    if want.get("room") is not None and want["room"] not in rooms:
        return said, f"{label}: {cell['kind']} names {rooms or 'no room'}, expected {want['room']}"
    return said, ""


def _earliest(faults: list[dict]) -> dict:
    out: dict = {}
    for record in faults:
        for e in record["effects"]:
            if e["stage"] is None:
                continue
            key = stage_key(e["stage"], e["step"], e.get("transfer", 0))
            for cell in _effect_cells(e):
                out[(e["room"], cell)] = min(out.get((e["room"], cell), key), key)
    return out


def _unexplained(stages: dict, faults: list[dict]) -> list[str]:
    """Mismatching cells at a stage that no change made by then accounts for."""
    explained: dict[int, list[tuple[tuple[int, int], set]]] = {}
    for record in faults:
        for e in record["effects"]:
            if e["stage"] is not None:
                explained.setdefault(e["room"], []).append((stage_key(e["stage"], e["step"], e.get("transfer", 0)),
                                                            _effect_cells(e)))
    out = []
    for room, by_key in sorted(stages.items()):
        for key, s in sorted(by_key.items()):
            if s["verdict"] in ("match", "skipped"):
                continue
            if s["verdict"] != "mismatch":
                out.append(f"room {room} {stage_label(s['stage'], s['step'])}: {s['verdict']} ({s.get('reason', '')})")
                continue
            known = set().union(*[c for k, c in explained.get(room, []) if k <= key] or [set()])
            loc = s.get("localisation") or {}
            layer_segs = {(int(l), seg) for l, seg in loc.get("layer_segments", [])}
            pages = {int(p) for p in loc.get("pages", [])}
            if not known or not layer_segs <= {(c[0], c[2]) for c in known} or not pages <= {c[1] for c in known}:
                out.append(f"room {room} {stage_label(s['stage'], s['step'])}: mismatch that no injected fault explains")
    return out


def _against_oracle(stages: dict, oracle: list[dict], upstream: dict | None = None) -> tuple[int, list[str]]:
    """Probe verdict and localisation versus the oracle's frozen-byte comparison, per digest point.
    `upstream` (room -> cells changed before prefill's digest): cells the probe must call intact."""
    bad = []
    for o in oracle:
        s = stages.get(o["room"], {}).get(stage_key(o["stage"], o["step"], o.get("transfer", 0)))
        label = f"room {o['room']} {stage_label(o['stage'], o['step'])}"
        if s is None:
            bad.append(f"{label}: no probe record")
            continue
        cells = {tuple(c) for c in o["cells"]} - (upstream or {}).get(o["room"], set())
        if not cells:
            if s["verdict"] != "match":
                bad.append(f"{label}: oracle says intact, probe says {s['verdict']}")
            continue
        loc = s.get("localisation")
        if s["verdict"] != "mismatch" or loc is None:
            bad.append(f"{label}: oracle sees {len(cells)} changed cells, probe says {s['verdict']}")
            continue
        want_ls = {(c[0], c[2]) for c in cells}
        want_pages = {c[1] for c in cells}
        got_ls = {(int(l), seg) for l, seg in loc["layer_segments"]}
        if got_ls != want_ls or set(loc["pages"]) != want_pages:
            bad.append(f"{label}: probe localises {sorted(got_ls)} pages {loc['pages']}, oracle {sorted(want_ls)} pages {sorted(want_pages)}")
    return len(oracle), bad


def _join(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def as_json(v: Verification) -> dict[str, Any]:
    return {
        "ok": v.ok,
        "diff_status": v.diff_status,
        "diff_json": str(v.diff_json),
        "faults": [
            {"fault": c.label, "room": c.record["room"], "applied": c.record["applied"], "ok": c.ok, "seen": c.seen,
             "localised": c.localised, "diagnosed": c.diagnosed, "expected": c.expected, "note": c.note}
            for c in v.checks
        ],
        "unexplained": v.unexplained,
        "oracle_checked": v.oracle_checked,
        "oracle_disagreements": v.oracle_disagreements,
        "unfinished_rooms": v.unfinished,
        "room_verdicts": v.verdicts,
    }
