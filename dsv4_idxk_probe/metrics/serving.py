"""Expose the probe's metrics: SGLang's /metrics when inside SGLang, else our own port.

Inside SGLang, ``PROMETHEUS_MULTIPROC_DIR`` is set before prometheus_client is
imported, so every metric registered in the default registry writes to that
directory and SGLang's multiprocess collector serves it on its own /metrics:
there is nothing to start. Standalone (the demo rig, tests, tools) the probe
starts prometheus_client's HTTP server on the configured port and address,
loopback unless `metrics.addr` says otherwise (a wildcard or routable
address is logged once at WARNING: /metrics has no authentication).

In that directory a gauge outlives its process unless someone calls
prometheus_client's `mark_process_dead`, and SGLang never does: after a
restart the old process's ``info{state="broken"}`` would still read 1 beside
the new one's ``state="on"``. The probe's gauges are therefore "live" gauges
(`multiprocess_mode="livemax"`), and every probe process, when it first
publishes its state, forgets the live gauges of processes that are gone
(`forget_dead_processes`). A process that exits keeps its gauges until then:
the demo rig's exporter, and a dashboard reading it, still see the children
that have finished.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

log = logging.getLogger("dsv4_idxk_probe.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOOPBACK = "127.0.0.1"


def inside_multiprocess_host() -> bool:
    """True when a host (SGLang) aggregates metrics through its multiprocess directory."""
    return bool(os.environ.get(MULTIPROC_ENV))


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    except ValueError:
        return False


def start_exporter(
    port: int, addr: str = LOOPBACK, registry: CollectorRegistry = REGISTRY
) -> tuple[WSGIServer, threading.Thread]:
    """Serve `registry` on addr:port from a daemon thread (port 0 picks a free one).

    Returns (server, thread): stop with ``server.shutdown(); server.server_close()``.
    """
    if not _is_loopback(addr):
        log.warning("dsv4-idxk-probe metrics exporter listens on %s (not loopback; /metrics is unauthenticated)",
                    addr or "all addresses")
    server, thread = start_http_server(port, addr=addr, registry=registry)
    log.info("dsv4-idxk-probe metrics on http://%s:%d/metrics", addr, server.server_address[1])
    return server, thread


def expose(port: int | None, addr: str = LOOPBACK, registry: CollectorRegistry = REGISTRY):
    """Start our exporter unless a multiprocess host serves the metrics; None when nothing was started."""
    if inside_multiprocess_host() or port is None:
        return None
    return start_exporter(port, addr, registry)


# %% live gauges of processes that are gone

_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")
# A file last written this long before the process now holding its pid started belongs to a
# process that had the pid before (a restarted container reuses pids). The start time is
# known to about a second (/proc/stat's btime is in whole seconds).
PID_REUSE_MARGIN_S = 2.0
_swept_pid = 0
_sweep_lock = threading.Lock()


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _process_start(pid: int) -> float | None | bool:
    """Unix start time of process `pid`; False when there is no such process (or only its
    zombie); None when it runs but its start is unknown (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # EPERM: it runs, as another user
            pass
        return None
    if fields[0] in (b"Z", b"X"):
        return False
    boot = _boot_time()
    try:
        return None if boot is None else boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError, OSError):
        return None


def forget_dead_processes(path: str | os.PathLike | None = None) -> list[int]:
    """`mark_process_dead` for every pid with live-gauge files in the multiprocess directory
    whose process is gone, or whose pid a later process now has (the file was last written
    before that process started). Returns those pids; never raises."""
    path = os.fspath(path) if path is not None else os.environ.get(MULTIPROC_ENV)
    if not path:
        return []
    gone: set[int] = set()
    try:
        names = os.listdir(path)
    except OSError:
        return []
    for name in names:
        match = _LIVE_GAUGE_FILE.fullmatch(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid in gone:
            continue
        try:
            written = os.stat(os.path.join(path, name)).st_mtime
        except OSError:
            continue
        started = _process_start(pid)
        if started is False or (started is not None and written < started - PID_REUSE_MARGIN_S):
            gone.add(pid)
    from prometheus_client import multiprocess

    for pid in sorted(gone):
        try:
            multiprocess.mark_process_dead(pid, path)
        except OSError:
            log.debug("could not forget the live gauges of pid %d", pid, exc_info=True)
    if gone:
        log.info("dsv4-idxk-probe: forgot the live gauges of %d process(es) that are gone from %s", len(gone), path)
    return sorted(gone)


def live_gauges_only() -> None:
    """Once per process, inside a multiprocess host: forget the gone processes' live gauges
    (`forget_dead_processes`). Called before the probe publishes its first gauge; never raises."""
    global _swept_pid
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return
    with _sweep_lock:
        if _swept_pid == os.getpid():
            return
        _swept_pid = os.getpid()
    try:
        forget_dead_processes(path)
    except Exception:
        log.debug("live gauge bookkeeping failed", exc_info=True)
