"""`dsv4-idxk-probe` command line: one small module per subcommand.

Each subcommand module exposes ``HELP``, ``add_arguments(parser)`` and
``main(args) -> int``; it is imported only when its command runs.
Exit status: 0 ok, 1 a finding (mismatch, missing target), 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "diff": "dsv4_idxk_probe.cli.diff",
    "report": "dsv4_idxk_probe.cli.report",
    "check": "dsv4_idxk_probe.cli.check",
    "demo": "dsv4_idxk_probe.cli.demo",
    "install-hook": "dsv4_idxk_probe.cli.install_hook",
    "assets": "dsv4_idxk_probe.cli.assets",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4-idxk-probe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if exc.name != module_name:
                raise
            continue  # not built into this version
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
        sub.choices[name].set_defaults(_main=module.main)
    return parser


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(run())
