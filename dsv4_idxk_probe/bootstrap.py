"""Start-up hook for SGLang builds without a plugin loader (the ``.pth`` route).

``hooks/dsv4_idxk_probe.pth`` imports this module only when
``DSV4_IDXK_PROBE`` is set to something other than 0; when that import fails
(the package was uninstalled and the .pth left behind) the line writes one
short line on stderr instead of a traceback, and with the variable unset it
does nothing at all. This module imports nothing but the standard library:
it puts one finder on ``sys.meta_path`` that waits for the first import of
the ``sglang`` package and, once that package has executed, calls
`dsv4_idxk_probe.activation.install()`. install() then patches target
modules already imported and registers post-import hooks for the rest, so a
target module imported later is patched when it loads. Any failure is
logged and the import of sglang goes on unharmed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

TRIGGER = "sglang"

registered = False


class _InstallAfterExec(importlib.abc.Loader):
    """Delegates to the real loader; installs the probe after the module ran."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _remove_finder()
        _install()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _InstallAfterExec(spec.loader)
        return spec


_finder = _Finder()


def _remove_finder() -> None:
    try:
        sys.meta_path.remove(_finder)
    except ValueError:
        pass


def _install() -> None:
    try:
        from .activation import allowlist_problem, install

        problem = allowlist_problem(__import__("os").environ)
        if problem:  # the plugin route is closed: this route installs instead
            logging.getLogger("dsv4_idxk_probe").warning("dsv4-idxk-probe: %s; installing through the .pth route", problem)
        install()
    except Exception:  # never break the host's import
        logging.getLogger("dsv4_idxk_probe").exception("dsv4-idxk-probe: start-up from the .pth route failed")


def register() -> None:
    """Arm the finder once (or install now if sglang is already imported)."""
    global registered
    if registered:
        return
    registered = True
    if TRIGGER in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _finder)


register()
