"""docs/observability.md says what the rules and the code define: every alert of alerts.yml is in
its Alerts table (and in the runbooks' index) with its severity, and its metric table and exchange
paragraph name every state and reason of `dsv4_idxk_probe_info`, every `records_dropped_total`
sink and every `exchange_errors_total` kind the code can count. Each check is also shown to catch
a planted omission."""

from __future__ import annotations

import re
from dsv4_idxk_probe.exchange.client import CLIENT_KINDS
from dsv4_idxk_probe.exchange.server import SERVER_KINDS
from dsv4_idxk_probe.metrics.definitions import DROP_SINKS, EXCHANGE_ERROR_KINDS, STATES

from tests.support.promql import REPO, alert_rules

DOC = REPO / "docs" / "observability.md"
RUNBOOK_INDEX = REPO / "docs" / "runbooks" / "README.md"
PACKAGE = REPO / "dsv4_idxk_probe"
ROW = re.compile(r"^\| `([^`]+)` \|(.*)\|\s*$", re.M)


def package_source() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted(PACKAGE.rglob("*.py")))


def code_sinks() -> set[str]:
    """DROP_SINKS (created at zero) and every sink a `records_dropped.labels(sink="...")` names."""
    found = re.findall(r"records_dropped\.labels\(\s*sink\s*=\s*[\"'](\w+)[\"']", package_source())
    return set(DROP_SINKS) | set(found)


def code_exchange_kinds() -> set[str]:
    """Every kind `exchange_errors_total` can carry: the server's and client's zero series, decode's,
    and the literals their counting calls name."""
    src = package_source()
    kinds = set(SERVER_KINDS) | set(CLIENT_KINDS) | set(EXCHANGE_ERROR_KINDS)
    kinds |= set(re.findall(r"exchange_errors\.labels\(\s*kind\s*=\s*[\"'](\w+)[\"']", src))
    exchange = "\n".join(p.read_text(encoding="utf-8") for p in sorted((PACKAGE / "exchange").glob("*.py")))
    kinds |= set(re.findall(r"\b_count\(\s*[\"'](\w+)[\"']", exchange))
    kinds |= set(re.findall(r"\b_fail\(\s*[\"'](\w+)[\"']", exchange))
    kinds |= {f"refused_{k}" for k in re.findall(r"\b_refuse\(\s*[\"'](\w+)[\"']", exchange)}
    return kinds


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def table(text: str) -> dict[str, list[str]]:
    """The rows of the markdown tables in `text` whose first cell is code: name -> other cells."""
    return {m[1]: [cell.strip() for cell in m[2].split("|")] for m in ROW.finditer(text)}


def metric_row(text: str, metric: str) -> str:
    rows = table(section(text, "Metrics"))
    assert metric in rows, f"docs/observability.md: no row for {metric}"
    return " | ".join(rows[metric])


def alert_drift(text: str) -> list[str]:
    """Alerts of alerts.yml missing from the Alerts table, rows for alerts that do not exist, and
    severities that differ."""
    rows = {name: cells for name, cells in table(section(text, "Alerts")).items() if name.startswith("Dsv4IdxkProbe")}
    rules = {rule["alert"]: rule["labels"]["severity"] for rule in alert_rules()}
    out = [f"{name}: not in the alerts table" for name in rules if name not in rows]
    out += [f"{name}: in the alerts table but not in alerts.yml" for name in rows if name not in rules]
    out += [f"{name}: severity {rows[name][-1]!r}, alerts.yml says {severity!r}"
            for name, severity in rules.items() if name in rows and rows[name][-1] != severity]
    return out


def missing_codes(cell: str, names) -> list[str]:
    return sorted(name for name in names if f"`{name}`" not in cell)


def info_drift(text: str) -> list[str]:
    row = metric_row(text, "dsv4_idxk_probe_info")
    states = missing_codes(row, STATES)
    reasons = missing_codes(row, {reason for reasons in STATES.values() for reason in reasons})
    return [f"state {s}" for s in states] + [f"reason {r}" for r in reasons]


