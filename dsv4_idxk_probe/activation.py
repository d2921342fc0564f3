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


#: Our name in the ``sglang.srt.plugins`` group (pyproject.toml), as SGLANG_PLUGINS lists it.
PLUGIN_NAME = "dsv4_idxk_probe"

#: The function in whose call SGLang loads plugins in a scheduler process.
SCHEDULER_ENTRY = "run_scheduler_process"


def load_plugin() -> None:
    """Entry point for SGLang's ``sglang.srt.plugins`` group (see module doc).

    SGLang's loader also runs in its HTTP server, tokenizer, detokenizer and
    data-parallel controller processes, which hold no PD queue or pool: the
    probe installs only where a scheduler is starting.
    """
    if not in_scheduler_process():
        if probe_requested(os.environ):
            log.debug("dsv4-idxk-probe: not a scheduler process; nothing to install here")
        return
    install()


def in_scheduler_process() -> bool:
    """Is this call made while SGLang starts a scheduler (`run_scheduler_process` on the stack)?"""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == SCHEDULER_ENTRY:
            return True
        frame = frame.f_back
    return False


def probe_requested(env: Mapping[str, str]) -> bool:
    return (env.get(ev.DSV4_IDXK_PROBE) or "").strip().lower() not in ev.OFF_VALUES


def allowlist_problem(env: Mapping[str, str]) -> str | None:
    """SGLANG_PLUGINS, when set, loads only the plugins it names: say so if it drops the probe."""
    allowed = env.get("SGLANG_PLUGINS")
    if not probe_requested(env) or not allowed or not allowed.strip():
        return None
    names = {name.strip() for name in allowed.split(",") if name.strip()}
    if PLUGIN_NAME in names:
        return None
    return (f"SGLANG_PLUGINS={allowed!r} does not list {PLUGIN_NAME!r}: SGLang's plugin loader will not load "
            f"the probe although {ev.DSV4_IDXK_PROBE} is set; add it to the list, or install the .pth hook "
            f"(dsv4-idxk-probe install-hook)")


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
    """Inside SGLang the probe opens no listener: its metrics go out through SGLang's
    /metrics (``--enable-metrics``, which sets PROMETHEUS_MULTIPROC_DIR). A
    ``metrics.port`` in the config is for standalone processes (`metrics.serving.expose`)."""
    port = runtime.config.metrics.port
    if port is None:
        return
    log.warning(
        "dsv4-idxk-probe: metrics.port %s is not served inside SGLang; the probe's metrics are on SGLang's "
        "/metrics (start SGLang with --enable-metrics)", port,
    )
