"""`dsv4-idxk-probe check`: which patch targets the installed SGLang has.

Resolves every target of the table(s) against the installed SGLang (importing
the target modules, patching nothing) and prints one line per target: status,
kind, role, required, where, and why a target is missing or changed. Exit 0
when every required target resolves, 1 when one does not, 2 when a target
file is invalid (the message names file, line and field), 3 on an internal
error (`dsv4-idxk-probe --help` has the table for every command).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HELP = "List the patch targets the installed SGLang has (exit 1 if a required one is missing)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--targets", action="append", metavar="FILE",
        help="target table: a path or a shipped name (default: the config's, else sglang-0.5.23); repeatable",
    )
    parser.add_argument("--json", action="store_true", help="print the table as JSON")


def _installed_sglang() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "not installed"


def _default_targets() -> list[str]:
    try:
        from ..config import ConfigError, load_config

        return list(load_config().targets)
    except ConfigError as exc:
        print(f"dsv4-idxk-probe check: note: config not used ({exc})", file=sys.stderr)
    from ..config import DEFAULT_TARGETS

    return list(DEFAULT_TARGETS)


def main(args: argparse.Namespace) -> int:
    from ..sglang.package import _instruments
    from ..sglang.targets import TargetFileError, load_targets, resolve

    names = args.targets or _default_targets()
    try:
        targets = load_targets(names)
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
        })
    failed = [r for r in rows if r["required"] and r["status"] != "ok"]
    if args.json:
        print(json.dumps({"sglang": _installed_sglang(), "tested": list(_instruments), "targets": rows}, indent=2))
    else:
        print(f"SGLang {_installed_sglang()} (tables tested with {', '.join(_instruments)}); tables: {', '.join(names)}")
        width = max((len(r["name"]) for r in rows), default=4)
        for r in rows:
            need = "required" if r["required"] else "optional"
            print(f"{r['status']:<17} {r['name']:<{width}}  {r['kind']:<6} {r['role']:<7} {need:<8} {r['target']}")
            if r["detail"]:
                print(f"{'':<17} {'':<{width}}  {r['detail']}")
        ok = sum(r["status"] == "ok" for r in rows)
        print(f"{ok}/{len(rows)} targets resolve; {len(failed)} required target(s) missing or changed")
    from ..activation import allowlist_problem

    dropped = allowlist_problem(os.environ)
    if dropped:
        print(f"dsv4-idxk-probe check: {dropped}", file=sys.stderr)
    return 1 if failed or dropped else 0
