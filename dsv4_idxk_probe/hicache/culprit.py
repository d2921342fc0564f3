"""Round-trip mode's answer to "what broke this host row, and which operation wrote it
into a device page" (docs/diagnosis.md, "Round-trip diagnosis").

A load's round-trip checks come per (host row, layer): `d2h` (did the row match its
device rows when it was backed up), `host` (is it still what was backed up), `h2d`
(did the load copy it faithfully). The page journal's `hicache_load` event keeps one
verdict per leg and host row for the whole load, merged over its per-layer calls
(`merge`), with the layers where a leg failed. For each host row a load found
broken, the probe emits one `roundtrip_diagnosis` record (`record`): the pool, the
host row, the device page it was loaded into, the checks, the leg to blame (the
first that failed, in the row's order of life: backup, residence, load), and the
journal events of that device page, the last of them the load itself.

Plain data in and out; no SGLang, no torch.
"""

from __future__ import annotations

from typing import Any

from .legs import LEG_NAMES, LEGS

_RANK = {"match": 0, "unverified": 1, "mismatch": 2}


def merge(into: dict[int, dict], layer_checks: dict[int, dict[str, str]], layer: int | None) -> None:
    """Fold one layer's per-host-row checks into a load's: the worst verdict per leg
    (mismatch over unverified over match), and under `layers` the layers where any leg
    mismatched."""
    for row, checks in layer_checks.items():
        kept = into.setdefault(row, {})
        for leg in LEGS:
            now = checks.get(leg)
            if now is not None and _RANK.get(now, 0) >= _RANK.get(kept.get(leg), -1):
                kept[leg] = now
        if layer is not None and "mismatch" in checks.values():
            layers = kept.setdefault("layers", [])
            if layer not in layers:
                layers.append(layer)


def culprit_leg(checks: dict[str, str]) -> str | None:
    """The first leg that mismatched, in the order the row lived them; None if none did."""
    return next((leg for leg in LEGS if checks.get(leg) == "mismatch"), None)


def record(pool: str, host_row: int, device_page: int | None, layer: int, checks: dict[str, str],
           events: list[dict]) -> dict[str, Any]:
    """The `roundtrip_diagnosis` record of one broken (host row, layer) of a load."""
    leg = culprit_leg(checks)
    return {
        "event": "roundtrip_diagnosis", "pool": pool, "host_row": host_row, "device_page": device_page,
        "layer": layer, "leg": leg, "leg_name": LEG_NAMES.get(leg, ""),
        "checks": {k: checks[k] for k in LEGS if k in checks},
        "events": events,
    }


def describe(diag: dict) -> str:
    """One line for an operator: what the row became, whether it matched at backup, and
    the last operation on the device page it went to."""
    checks = diag.get("checks") or {}
    leg = diag.get("leg")
    what = {
        "d2h": "the backup (device-to-host copy) wrote different bytes",
        "host": "changed in host memory while resident",
        "h2d": "the load (host-to-device copy) wrote different bytes",
    }.get(leg, "no leg mismatched")
    backup = {"match": "matched at backup", "mismatch": "differed at backup",
              "unverified": "not compared at backup"}.get(checks.get("d2h"), "not compared at backup")
    page = diag.get("device_page")
    line = f"{diag.get('pool')} host row {diag.get('host_row')} layer {diag.get('layer')}: {what}"
    if leg != "d2h":
        line += f" ({backup})"
    if page is not None:
        line += f"; loaded into device page {page}"
    events = diag.get("events") or ()
    if events:
        line += f", last event {events[-1].get('event')}"
    return line


def summarise(diagnoses: list[dict]) -> list[str]:
    """Lines such as "2 host rows changed in host memory while resident (matched at backup),
    last event hicache_load", by (leg, backup verdict, last event)."""
    counts: dict[tuple, int] = {}
    for d in diagnoses:
        events = d.get("events") or ()
        key = (d.get("leg"), (d.get("checks") or {}).get("d2h"), events[-1].get("event") if events else None)
        counts[key] = counts.get(key, 0) + 1
    what = {"d2h": "written wrong by the backup", "host": "changed in host memory while resident",
            "h2d": "written wrong by the load"}
    lines = []
    for (leg, backup, last), n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        line = f"{n} host row{'s' if n != 1 else ''} {what.get(leg, 'with no mismatching leg')}"
        if leg != "d2h":
            line += f" ({'matched' if backup == 'match' else 'not compared' if backup != 'mismatch' else 'differed'} at backup)"
        if last:
            line += f", last event {last}"
        lines.append(line)
    return lines
