"""Switching the probe on in a process: env gate, plugin entry point, install/uninstall.

Two routes call `install()`:

* SGLang 0.5.23+: its plugin loader calls `load_plugin` (entry point group
  ``sglang.srt.plugins``) first thing in every scheduler process;
* other builds (forks, releases without the loader): ``hooks/dsv4_idxk_probe.pth``
  imports `dsv4_idxk_probe.bootstrap`, which calls `install()` right after
  ``sglang`` is first imported.

With ``DSV4_IDXK_PROBE`` unset (or 0) `install()` returns at once: nothing
heavier than this module is imported and nothing is patched. Otherwise the
whole start-up runs inside one ``try``: an invalid config or target table is
logged with the file and field, the probe stays off, and serving goes on.
`loaded` becomes True only as the last step of a successful install.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping

from . import environment_variables as ev

log = logging.getLogger("dsv4_idxk_probe")

loaded = False
_lock = threading.Lock()
_runtime: Any = None


def load_plugin() -> None:
    """Entry point for SGLang's ``sglang.srt.plugins`` group (see module doc)."""
    install()


def current_runtime() -> Any:
    """The installed Runtime, or None."""
    return _runtime


def install(env: Mapping[str, str] | None = None, *, route: str = "auto", registry: Any = None,
            emit: Any = None) -> bool:
    """Start the probe once per process; True when it is running (idempotent).

    `registry` (a prometheus CollectorRegistry) and `emit` (a room-log sink)
    are for tests and tools; by default the process registry and a room-log
    writer are used.
    """
    global loaded, _runtime
    env = os.environ if env is None else env
    if loaded:
        return True
    if (env.get(ev.DSV4_IDXK_PROBE) or "").strip().lower() in ev.OFF_VALUES:
        return False
    with _lock:
        if loaded:
            return True
        runtime = patcher = None
        try:
            from .config import ConfigError, load_config
            from .sglang.targets import TargetFileError, load_targets

            try:
                config = load_config(env)
                targets = load_targets(config.targets)
            except (ConfigError, TargetFileError) as exc:
                log.error("dsv4-idxk-probe stays off (serving continues): %s", exc)
                _report_broken("config_error" if isinstance(exc, ConfigError) else "target_table_error", registry)
                return False
            from .runtime import Runtime
            from .sglang.accessors import identity
            from .sglang.patcher import Patcher

            runtime = Runtime(config, identity=identity, registry=registry, emit=emit)
            patcher = Patcher(runtime, targets, route=route)
            runtime.patcher = patcher
            patcher.patch()
            _start_exporter(runtime)
            _runtime = runtime
            log.info("dsv4-idxk-probe on: mode %s, config %s, %d targets", config.mode, config.source, len(targets))
            loaded = True
        except Exception:
            log.exception("dsv4-idxk-probe failed to start; serving continues without it")
            _teardown(runtime, patcher)
            _report_broken("start_error", registry)
    return loaded


def uninstall() -> None:
    """Take every hook off and stop the probe's threads (idempotent)."""
    global loaded, _runtime
    with _lock:
        runtime, _runtime = _runtime, None
        loaded = False
        if runtime is not None:
            _teardown(runtime, getattr(runtime, "patcher", None))


def _teardown(runtime: Any, patcher: Any) -> None:
    try:
        if patcher is not None:
            patcher.unpatch()
        if runtime is not None:
            try:
                from .hicache.probe import forget
            except ImportError:
                forget = None
            if forget is not None:
                forget(runtime)
            runtime.close()
    except Exception:
        log.exception("dsv4-idxk-probe: error while switching off")


def _report_broken(reason: str, registry: Any) -> None:
    """dsv4_idxk_probe_info{state="broken"} once SGLang has published this process's labels."""
    try:
        from .runtime import report_broken

        report_broken(reason, registry=registry)
    except Exception:
        log.debug("dsv4-idxk-probe: broken state not published", exc_info=True)


def _start_exporter(runtime: Any) -> None:
    port = runtime.config.metrics.port
    if port is None:
        return
    try:
        from .metrics.serving import expose

        started = expose(port)
        if started is not None:
            server, _thread = started
            runtime.on_close(lambda: (server.shutdown(), server.server_close()))
    except Exception as exc:
        log.error("dsv4-idxk-probe: metrics port %s not served: %s", port, exc)
