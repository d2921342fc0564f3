"""Run the rig: spawn prefill and decode, follow their events, collect what happened.

The parent never touches the probe's internals: each child gets the probe
through its environment (`RoleEnv`), exactly as a pod would. The parent
checks the inputs first (so a bad fault spec or probe config fails before
anything starts), serves the children's metrics on one port, and returns a
`RigResult` with every applied fault and every oracle observation.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...digest import get_layout
from .child import child_main
from ..faults.spec import FaultSpec, check_against, load_fault_spec
from .config import RigConfig, RoleEnv
from .settings import child_view, read_settings, rig_defaults

ROLES = ("prefill", "decode")
_ENV_LOCK = threading.Lock()


class RigError(RuntimeError):
    """The rig could not run to the end; the message says which side and why."""


@dataclass
class RigResult:
    config: RigConfig
    log_dir: Path | None
    info: dict = field(default_factory=dict)  # role -> what the child reported at start
    stats: dict = field(default_factory=dict)  # role -> its counters at the end
    faults: list[dict] = field(default_factory=list)
    oracle: list[dict] = field(default_factory=list)
    sent: set = field(default_factory=set)
    received: set = field(default_factory=set)
    finished: set = field(default_factory=set)
    skipped: dict = field(default_factory=dict)  # room -> reason
    decode_killed: bool = False
    prefill_after_kill: dict | None = None
    metrics_url: str | None = None
    seconds: float = 0.0


def check_inputs(cfg: RigConfig, env: RoleEnv) -> tuple[dict, FaultSpec | None]:
    """Validate both roles' probe settings and the fault spec; raise their own clear errors."""
    settings = {role: read_settings(child_view(env.for_role(role))) for role in ROLES}
    spec = None
    paths = {s.faults_path for s in settings.values() if s.faults_path}
    for path in sorted(paths):
        spec = load_fault_spec(path)
        check_against(spec, get_layout(cfg.layout), cfg.layer_ids, cfg.room_plan())
    return settings, spec


def run_rig(
    cfg: RigConfig,
    env: RoleEnv,
    *,
    on_event: Callable[[tuple], None] | None = None,
    kill_decode_after: int | None = None,
    metrics_port: int | None = None,
    timeout_s: float = 600.0,
) -> RigResult:
    """Run every room of `cfg` through the two children; raise RigError if a side fails."""
    cfg = cfg.validated()
    settings, _ = check_inputs(cfg, env)
    decode_settings = settings["decode"]
    result = RigResult(cfg, Path(decode_settings.config.roomlog.dir) if decode_settings.enabled else None)
    started = time.monotonic()
    with _metrics(metrics_port) as (extra_env, url):
        result.metrics_url = url
        run = _Run(cfg, env, extra_env, result, on_event)
        if url is not None:
            run.on_event(("metrics", "parent", url))
        try:
            run.start()
            run.follow(kill_decode_after, started + timeout_s)
        finally:
            run.stop()
    result.seconds = time.monotonic() - started
    return result


@contextmanager
def _metrics(port: int | None):
    """One scrape port for both children, through prometheus_client's multiprocess directory."""
    if port is None:
        yield {}, None
        return
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from ...metrics.serving import start_exporter

    with tempfile.TemporaryDirectory(prefix="dsv4-idxk-metrics-") as directory:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=directory)
        server, _ = start_exporter(port, addr="127.0.0.1", registry=registry)
        try:
            yield {"PROMETHEUS_MULTIPROC_DIR": directory}, f"http://127.0.0.1:{server.server_address[1]}/metrics"
        finally:
            server.shutdown()
            server.server_close()


