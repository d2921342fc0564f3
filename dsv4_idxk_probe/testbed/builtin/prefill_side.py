"""The rig's prefill process: chunked prefill, the prefill digest, NIXL WRITEs.

Per room, as SGLang's prefill does it: each chunk's "forward" writes the
index-K slots its tokens complete, and the chunk's finished pages go to
decode in one NIXL WRITE with a notification. At the last chunk the probe
digests the room (`PrefillMonitor.room_sent`, the `prefill_send` stage), the
in-band digest goes into the room's metadata row, and that row travels in
the last WRITE. Pages are freed once every WRITE of the room has completed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ...digest import get_layout
from ...pd import InbandDigest, PrefillAssembly, RoomId
from ...pd.assembly import exchange_port
from ..faults import content, expect, inject
from ..faults.spec import TRANSFER_KINDS, load_fault_spec
from .loopclock import LoopClock
from .config import PAGE_TOKENS, RigConfig, RoomPlan
from .pool import build_buffers, build_meta, select_device
from .probe_io import LOOPBACK, ProbeSinks
from .settings import read_settings
from .transport import NixlEndpoint, TransportError
from .wire import META_ENDPOINT_SLOT, META_INBAND_SLOTS, META_ROOM_SLOT, TransferInfo, notification

_IDLE_S = 0.0005


@dataclass
class _Outgoing:
    """A room whose WRITEs are posted; its pages come back when they complete."""

    room: int
    pages: list[int]
    meta_row: int
    handles: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


class PrefillSide:
    def __init__(self, cfg: RigConfig, events, peer, control):
        self.cfg, self.events, self.peer, self.control = cfg, events, peer, control
        self.settings = read_settings()
        self.layout = get_layout(cfg.layout)
        self.layer_ids = list(cfg.layer_ids)
        plan = cfg.room_plan()
        self.plans = {p.room: p for p in plan}
        spec = load_fault_spec(self.settings.faults_path) if self.settings.faults_path else None
        self.faults = spec.by_room(plan, cfg.seed, side="prefill") if spec else {}
        device = select_device(cfg.device, cfg.prefill_gpu)
        self.n_pages = cfg.pool_size()
        self.bufs, self.pool_source = build_buffers(self.layout, cfg.layers, self.n_pages, device, cfg.pool_source)
        self.meta = build_meta(2 * cfg.max_running + 2, device)
        self.meta_index = len(self.bufs)
        self.row_bytes = [b.shape[1] * b.element_size() for b in (*self.bufs, self.meta)]
        self.endpoint = NixlEndpoint("prefill", [*self.bufs, self.meta])
        self.free_pages = list(range(self.n_pages - 1, 0, -1))  # page 0 is reserved, as in SGLang
        self.free_meta = list(range(self.meta.shape[0] - 1, -1, -1))
        self.queue: deque[TransferInfo] = deque()
        self.outgoing: dict[int, _Outgoing] = {}
        self.decode_peer: str | None = None
        self.decode_gone = False
        self.stopping = False
        self.stats = {"rooms_sent": 0, "writes": 0, "bytes": 0, "failed": 0, "transfer_seconds": 0.0, "write_seconds": 0.0}
        self.clock = LoopClock()
        self.probe = self.monitor = self.sinks = None
        if self.settings.enabled:
            # the side SGLang's prefill builds (pd.assembly), its exchange on loopback;
            # an exchange that cannot start fails the run
            config = self.settings.config
            self.sinks = ProbeSinks(config, "prefill")
            self.probe = PrefillAssembly(
                self.layout, self.layer_ids, self.bufs, config, self.sinks.emit, self.sinks.metrics,
                bind=LOOPBACK, port=exchange_port(config.exchange, None), require_exchange=True,
            )
            self.monitor = self.probe.monitor

    # %% main loop

    def run(self) -> None:
        self.events.put(("ready", "prefill", self._info()))
        while not self.stopping:
            busy = self._poll_control() | self._poll_peer() | self._poll_outgoing()
            if self.queue and self._can_start(self.queue[0]):
                self._serve(self.queue.popleft())
                busy = True
            if not busy:
                time.sleep(_IDLE_S)
        self._shutdown()

    def _info(self) -> dict:
        server = self.probe.server if self.probe is not None else None
        return {
            "pool_source": self.pool_source, "device": str(self.bufs[0].device), "pages": self.n_pages,
            "probe": self.settings.enabled,
            "exchange": list(server.endpoint) if server is not None else None,
        }

    def _poll_control(self) -> bool:
        if not self.control.poll():
            return False
        message = self.control.recv()
        if message[0] == "stop":
            self.stopping = True
        elif message[0] == "ping":
            self.control.send(("pong", dict(self.stats, outgoing=len(self.outgoing), decode_gone=self.decode_gone)))
        return True

    def _poll_peer(self) -> bool:
        if self.decode_gone or not self.peer.poll():
            return False
        try:
            message = self.peer.recv()
        except (EOFError, OSError):
            self.decode_gone = True  # decode died: keep serving what is still useful (the exchange)
            self.events.put(("peer_gone", "prefill", len(self.queue)))
            self.queue.clear()
            return True
        kind = message[0]
        if kind == "hello":
            self.decode_peer = self.endpoint.connect(message[1])
        elif kind == "transfer":
            self.queue.append(message[1])
        return True

    def _poll_outgoing(self) -> bool:
        done = []
        for room, out in self.outgoing.items():
            states = [self.endpoint.poll(h) for h in out.handles]
            if "ERR" in states or (time.monotonic() - out.started > self.cfg.transfer_timeout_s and "PROC" in states):
                self._fail(room, "WRITE failed" if "ERR" in states else "WRITE timed out")
                done.append(room)
            elif all(s == "DONE" for s in states):
                self.stats["transfer_seconds"] += time.monotonic() - out.started
                done.append(room)
        for room in done:
            out = self.outgoing.pop(room)
            self.free_pages.extend(reversed(out.pages))
            self.free_meta.append(out.meta_row)
        return bool(done)

    def _fail(self, room: int, reason: str) -> None:
        self.stats["failed"] += 1
        self.events.put(("transfer_failed", "prefill", room, reason))
        if not self.decode_gone:
            try:
                self.peer.send(("failed", room, reason))
            except (OSError, EOFError):
                self.decode_gone = True

    def _can_start(self, info: TransferInfo) -> bool:
        return len(self.free_pages) >= self.plans[info.room].pages and bool(self.free_meta)

    # %% one room

    def _serve(self, info: TransferInfo) -> None:
        plan = self.plans[info.room]
        pages = [self.free_pages.pop() for _ in range(plan.pages)]
        out = _Outgoing(info.room, pages, self.free_meta.pop())
        self.outgoing[info.room] = out
        job = _RoomJob(self, info, plan, pages, out)
        try:
            with self.clock.phase("room"):
                job.run()
        except TransportError as exc:
            self._fail(info.room, str(exc))
            out.handles = []  # nothing more will complete; pages return on the next poll
        self.stats["rooms_sent"] += 1
        self.events.put(("sent", "prefill", info.room))

    def _shutdown(self) -> None:
        deadline = time.monotonic() + 5.0
        while self.outgoing and time.monotonic() < deadline:
            self._poll_outgoing()
            time.sleep(0.005)
        if self.probe is not None:
            self.probe.close()  # the pending digests, then the exchange
        if self.sinks is not None:
            self.sinks.close()
        self.endpoint.close()
        self.events.put(("done", "prefill", {**self.stats, **self.clock.stats()}))


class _RoomJob:
    """Chunked prefill and transfer of one room."""

    def __init__(self, side: PrefillSide, info: TransferInfo, plan: RoomPlan, pages: list[int], out: _Outgoing):
        self.side, self.info, self.plan, self.pages, self.out = side, info, plan, pages, out
        self.layout = side.layout
        self.seq = 0
        self.faults = side.faults.get(plan.room, [])
        self.transfer_targets: list[inject.Target] = []
        self.transfer_effects: dict[int, list[dict]] = {}  # id(target) -> effects, reported once
        self.send_targets: list[tuple[inject.Target, object]] = []

    def run(self) -> None:
        cfg, plan = self.side.cfg, self.plan
        n_chunks = math.ceil(plan.prompt_tokens / cfg.chunk_tokens)
        chunk_pages = cfg.chunk_tokens // PAGE_TOKENS
        last_pages = range(max((n_chunks - 1) * chunk_pages, plan.prefix_pages), plan.pages)
        self._resolve_faults([p - plan.prefix_pages for p in last_pages])
        clock = self.side.clock
        for c in range(n_chunks):
            first, stop = c * chunk_pages, min((c + 1) * chunk_pages, plan.pages)
            with clock.phase("forward (ground truth)"):
                self._forward(range(first, stop))
            to_send = range(max(first, plan.prefix_pages), stop)
            if c < n_chunks - 1:
                if len(to_send):
                    with clock.phase("post (sync, WRITE)"):
                        self._post(to_send, meta=False)
                continue
            with clock.phase("digest and metadata row"):
                self._write_meta(self._digest())
            self._apply_before_send(last_pages)
            with clock.phase("post (sync, WRITE)"):
                self._post(to_send, meta=True)
        for target in self.transfer_targets:
            effects = self.transfer_effects.get(id(target), [])
            self.side.events.put(("fault", "prefill", _record(target.fault, plan.room, True, "", target, effects)))

    def _resolve_faults(self, last_logical: list[int]) -> None:
        side = self.side
        for fault in self.faults:
            rng = inject.rng_for(side.cfg.seed, fault, self.plan.room)
            random_pages = last_logical if fault.when == "before_send" else None
            target = inject.resolve(fault, self.plan, self.layout, side.layer_ids, rng, random_pages=random_pages)
            if isinstance(target, str):
                side.events.put(("fault", "prefill", _record(fault, self.plan.room, False, target)))
                continue
            if fault.kind in TRANSFER_KINDS:
                self.transfer_targets.append(target)
                continue
            snapshot = None
            if fault.kind == "stale_page":  # the previous occupant's bytes, before the forward overwrites them
                phys = self.pages[self.plan.prefix_pages + target.page]
                snapshot = [side.bufs[li][phys].cpu().numpy().copy() for li in target.layers]
            self.send_targets.append((target, (rng, snapshot)))

    def _forward(self, full_pages: range) -> None:
        """Write the index-K slots these pages' tokens complete (ground truth)."""
        side, plan = self.side, self.plan
        idx = list(full_pages)
        frozen = content.page_frozen_slots(self.layout, plan.prompt_tokens, idx)
        phys = [self.pages[p] for p in idx]
        for li, lid in enumerate(side.layer_ids):
            truth = content.truth_rows(side.cfg.seed, plan.room, self.info.attempt, lid, idx, self.layout.row_bytes)
            content.write_frozen(side.bufs[li], phys, truth, frozen, self.layout)

    def _digest(self) -> InbandDigest | None:
        """The prefill_send stage: digest the transferred pages, wait for the room value."""
        monitor = self.side.monitor
        if monitor is None:
            return None
        rid = RoomId(self.plan.room, self.info.attempt)
        with self.side.clock.probe("send"):
            pending = monitor.room_sent(rid, self.pages[self.plan.prefix_pages :], self.plan.sent_tokens)
        if pending is None:
            return None
        if self.side.bufs[0].is_cuda:
            # SGLang's NIXL path blocks on the stream before the aux data leaves (the rig's
            # _send does the same with the probe off), so the digest is ready then.
            torch.cuda.current_stream().synchronize()
        deadline = time.monotonic() + 10.0
        while not pending.ready():
            if time.monotonic() > deadline:
                return None
            time.sleep(_IDLE_S)
        return InbandDigest(int(pending.room_digests[0]), monitor.engine.signature, self.plan.sent_tokens)

    def _write_meta(self, inband: InbandDigest | None) -> None:
        row = np.zeros(8, dtype=np.uint64)  # every slot, every time: metadata rows are reused
        row[META_ROOM_SLOT] = self.plan.room
        if inband is not None:
            row[META_INBAND_SLOTS] = np.array(inband.to_slots(), dtype=np.uint64)
            row[META_ENDPOINT_SLOT] = self.side.probe.endpoint_slot
        self.side.meta[self.out.meta_row] = torch.from_numpy(row.view(np.int64)).to(self.side.meta.device)

    def _apply_before_send(self, last_pages: range) -> None:
        """before_send: prefill's source changes after its digest, before the last WRITE."""
        side, plan = self.side, self.plan
        last_logical = {p - plan.prefix_pages for p in last_pages}
        for target, (rng, snapshot) in self.send_targets:
            phys = self.pages[plan.prefix_pages + target.page]
            old = inject.apply_in_place(side.bufs, phys, target, rng, replacement=snapshot)
            stage = expect.first_stage("before_send", 0, plan.steps, side.settings.step_interval,
                                       page_in_last_write=target.page in last_logical)
            effects = []
            for j, li in enumerate(target.layers):
                new = side.bufs[li][phys].cpu().numpy()
                segs = inject.changed_segments(self.layout, old[j], new, target.frozen)
                effects.append(expect.effect(plan.room, [side.layer_ids[li]], target.page, segs, stage))
            side.events.put(("fault", "prefill", _record(target.fault, plan.room, True, "", target, effects)))

    def _post(self, full_pages: range, *, meta: bool) -> None:
        """One NIXL WRITE of these pages (all layers); transfer faults split or drop rows."""
        side, plan, info = self.side, self.plan, self.info
        pairs, partial = [], []
        for li in range(len(side.layer_ids)):
            for p in full_pages:
                lp = p - plan.prefix_pages
                pair = (li, self.pages[p], info.dst_pages[lp])
                target = next((t for t in self.transfer_targets if t.page == lp and li in t.layers), None)
                if target is None:
                    pairs.append(pair)
                elif target.fault.kind == "partial_write":
                    partial.append((target, li, pair))
                else:
                    self._transfer_effect(target, li, inject.frozen_segments(self.layout, target.frozen))
        for target, li, pair in partial:
            self._send([pair], total=0, limit=target.keep_bytes)
            segs = inject.partial_write_segments(self.layout, target.keep_bytes, target.frozen)
            self._transfer_effect(target, li, segs)
        if meta:
            pairs.append((side.meta_index, self.out.meta_row, info.dst_meta_row))
        if pairs:
            self._send(pairs, total=self.seq + 1 if meta else 0)

    def _transfer_effect(self, target: inject.Target, li: int, segments: list[str]) -> None:
        effect = expect.effect(self.plan.room, [self.side.layer_ids[li]], target.page, segments, ("decode_recv", None))
        self.transfer_effects.setdefault(id(target), []).append(effect)

    def _send(self, pairs: list, *, total: int, limit: int | None = None) -> None:
        side = self.side
        if side.bufs[0].is_cuda:
            # NIXL reads VRAM outside torch's stream order: the forward's writes must be done
            # first (SGLang waits for its forward the same way before a transfer).
            torch.cuda.current_stream().synchronize()
        notif = notification(self.plan.room, self.info.attempt, self.seq, total)
        posted = time.perf_counter()
        handle = side.endpoint.write_rows(side.decode_peer, pairs, notif, byte_limit_per_row=limit)
        if side.cfg.serial_writes:
            side.endpoint.wait(handle, side.cfg.transfer_timeout_s)
            side.stats["write_seconds"] += time.perf_counter() - posted
        self.out.handles.append(handle)
        self.seq += 1
        side.stats["writes"] += 1
        side.stats["bytes"] += sum(limit or side.row_bytes[b] for b, _, _ in pairs)


def _record(fault, room: int, applied: bool, reason: str, target=None, effects=None) -> dict:
    return inject.Applied(
        fault=fault.index, name=fault.name, kind=fault.kind, when=fault.when, after_step=fault.after_step,
        side=fault.side, room=room, applied=applied, reason=reason,
        target=target.describe() if target is not None else {}, effects=effects or [],
    ).to_dict()
