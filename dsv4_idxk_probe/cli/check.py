"""`dsv4-idxk-probe check`: whether the probe would start here, and which patch
targets the installed SGLang has.

First loads the probe config exactly as a pod with this environment would
(``DSV4_IDXK_PROBE``, ``DSV4_IDXK_PROBE_CONFIG``, ``DSV4_IDXK_PROBE_TARGETS``)
and fails (exit 2, naming the file and field) when it is invalid, since the
probe would then stay off, or when the room-log directory cannot be written
(`logdir`). Then imports the SGLang modules the target table names, with
progress on stderr (15-25 s in a serving image); when SGLang itself cannot be
imported it says once to run this in the serving image (exit 4) instead of
listing every target as missing. Then resolves every target (patching
nothing) and prints the SGLang release it detected, the table it chose for it
(``sglang@0.5.21``), one entry per target (status, kind, role, required,
where, why a target is missing or changed, and for an optional target what
its absence costs), the targets other releases have and this one does not,
and the index-K row layouts the probe knows, by row bytes; every line within
100 columns. Exit 0 when every required target resolves, 1 when one does not
(or SGLANG_PLUGINS leaves the probe out), 2 on an invalid config, log
directory or target file, 3 on an internal error, 4 when SGLang is not
importable (`dsv4-idxk-probe --help` has the table). Warnings (``warning:``
lines, exit status unchanged): an exchange secret file other users may read,
an exchange that would stay on loopback while SGLang reports a routable
address to its peers, a relative room-log directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..offline.printable import printable
from .logdir import examine
from .progress import Progress
from .width import COLUMNS, wrap

HELP = "check, inside the serving image, that the probe would start and find what it patches in SGLang"


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


def _exchange_warning(config) -> str | None:
    """An exchange that would stay on loopback (no secret) while SGLang's KV manager reports a
    routable address: decode on another host could then never fetch a digest vector, and every
    mismatch would stay unlocalised."""
    ex = config.exchange
    if not ex.enabled or ex.secret_file:
        return None
    from ..exchange.address import scope
    from ..sglang.host_address import kv_manager_address

    address, _ = kv_manager_address()
    if address is None or scope(address) == "loopback":
        return None
    return (f"exchange: no exchange.secret_file, so prefill's exchange stays on loopback while SGLang "
            f"reports {address} to its peers: decode on another host cannot fetch digest vectors and "
            f"no mismatch is localised; give prefill and decode the same secret file (README, "
            f"docs/security.md)")


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


def _say(text: str, first: str = "", rest: str | None = None, stream=None) -> None:
    """`text` wrapped, each word `printable`: the config's strings (a path, a target file's
    name) are the user's and may hold an escape sequence; whitespace still just wraps."""
    text = " ".join(printable(word) for word in text.split())
    for line in wrap(text, COLUMNS, first, rest):
        print(line, file=stream or sys.stdout)


def _error(text: str) -> None:
    _say(text, "dsv4-idxk-probe check: ", "  ", sys.stderr)


def main(args: argparse.Namespace) -> int:
    from ..sglang.package import _instruments
    from ..sglang.targets import TargetFileError, resolve, select_table
    from .main import BAD_INPUT, FINDING, NOT_IN_SERVING_IMAGE, OK
    from ..sglang.importable import import_target_modules

    config, config_error = _pod_config()
    if config_error is not None:
        # What the pod would log before staying off; a probe that is off by
        # mistake must not pass `check`.
        _error(f"invalid probe config, the probe would stay off: {config_error}")
        return BAD_INPUT
    logdir = examine(config)
    if logdir.problem is not None:
        _error(f"{config.source}: roomlog.dir: {logdir.problem}; room logs would be lost (each failed write "
               f"only counted in errors_total)")
        return BAD_INPUT
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
        _error(str(exc))
        return BAD_INPUT
    except (OSError, UnicodeDecodeError) as exc:  # a table the loader could not even read: still bad input
        _error(f"cannot read target table ({', '.join(names)}): {exc}")
        return BAD_INPUT
    with Progress("check") as progress:
        with progress.step("importing SGLang (15-25 s in a serving image)"):
            unimportable = import_target_modules(t.module for t in targets)
    if unimportable is not None:
        _error(f"run this inside the serving image: sglang is not importable: {unimportable}")
        return NOT_IN_SERVING_IMAGE
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
    warnings = _config_warnings(config) + [w for w in (_exchange_warning(config), logdir.warning) if w]
    if args.json:
        print(json.dumps({"sglang": release, "tested": list(_instruments), "config": config.source,
                          "mode": config.mode, "roomlog_dir": str(logdir.path), "warnings": warnings,
                          "tables": tables, "targets": rows, "absent": absent}, indent=2))
    else:
        _say(_config_line(config))
        _say(f"room logs: {logdir.path}" + (f" ({logdir.origin})" if logdir.origin else ""))
        for warning in warnings:
            _say(warning, "warning: ")
        _say(f"SGLang {release} detected (tables tested with {', '.join(_instruments)})")
        for sel in selections:
            note = "" if sel.tested else (
                f"; SGLang {sel.release} is not among the releases this table was tested with" if sel.release else "")
            _say(f"table {sel.label} chosen ({sel.source}){note}")
        names = {id(r): printable(str(r["name"])) for r in rows + absent}  # a target table's, as written
        width = max((len(name) for name in names.values()), default=4)
        for r in rows:
            need = "required" if r["required"] else "optional"
            print(f"{r['status']:<17} {names[id(r)]:<{width}}  {printable(str(r['kind'])):<6} "
                  f"{printable(str(r['role'])):<7} {need}")
            _say(r["target"], "    ")
            if r["detail"]:
                _say(r["detail"], "    ")
            if not r["required"]:
                _say(r["cost"] or "not stated in the table", "    if missing: ", "    ")
        for a in absent:
            print(f"{'not in release':<17} {names[id(a)]:<{width}}  only SGLang {printable(str(a['releases']))}")
            _say(a["cost"], "    costs here: ", "    ")
        ok = sum(r["status"] == "ok" for r in rows)
        print(f"{ok}/{len(rows)} targets resolve; {len(failed)} required target(s) missing or changed")
        _say(_layouts_line())
    from ..activation import allowlist_problem

    dropped = allowlist_problem(os.environ)
    if dropped:
        _error(dropped)
    return FINDING if failed or dropped else OK