@contextmanager
def _child_environment(overrides: dict[str, str]):
    """The environment a child starts with: 'spawn' copies os.environ at start()."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class _Run:
    def __init__(self, cfg: RigConfig, env: RoleEnv, extra_env: dict, result: RigResult, on_event):
        self.cfg, self.env, self.extra_env, self.result = cfg, env, extra_env, result
        self.on_event = on_event or (lambda event: None)
        self.ctx = mp.get_context("spawn")
        self.procs: dict = {}
        self.events: dict = {}
        self.controls: dict = {}
        self.done: set = set()

    def start(self) -> None:
        peer_p, peer_d = self.ctx.Pipe()
        for role, peer in (("prefill", peer_p), ("decode", peer_d)):
            events = self.ctx.Queue()  # one per child: a killed child cannot jam the other's
            control, child_control = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=child_main, args=(role, self.cfg, events, peer, child_control), name=f"idxk-{role}", daemon=True
            )
            with _child_environment({**rig_defaults(), **self.env.for_role(role), **self.extra_env}):
                proc.start()
            child_control.close()
            self.procs[role], self.events[role], self.controls[role] = proc, events, control
        peer_p.close()  # only the children hold the peer pipe, so a dead side shows as EOF
        peer_d.close()

    def follow(self, kill_after: int | None, deadline: float) -> None:
        while self.done != set(ROLES):
            if time.monotonic() > deadline:
                raise RigError(f"rig did not finish in time; done: {sorted(self.done) or 'none'}")
            got = False
            for role in ROLES:
                if role in self.done:
                    continue
                try:
                    event = self.events[role].get_nowait()
                except queue.Empty:
                    self._check_alive(role)
                    continue
                got = True
                self._handle(event)
                if kill_after is not None and not self.result.decode_killed and len(self.result.finished) >= kill_after:
                    self._kill_decode()
            if not got:
                time.sleep(0.002)

    def _handle(self, event: tuple) -> None:
        kind, role = event[0], event[1]
        r = self.result
        if kind == "error":
            raise RigError(f"{role} failed: {event[2]}")
        if kind == "ready":
            r.info[role] = event[2]
        elif kind == "sent":
            r.sent.add(event[2])
        elif kind == "received":
            r.received.add(event[2])
        elif kind == "finished":
            r.finished.add(event[2])
        elif kind == "skipped":
            r.skipped[event[2]] = event[3]
        elif kind == "fault":
            r.faults.append(event[2])
        elif kind == "oracle":
            r.oracle.append(event[2])
        elif kind == "done":
            r.stats[role] = event[2]
            self.done.add(role)
            if role == "decode":
                self.controls["prefill"].send(("stop",))
        self.on_event(event)

    def _check_alive(self, role: str) -> None:
        proc = self.procs[role]
        if proc.exitcode is not None and role not in self.done:
            time.sleep(0.2)  # its last events may still be in the queue
            try:
                while True:
                    self._handle(self.events[role].get_nowait())
            except queue.Empty:
                pass
            if role not in self.done:
                raise RigError(f"{role} exited with code {proc.exitcode} before finishing")

    def _kill_decode(self) -> None:
        """Play a decode crash: SIGKILL, then check that prefill still serves."""
        proc = self.procs["decode"]
        proc.kill()
        proc.join(10)
        try:  # what it said before it died (each event is one atomic pipe write)
            while True:
                event = self.events["decode"].get_nowait()
                if event[0] != "done":
                    self._handle(event)
        except queue.Empty:
            pass
        self.result.decode_killed = True
        self.done.add("decode")
        self.on_event(("killed", "decode"))
        control = self.controls["prefill"]
        time.sleep(0.2)
        control.send(("ping",))
        after = {"pong": control.recv()[1] if control.poll(10) else None}
        endpoint = self.result.info.get("prefill", {}).get("exchange")
        if endpoint and self.result.sent:
            from ...exchange import VectorClient

            client = VectorClient(timeout_ms=2000)
            room = min(self.result.sent)
            digest = client.fetch(tuple(endpoint), f"{room}/0")
            client.close()
            after["lookup"] = {"room": room, "digest": digest.to_record() if digest is not None else None}
        self.result.prefill_after_kill = after
        control.send(("stop",))

    def stop(self) -> None:
        for role in ROLES:
            proc = self.procs.get(role)
            if proc is None:
                continue
            if proc.is_alive() and role == "prefill":
                try:
                    self.controls[role].send(("stop",))
                except OSError:
                    pass
            proc.join(15)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for events in self.events.values():
            events.cancel_join_thread()
            events.close()
