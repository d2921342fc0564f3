"""`dsv4-idxk-probe check`: whether the probe would start here, and which patch
targets the installed SGLang has.

First loads the probe config exactly as a pod with this environment would
(``DSV4_IDXK_PROBE``, ``DSV4_IDXK_PROBE_CONFIG``, ``DSV4_IDXK_PROBE_TARGETS``)
and fails (exit 2, naming the file and field) when it is invalid, since the
probe would then stay off. Then resolves every target of the table(s) against
the installed SGLang (importing
the target modules, patching nothing) and prints the SGLang release it
detected, the table it chose for it (``sglang@0.5.21``), one line per target
(status, kind, role, required, where, why a target is missing or changed,
and for an optional target what its absence costs), the targets other
releases have and this one does not, with what that costs, and the index-K
row layouts the probe knows, by row bytes. Exit 0
when every required target resolves, 1 when one does not (or SGLANG_PLUGINS leaves the
probe out), 2 when the config or a target file is invalid (the message names file, line and
field, including a table whose ``hook`` names anything but the probe's own
wrapper factories), 3 on an internal error (`dsv4-idxk-probe --help` has the
table for every command). An exchange secret file other users may read is
named on a ``warning:`` line (the probe logs the same at start; one every user
may write is refused, exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HELP = "Validate the probe config a pod would load (exit 2 if invalid) and list the patch targets the installed SGLang has (exit 1 if a required one is missing)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--targets", action="append", metavar="FILE",
        help="target table: a path or a shipped name, optionally @RELEASE (sglang@0.5.21); "
             "default: the config's, else sglang (the installed release's entries); repeatable",
    )
    parser.add_argument("--json", action="store_true", help="print the table as JSON")


def _installed_sglang() -> str:
    from ..sglang.targets import installed_sglang

    return installed_sglang() or "not installed"


def _pod_config():
    """The config a pod with this environment would load (DSV4_IDXK_PROBE,
    DSV4_IDXK_PROBE_CONFIG, DSV4_IDXK_PROBE_TARGETS), validated as the probe
    validates it at start; (config, None) or (None, the error)."""
    from ..config import ConfigError, load_config

    try:
        return load_config(), None
    except ConfigError as exc:
        return None, exc


def _config_line(config) -> str:
    from .. import environment_variables as ev

    requested = ev.requested_mode(os.environ.get(ev.DSV4_IDXK_PROBE))
    state = "off here (DSV4_IDXK_PROBE unset or 0)" if requested is None else f"on, mode {config.mode}"
    return f"config: {config.source} is valid; probe {state}; targets {', '.join(config.targets)}"


def _config_warnings(config) -> list[str]:
    """What the pod would log at WARNING about its config (an exchange secret others may read)."""
    if not config.exchange.secret_file:
        return []
    from ..exchange.auth import secret_file_warning

    warning = secret_file_warning(config.exchange.secret_file)
    return [f"exchange.secret_file: {warning}"] if warning else []


def _layouts_line() -> str:
    """The row layouts `layout: auto` matches an index-K buffer against, by row bytes."""
    try:
        from ..digest.layout import shipped_layouts

        layouts = shipped_layouts()
    except Exception as exc:  # a broken layouts file shows up here and at start
        return f"index-K layouts: cannot be listed ({type(exc).__name__}: {exc})"
    known = ", ".join(f"{name} ({layout.slots} slots x {layout.row_bytes} B rows)"
                      for name, layout in sorted(layouts.items()))
    return (f"index-K layouts matched by row bytes (a buffer of any dtype is read as its bytes, "
            f"one row per page): {known}")


def main(args: argparse.Namespace) -> int:
    from ..sglang.package import _instruments
    from ..sglang.targets import TargetFileError, resolve, select_table

    config, config_error = _pod_config()
    if config_error is not None:
        # What the pod would log before staying off; a probe that is off by
        # mistake must not pass `check`.
        print(f"dsv4-idxk-probe check: invalid probe config, the probe would stay off: {config_error}", file=sys.stderr)
        return 2
    names = args.targets or list(config.targets)
    try:
        selections = [select_table(name) for name in names]
        targets = [t for sel in selections for t in sel.targets]
        seen: dict[str, str] = {}
        for t in targets:
            if t.name in seen:
                raise TargetFileError(f"{t.where}: target name {t.name!r} also defined at {seen[t.name]}")
            seen[t.name] = t.where
    except TargetFileError as exc:
        print(f"dsv4-idxk-probe check: {exc}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:  # a table the loader could not even read: still bad input
        print(f"dsv4-idxk-probe check: cannot read target table ({', '.join(names)}): {exc}", file=sys.stderr)
        return 2
    rows = []
    for target in targets:
        resolution = resolve(target)
        rows.append({
            "name": target.name,
            "status": "ok" if resolution.ok else resolution.status,
            "kind": target.kind,
            "role": target.role,
            "required": target.required,
            "target": target.path,
            "detail": resolution.detail,
            "cost": target.cost,
        })
    absent = [{"name": t.name, "table": sel.label, "releases": t.sglang, "cost": t.cost or "not stated"}
              for sel in selections for t in sel.absent]
    tables = [{"table": sel.label, "file": sel.source, "release": sel.release, "tested": sel.tested}
              for sel in selections]
    failed = [r for r in rows if r["required"] and r["status"] != "ok"]
    release = _installed_sglang()
    if args.json:
        print(json.dumps({"sglang": release, "tested": list(_instruments), "config": config.source,
                          "mode": config.mode, "warnings": _config_warnings(config), "tables": tables,
                          "targets": rows, "absent": absent}, indent=2))
    else:
        print(_config_line(config))
        for warning in _config_warnings(config):
            print(f"warning: {warning}")
        print(f"SGLang {release} detected (tables tested with {', '.join(_instruments)})")
        for sel in selections:
            note = "" if sel.tested else (
                f"; SGLang {sel.release} is not among the releases this table was tested with" if sel.release else "")
            print(f"table {sel.label} chosen ({sel.source}){note}")
        width = max((len(r["name"]) for r in rows), default=4)
        for r in rows:
            need = "required" if r["required"] else "optional"
            print(f"{r['status']:<17} {r['name']:<{width}}  {r['kind']:<6} {r['role']:<7} {need:<8} {r['target']}")
            if r["detail"]:
                print(f"{'':<17} {'':<{width}}  {r['detail']}")
            if not r["required"]:
                print(f"{'':<17} {'':<{width}}  if missing: {r['cost'] or 'not stated in the table'}")
        for a in absent:
            print(f"{'not in release':<17} {a['name']:<{width}}  (only SGLang {a['releases']}): {a['cost']}")
        ok = sum(r["status"] == "ok" for r in rows)
        print(f"{ok}/{len(rows)} targets resolve; {len(failed)} required target(s) missing or changed")
        print(_layouts_line())
    from ..activation import allowlist_problem

    dropped = allowlist_problem(os.environ)
    if dropped:
        print(f"dsv4-idxk-probe check: {dropped}", file=sys.stderr)
    return 1 if failed or dropped else 0