def sink_drift(text: str) -> list[str]:
    return missing_codes(metric_row(text, "dsv4_idxk_probe_records_dropped_total"), code_sinks())


def exchange_kind_drift(text: str) -> list[str]:
    start = text.index("The exchange's refusals")
    return missing_codes(text[start:text.index("\n## ", start)], code_exchange_kinds())


def test_every_alert_is_in_the_alerts_table_with_its_severity():
    assert not alert_drift(DOC.read_text(encoding="utf-8"))


def test_every_alert_is_in_the_runbook_index_with_its_page():
    text = RUNBOOK_INDEX.read_text(encoding="utf-8")
    rows = table(text)
    for rule in alert_rules():
        name = rule["alert"]
        assert name in rows, f"docs/runbooks/README.md: no row for {name}"
        severity, page = rows[name]
        assert severity == rule["labels"]["severity"], name
        assert page == f"[{name}.md]({name}.md)", name
    assert {n for n in rows if n.startswith("Dsv4IdxkProbe")} == {r["alert"] for r in alert_rules()}


def test_the_info_row_names_every_state_and_reason():
    assert not info_drift(DOC.read_text(encoding="utf-8"))


def test_the_records_dropped_row_names_every_sink():
    assert {"hicache_restore"} <= code_sinks(), "the sink scan no longer finds HiCache's restore sink"
    assert not sink_drift(DOC.read_text(encoding="utf-8"))


def test_the_exchange_paragraph_names_every_kind():
    kinds = code_exchange_kinds()
    assert {"accept", "busy", "evicted_authenticated", "no_endpoint", "fetch", "refused_auth"} <= kinds
    assert not exchange_kind_drift(DOC.read_text(encoding="utf-8"))


def test_the_checks_catch_planted_omissions():
    text = DOC.read_text(encoding="utf-8")
    some_alert = alert_rules()[-1]["alert"]
    without_row = "".join(line for line in text.splitlines(keepends=True) if not line.startswith(f"| `{some_alert}` |"))
    assert alert_drift(without_row) == [f"{some_alert}: not in the alerts table"]
    info = next(line for line in text.splitlines() if line.startswith("| `dsv4_idxk_probe_info` |"))
    assert "state inactive" in info_drift(text.replace(info, info.replace("`inactive`", "inactive")))
    assert "reason not_dsv4" in info_drift(text.replace(info, info.replace("`not_dsv4`", "not_dsv4")))
    drops = next(line for line in text.splitlines() if line.startswith("| `dsv4_idxk_probe_records_dropped_total` |"))
    assert sink_drift(text.replace(drops, drops.replace("`hicache_restore`", "hicache_restore"))) == ["hicache_restore"]
    start = text.index("The exchange's refusals")
    planted = text[:start] + text[start:].replace("`busy`", "busy", 1)
    assert exchange_kind_drift(planted) == ["busy"]



def test_pd_alerts_read_exactly_the_decode_stages():
    """Every rule reading `rooms_verified_total` names its stages: the PD ones exactly
    DECODE_STAGES (a HiCache restore verdict at hicache_load is no PD verdict), the HiCache one
    hicache_load."""
    from dsv4_idxk_probe.vocabulary import DECODE_STAGES, HICACHE_STAGES

    pd = 'stage=~"' + "|".join(DECODE_STAGES) + '"'
    for rule in alert_rules():
        selectors = re.findall(r"dsv4_idxk_probe_rooms_verified_total\{([^}]*)\}", rule["expr"])
        for selector in selectors:
            assert pd in selector or f'stage="{HICACHE_STAGES[0]}"' in selector, f"{rule['alert']}: {selector}"
        if rule["alert"] in ("Dsv4IdxkProbeUnverifiedRatioHigh", "Dsv4IdxkProbeDecodeVerifiesNone"):
            assert selectors and all(pd in s for s in selectors), rule["alert"]
