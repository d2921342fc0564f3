"""`dsv4-idxk-probe install-hook`: put the probe's ``.pth`` gate into site-packages.

For SGLang builds without the plugin loader (forks, older releases): Python
runs ``dsv4_idxk_probe.pth`` at every interpreter start, and the line imports
the probe only when ``DSV4_IDXK_PROBE`` is set (otherwise it costs one env
lookup). SGLang 0.5.23+ does not need it: its plugin loader finds the probe
through the package's entry point. pip does not know the file: remove it with
``--uninstall`` before uninstalling the package. A line left behind costs the
same env lookup, and where the variable is set it writes one short line on
stderr (never a traceback). Installing twice is a no-op; the file is
written to a temp name and renamed, so an interpreter starting meanwhile never
reads half a line. Exit 0 done (or nothing to do), 2 the directory is missing
or not writable.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path
from ..offline.printable import printable
from .atomic import write_atomically

HELP = "install the .pth hook that loads the probe into SGLang builds without the plugin loader"
PTH_NAME = "dsv4_idxk_probe.pth"


def shipped_pth() -> Path:
    """The .pth inside the installed package (package data)."""
    return Path(__file__).resolve().parents[1] / "hooks" / PTH_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--site-packages", metavar="DIR",
        help="where to put it (default: this interpreter's site-packages, %(default)s)",
        default=sysconfig.get_paths()["purelib"],
    )
    parser.add_argument("--uninstall", action="store_true", help="remove the hook instead")


def _fail(message: str) -> int:
    print(f"dsv4-idxk-probe install-hook: {printable(message)}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    try:
        site = Path(args.site_packages).expanduser()
    except RuntimeError:  # pathlib's answer to ~user of no known user, or ~ with no home
        return _fail(f"--site-packages {args.site_packages!r} starts with a '~' whose home directory is unknown here")
    if not site.is_dir():
        return _fail(f"{site}: no such directory (pass the site-packages of the serving environment)")
    target = site / PTH_NAME
    if args.uninstall:
        if not target.exists():
            print(f"{printable(target)}: not installed, nothing to remove")
            return 0
        try:
            target.unlink()
        except OSError as exc:
            return _fail(f"cannot remove {target}: {exc.strerror or exc}")
        print(f"removed {printable(target)}")
        return 0
    source = shipped_pth()
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        return _fail(f"the package's hook {source} is unreadable ({exc.strerror or exc}); reinstall dsv4-idxk-probe")
    # the size first: an existing file of another size is not ours, however large (it was read whole)
    if (target.is_file() and target.stat().st_size == len(text.encode("utf-8"))
            and target.read_text(encoding="utf-8", errors="replace") == text):
        print(f"{printable(target)}: already installed")
        return 0
    try:
        write_atomically(target, text)
    except OSError as exc:
        return _fail(f"cannot write {target}: {exc.strerror or exc}")
    print(f"installed {printable(target)}; it loads the probe only in processes where DSV4_IDXK_PROBE is set "
          f"(remove it with --uninstall before uninstalling the package)")
    package_site = Path(__file__).resolve().parents[2]
    if package_site != site.resolve():
        print(f"note: dsv4_idxk_probe itself is installed under {printable(package_site)}; the interpreter that reads "
              f"{printable(site)} must be able to import it", file=sys.stderr)
    return 0
