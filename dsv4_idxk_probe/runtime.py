"""The per-process probe runtime that every hook closes over.

One `Runtime` per process: its config, its metrics, its room-log sink, its
logger, and the role-specific sides (prefill or decode) that the SGLang
adapters attach once the scheduler's PD queues exist. Metrics and the room
log are created on first use, because what labels them (role, rank) is only
known once the host has published its own configuration, which happens after
the hooks are installed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

from .config import ProbeConfig
from .safety import add_error_listener, record_error, remove_error_listener, safe_invoke

log = logging.getLogger("dsv4_idxk_probe")

Identity = Callable[[], Mapping[str, str]]

_metrics_lock = threading.Lock()
_metrics_by_registry: dict[int, Any] = {}


def shared_metrics(registry: Any, identity: Mapping[str, str], mode: str = "observe"):
    """One ProbeMetrics per registry and process: a registry rejects a second
    registration of the same names, and an uninstall/install cycle must not
    trip over that (the second install publishes state "on" again)."""
    from .metrics.definitions import REGISTRY, ProbeMetrics

    registry = REGISTRY if registry is None else registry
    with _metrics_lock:
        entry = _metrics_by_registry.get(id(registry))
        metrics = entry[1] if entry is not None and entry[0] is registry else None
        if metrics is None:
            metrics = ProbeMetrics(registry, labels=identity, mode=mode)
            metrics.zero_pd_series()
            safe_invoke("metrics.gpu_info", _publish_gpu, metrics)  # once: which GPU (DCGM's UUID) this rank runs on
            _metrics_by_registry[id(registry)] = (registry, metrics)  # the registry stays alive: ids are not reused
        else:
            metrics.info.set("on", "running", mode)
        return metrics


def _publish_gpu(metrics) -> None:
    """`dsv4_idxk_probe_gpu_info` from the current CUDA device (metrics/gpu_identity.py: a
    host-side property read, no host sync); nothing on CPU."""
    from .metrics.gpu_identity import gpu_identity

    metrics.publish_gpu(gpu_identity())


# How long a probe that failed to start waits for SGLang to publish the labels
# its "broken" state is reported under (SGLang publishes them right after
# loading plugins; processes that never do, such as the tokenizer, report nothing).
BROKEN_REPORT_WAIT_S = 300.0
BROKEN_REPORT_POLL_S = 0.2


def report_broken(reason: str, *, registry: Any = None, identity: Identity | None = None,
                  wait_s: float = BROKEN_REPORT_WAIT_S) -> threading.Thread:
    """Publish ``dsv4_idxk_probe_info{state="broken", reason=...}`` for a probe
    that stays off by error, once this process's labels are known.

    A daemon thread polls `identity` (cheap: a dict read) until it names the
    engine type and TP rank, then writes the one series and exits; it gives up
    after `wait_s`. Never raises.
    """
    if identity is None:
        from .sglang.accessors import identity

    def publish() -> None:
        try:
            deadline = time.monotonic() + wait_s
            while True:
                labels = _safe_identity(identity)
                if labels.get("engine_type") and labels.get("tp_rank") is not None:
                    break
                if time.monotonic() > deadline:
                    return
                time.sleep(BROKEN_REPORT_POLL_S)
            from .metrics.definitions import REGISTRY, ProbeInfo, process_labels

            ProbeInfo(REGISTRY if registry is None else registry, process_labels(labels)).set("broken", reason)
        except Exception:
            log.debug("dsv4-idxk-probe: could not publish the broken state", exc_info=True)

    thread = threading.Thread(target=publish, name="dsv4-idxk-probe-state", daemon=True)
    thread.start()
    return thread


def _safe_identity(identity: Identity) -> dict[str, str]:
    try:
        return {k: str(v) for k, v in dict(identity()).items()}
    except Exception:
        return {}


class Runtime:
    """State shared by the hooks of one process.

    `emit` is the room-log sink: a callable taking one record dict (tests pass
    a list's ``append``); by default a RoomLogWriter created on first use.
    `identity` returns SGLang's metric labels of this process ({"model_name",
    "engine_type", "tp_rank", ...}) as far as they are known.
    """

    def __init__(
        self,
        config: ProbeConfig,
        *,
        metrics: Any = None,
        registry: Any = None,
        emit: Callable[[dict], Any] | None = None,
        identity: Identity | None = None,
        logger: logging.Logger | None = None,
    ):
        self.config = config
        self.log = logger or log
        self.enabled = True
        self.sides: dict[str, Any] = {}  # "prefill" / "decode" -> side object (dsv4_idxk_probe.sglang.sides)
        self.target_status: dict[str, tuple[str, bool]] = {}  # target name -> (status, required)
        self.not_applicable_counts: dict[str, int] = {}  # hook site -> calls it did not apply to
        self._metrics = metrics
        self._registry = registry
        self._emit = emit
        self._writer = None
        self._journal = None
        self._identity = identity or (lambda: {})
        self._lock = threading.RLock()
        self._closers: list[Callable[[], Any]] = []
        self._early_errors: dict[str, int] = {}
        self._error_listener = self._count_error
        add_error_listener(self._error_listener)

    # %% identity, metrics, room log

    @property
    def mode(self) -> str:
        return self.config.mode

    def identity(self) -> dict[str, str]:
        return _safe_identity(self._identity)

    @property
    def metrics(self):
        """ProbeMetrics, built on first use with the identity known by then."""
        if self._metrics is None:
            with self._lock:
                if self._metrics is None:
                    self._metrics = shared_metrics(self._registry, self.identity(), self.config.mode)
                    self._publish_target_status()
                    from .metrics.definitions import error_component

                    for site, n in self._early_errors.items():
                        self._metrics.errors.labels(component=error_component(site)).inc(n)
                    self._early_errors.clear()
        return self._metrics

    @property
    def journal(self):
        """This process's page journal (docs/diagnosis.md), shared by the PD and HiCache
        hooks; None when diagnosis is off."""
        cfg = getattr(self.config, "diagnosis", None)
        if cfg is None or not cfg.enabled:
            return None
        if self._journal is None:
            with self._lock:
                if self._journal is None:
                    from .diagnosis.journal import PageJournal

                    self._journal = PageJournal(cfg.journal_events, cfg.journal_per_page)
        return self._journal

    def emit(self, record: dict) -> None:
        """Hand one record to the room log; never raises, never blocks.

        A sink that raises (a writer that cannot be built) drops the record, counted in
        errors_total (site ``roomlog.emit``) and records_dropped; the writer itself fails
        closed and counts a directory it cannot use (docs/roomlog.md)."""
        try:
            sink = self._emit
            if sink is None:
                sink = self._room_log_writer().emit
            sink(record)
        except Exception:
            record_error("roomlog.emit")
            try:
                if self._metrics is not None:
                    self._metrics.records_dropped.labels(sink="roomlog").inc()
            except Exception:
                self.log.debug("records_dropped metric failed", exc_info=True)

    def _room_log_writer(self):
        with self._lock:
            if self._writer is None:
                from .roomlog import RoomLogWriter

                cfg = self.config.roomlog
                role = self.identity().get("engine_type") or "probe"
                self._writer = RoomLogWriter(
                    cfg.dir, role if role.replace("_", "").replace("-", "").isalnum() else "probe",
                    max_bytes=cfg.max_bytes, max_files=cfg.max_files, gzip_rotated=cfg.gzip,
                    queue_size=cfg.queue_size, metrics=self.metrics,
                )
                self.on_close(self._writer.close)
            return self._writer

    # %% patch-target status (log + metric)

    def set_target_status(self, name: str, status: str, required: bool) -> None:
        self.target_status[name] = (status, required)
        if self._metrics is not None:
            self._publish_one(name, status, required)

    def _publish_target_status(self) -> None:
        for name, (status, required) in list(self.target_status.items()):
            self._publish_one(name, status, required)

    def _publish_one(self, name: str, status: str, required: bool) -> None:
        from .sglang.targets import STATUSES

        try:
            for s in STATUSES:
                self._metrics.patch_target_status.labels(target=name, status=s).set(1 if s == status else 0)
            required_gauge = getattr(self._metrics, "patch_target_required", None)
            if required_gauge is not None:
                required_gauge.labels(target=name).set(1 if required else 0)
        except Exception:
            self.log.debug("patch target status metric failed", exc_info=True)

    def _count_error(self, site: str) -> None:
        """Count a caught failure; kept until the metrics exist, then replayed."""
        if self._metrics is not None:
            self._metrics.count_error(site)
        else:
            with self._lock:
                self._early_errors[site] = self._early_errors.get(site, 0) + 1

    def not_applicable(self, site: str, what: str) -> None:
        """A hook found this SGLang without something it reads: counted and logged once,
        not an error of the probe (a build or path the hook does not apply to)."""
        with self._lock:
            first = site not in self.not_applicable_counts
            self.not_applicable_counts[site] = self.not_applicable_counts.get(site, 0) + 1
        if first:
            self.log.info("dsv4-idxk-probe: %s does not apply here (%s); counted, not an error", site, what)

    # %% life cycle

    def attach(self, role: str, side: Any) -> None:
        """Register the side object of `role`; it is closed with the runtime."""
        with self._lock:
            self.sides[role] = side
            closer = getattr(side, "close", None)
            if closer is not None:
                self.on_close(closer)

    def on_close(self, fn: Callable[[], Any]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        """Stop threads and sockets the runtime owns (uninstall, tests)."""
        self.enabled = False
        remove_error_listener(self._error_listener)
        if self._metrics is not None:
            try:
                self._metrics.info.set("off", "uninstalled", self.config.mode)
            except Exception:
                self.log.debug("probe state metric failed", exc_info=True)
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception:
                self.log.debug("closing %r failed", fn, exc_info=True)
