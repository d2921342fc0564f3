"""`dsv4-idxk-probe` command line: one small module per subcommand.

Each subcommand module exposes ``HELP``, ``add_arguments(parser)`` and
``main(args) -> int``; it is imported only when its command runs. `run`
owns what every command shares: the exit-code table below, the message
prefix ``dsv4-idxk-probe <command>:``, quiet broken pipes, and tracebacks
only under ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

COMMANDS = {
    "diff": "dsv4_idxk_probe.cli.diff",
    "report": "dsv4_idxk_probe.cli.report",
    "check": "dsv4_idxk_probe.cli.check",
    "demo": "dsv4_idxk_probe.cli.demo",
    "install-hook": "dsv4_idxk_probe.cli.install_hook",
    "assets": "dsv4_idxk_probe.cli.assets",
}

OK, FINDING, BAD_INPUT, INTERNAL = 0, 1, 2, 3
NOT_IN_SERVING_IMAGE = 4  # check: SGLang cannot be imported here
BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE (`... | head`)
INTERRUPTED = 130

EXIT_CODES = """exit status (every command):
  0    ok: every verified room matches, every required target resolves, every fault found
  1    a finding: a mismatch (diff --strict: also not-comparable or unverified rooms), a missing
       required patch target (check), a fault the probe missed or invented (demo)
  2    bad input: a missing or unreadable file, an invalid config, fault spec or target table,
       no records, skipped lines, a rig that could not run; the message names file, line, field
  3    internal error: a bug; one line on stderr, the traceback with --debug
  4    check only: SGLang is not importable here; run check inside the serving image
  130  interrupted; 141 the output pipe closed (e.g. `| head`), quietly
report writes its page whatever the logs say: 0 once written (the findings and skipped lines
are on the page; diff is the pass/fail tool), 2 when nothing is readable or it cannot write"""


#: What `dsv4-idxk-probe --help` opens with: what the tool is for, in an operator's words.
DESCRIPTION = "verify DeepSeek-V4 index-K through SGLang's PD transfers and HiCache copies, and read its logs"


def describe(text: str) -> str:
    """A command's description as --help shows it: the operator's line, wrapped to 100 columns."""
    from .width import wrap

    return "\n".join(wrap(text))


def prefix(command: str) -> str:
    """The one error prefix every command uses."""
    return f"dsv4-idxk-probe {command}:"


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__

    parser = argparse.ArgumentParser(
        prog="dsv4-idxk-probe", description=describe(DESCRIPTION), epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dsv4-idxk-probe {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an internal error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if exc.name != module_name:
                raise
            continue  # not built into this version
        command = sub.add_parser(name, help=module.HELP, description=describe(module.HELP), epilog=EXIT_CODES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="print the traceback of an internal error")
        module.add_arguments(command)
        command.set_defaults(_main=module.main)
    return parser


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for stream in (sys.stdout, sys.stderr):  # a file or room name with undecodable bytes still prints
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    try:
        status = int(args._main(args) or 0)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{prefix(args.command)} interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        message = str(exc).splitlines()[0][:300] if str(exc) else ""
        print(f"{prefix(args.command)} internal error: {exc.__class__.__name__}"
              f"{': ' + message if message else ''} (run with --debug for the traceback)", file=sys.stderr)
        return INTERNAL


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(run())
