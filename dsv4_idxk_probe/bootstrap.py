"""Start-up hook for SGLang builds without a plugin loader (the ``.pth`` route).

``hooks/dsv4_idxk_probe.pth`` imports this module only when
``DSV4_IDXK_PROBE`` is set to something other than 0; when that import fails
(the package was uninstalled and the .pth left behind) the line writes one
short line on stderr instead of a traceback, and with the variable unset it
does nothing at all. This module imports nothing but the standard library:
it puts one finder on ``sys.meta_path`` that waits for the first import of
SGLang's scheduler module and, once that module has executed, wraps its
``run_scheduler_process`` and ``Scheduler.__init__`` so that
`dsv4_idxk_probe.activation.install()` runs first thing in a scheduler
process (as SGLang's plugin loader does on the entry-point route; the
constructor for SGLang's Ray launcher, whose actor builds a Scheduler
without the entry). SGLang's other processes (HTTP server, tokenizer,
detokenizer, data-parallel controller) import that module too, to start
schedulers, but call neither there: they get no probe (they hold no PD
queue or pool; installing there cost each 0.2-0.3 s and patched what it
imported). install() patches target modules already imported and
registers post-import hooks for the rest. A build whose scheduler module
has neither gets the probe installed right after that module loads
(logged). Any failure is logged and SGLang goes on unharmed.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys

TRIGGER = "sglang.srt.managers.scheduler"  # the module that defines SCHEDULER_ENTRY
SCHEDULER_ENTRY = "run_scheduler_process"  # activation.SCHEDULER_ENTRY (not imported: stdlib only here)
SCHEDULER_CLASS = "Scheduler"  # what the entry, and SGLang's Ray actor, construct

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
        _install_at_scheduler_entry(module)

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


def _install_at_scheduler_entry(module) -> None:
    """Wrap `module`'s scheduler entry and its Scheduler's constructor so the probe installs
    when a scheduler starts (SGLang's Ray launcher builds a Scheduler in its actor without
    the entry); install now where there is neither to wrap (a fork that names them otherwise)."""
    try:
        entry = getattr(module, SCHEDULER_ENTRY, None)
        scheduler = getattr(module, SCHEDULER_CLASS, None)
        if not callable(entry) and not isinstance(scheduler, type):
            logging.getLogger("dsv4_idxk_probe").warning(
                "dsv4-idxk-probe: %s has neither %s nor %s; installing in this process now",
                TRIGGER, SCHEDULER_ENTRY, SCHEDULER_CLASS)
            _install()
            return
        if callable(entry):
            setattr(module, SCHEDULER_ENTRY, _installing_first(entry))  # pickled by name: spawn's children get it
        if isinstance(scheduler, type):
            scheduler.__init__ = _installing_first(scheduler.__init__)
    except Exception:  # never break the host's import
        logging.getLogger("dsv4_idxk_probe").exception("dsv4-idxk-probe: start-up from the .pth route failed")


def _installing_first(function):
    @functools.wraps(function)
    def installing_first(*args, **kwargs):
        _install()  # once per process: later calls return at once
        return installing_first.__wrapped__(*args, **kwargs)

    return installing_first


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
    """Arm the finder once (or install now if the scheduler module is already imported: its
    entry may be bound already where it is called from)."""
    global registered
    if registered:
        return
    registered = True
    if TRIGGER in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _finder)


register()
