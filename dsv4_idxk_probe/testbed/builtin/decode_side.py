"""The rig's decode process: pre-allocate, receive, step, finish, free.

As SGLang's decode does it: pages and a metadata row are taken from free
lists (LIFO, so pages are reused and "stale" bytes are real), their location
goes to prefill, and the room is committed once every WRITE's completion
notification has arrived. Then the probe's `DecodeMonitor` sees the room at
`decode_recv`, at every step (`decode_step`; each step writes its new C4 slot
into the tail page, never into a frozen slot) and at `decode_finish`, before
the pages go back to the free list.

The rig's oracle runs at the same points: it compares every frozen byte
with the ground truth (no digest involved) and reports what differs, so the
probe's verdicts can be checked cell by cell.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ...digest import get_layout
from ...pd import DecodeAssembly, InbandDigest, RoomId
from ...pd.assembly import peer_endpoint
from ..faults import content, expect, inject
from ..faults.spec import load_fault_spec
from .loopclock import LoopClock
from .modeltime import step_wait
from .config import RigConfig, RoomPlan
from .pool import build_buffers, build_meta, select_device
from .probe_io import LOOPBACK, ProbeSinks, parse_address
from .settings import read_settings
from .transport import NixlEndpoint
from .wire import META_ENDPOINT_SLOT, META_INBAND_SLOTS, META_ROOM_SLOT, TransferInfo, parse_notification

_IDLE_S = 0.0005


@dataclass
class _Room:
    plan: RoomPlan
    rid: RoomId
    pages: list[int]  # by full-prompt page index, then the pages decode steps fill
    meta_row: int
    admitted: float = field(default_factory=time.monotonic)
    seqs: set = field(default_factory=set)
    total: int = 0
    state: str = "transfer"  # -> running -> retiring
    steps_done: int = 0
    targets: list = field(default_factory=list)  # (Target, rng, snapshot)
    truth: dict = field(default_factory=dict)  # layer index -> truth rows of the transferred pages
    pending: object = None
    stream_passed: bool = False  # a model forward on the stream has completed since its finish

    @property
    def sent_phys(self) -> list[int]:
        return self.pages[self.plan.prefix_pages : self.plan.pages]


class DecodeSide:
    def __init__(self, cfg: RigConfig, events, peer, control):
        self.cfg, self.events, self.peer, self.control = cfg, events, peer, control
        self.settings = read_settings()
        self.interval = self.settings.step_interval
        self.layout = get_layout(cfg.layout)
        self.layer_ids = list(cfg.layer_ids)
        self.plan = cfg.room_plan()
        spec = load_fault_spec(self.settings.faults_path) if self.settings.faults_path else None
        self.faults = spec.by_room(self.plan, cfg.seed, side="decode") if spec else {}
        device = select_device(cfg.device, cfg.decode_gpu)
        self.n_pages = cfg.pool_size()
        self.bufs, self.pool_source = build_buffers(self.layout, cfg.layers, self.n_pages, device, cfg.pool_source)
        self.meta = build_meta(cfg.max_running + 1, device)
        self.endpoint = NixlEndpoint("decode", [*self.bufs, self.meta])
        self.free_pages = list(range(self.n_pages - 1, 0, -1))
        self.free_meta = list(range(self.meta.shape[0] - 1, -1, -1))
        self.waiting: deque[RoomPlan] = deque(self.plan)
        self.active: dict[int, _Room] = {}
        self.stats = {"received": 0, "finished": 0, "skipped": 0, "steps": 0, "step_digests": 0, "leaked_pages": 0,
                      "loop_s": 0.0, "loop_cpu_s": 0.0}  # the loop's wall time and thread CPU
        self.batches = 0  # decode batches so far; decode_step digests run every `interval` of them
        self.clock = LoopClock()
        self.model_wait = step_wait(cfg.decode_step_wait, device) if cfg.decode_step_ms else None
        self.probe = self.monitor = self.sinks = None
        if self.settings.enabled:
            # the side SGLang's decode builds (pd.assembly); `exchange_address` sends
            # every room's vector fetch to one address instead of prefill's
            config = self.settings.config
            self.sinks = ProbeSinks(config, "decode")
            self.probe = DecodeAssembly(self.layout, self.layer_ids, self.bufs, config, self.sinks.emit,
                                        self.sinks.metrics, peer_override=parse_address(cfg.exchange_address))
            self.monitor = self.probe.monitor

    # %% main loop

    def run(self) -> None:
        self.peer.send(("hello", self.endpoint.metadata()))
        self.events.put(("ready", "decode", {"pool_source": self.pool_source, "device": str(self.bufs[0].device),
                                             "pages": self.n_pages, "probe": self.settings.enabled}))
        started, cpu_started = time.perf_counter(), time.thread_time()
        while self.waiting or self.active:
            busy = self._admit() | self._poll_notifications() | self._poll_peer() | self._step_all() | self._retire()
            self._check_timeouts()
            if not busy:
                time.sleep(_IDLE_S)
        self.stats["loop_s"] = time.perf_counter() - started
        self.stats["loop_cpu_s"] = time.thread_time() - cpu_started
        self.peer.send(("end",))
        self._shutdown()

    def _admit(self) -> bool:
        admitted = False
        while self.waiting and sum(r.state != "retiring" for r in self.active.values()) < self.cfg.max_running:
            plan = self.waiting[0]
            if len(self.free_pages) < plan.total_pages or not self.free_meta:
                if not self.active:  # nothing will free pages: only leaked ones are missing
                    self.waiting.popleft()
                    self.stats["skipped"] += 1
                    self.events.put(("skipped", "decode", plan.room, "decode pool exhausted by pages held back after failed transfers"))
                    continue
                break
            self.waiting.popleft()
            room = _Room(plan, RoomId(plan.room), [self.free_pages.pop() for _ in range(plan.total_pages)], self.free_meta.pop())
            self._resolve_faults(room)
            self.active[plan.room] = room
            if self.monitor is not None:  # diagnosis: the pages are the room's now, before the WRITE
                # a probe call like the others (the journal event and, with diagnosis, the
                # snapshot's launch), not the loop's own work
                with self.clock.probe("allocate"):
                    self.monitor.room_allocated(room.rid, room.sent_phys, room.plan.sent_tokens)
            self.peer.send(("transfer", TransferInfo(plan.room, 0, tuple(room.sent_phys), room.meta_row)))
            admitted = True
        return admitted

    def _poll_notifications(self) -> bool:
        messages = self.endpoint.poll_notifications()
        for _, message in messages:
            parsed = parse_notification(message)
            room = self.active.get(parsed[0]) if parsed else None
            if room is None or room.state != "transfer":
                continue
            room.seqs.add(parsed[2])
            room.total = parsed[3] or room.total
            if room.total and len(room.seqs) >= room.total:
                self._received(room)
        return bool(messages)

    def _poll_peer(self) -> bool:
        if not self.peer.poll():
            return False
        message = self.peer.recv()
        if message[0] == "failed" and message[1] in self.active:
            self._skip(self.active[message[1]], f"prefill reports: {message[2]}")
        return True

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for room in list(self.active.values()):
            if room.state == "transfer" and now - room.admitted > self.cfg.transfer_timeout_s:
                self._skip(room, f"transfer not complete after {self.cfg.transfer_timeout_s}s")

    def _skip(self, room: _Room, reason: str) -> None:
        """Abort the room. Its pages are not reused: a late WRITE could still land in them."""
        if self.monitor is not None:
            self.monitor.room_skipped(room.rid, reason)
        self.stats["skipped"] += 1
        self.stats["leaked_pages"] += len(room.pages)
        del self.active[room.plan.room]
        self.events.put(("skipped", "decode", room.plan.room, reason))

    # %% a room's life on decode

    def _received(self, room: _Room) -> None:
        """All WRITEs landed: read the metadata row, then the decode_recv stage."""
        row = self.meta[room.meta_row].cpu().numpy().view(np.uint64)
        inband = InbandDigest.from_slots(row[META_INBAND_SLOTS]) if int(row[META_ROOM_SLOT]) == room.plan.room else None
        self._apply_faults(room, in_flight=True)
        self._oracle(room, "decode_recv", None)
        if self.monitor is not None:
            with self.clock.probe("receive"):
                if inband is not None:  # a host-less endpoint is prefill's, on loopback
                    self.probe.remember_peer(room.rid.key, peer_endpoint(int(row[META_ENDPOINT_SLOT]), LOOPBACK))
                self.monitor.room_received(room.rid, room.sent_phys, room.plan.sent_tokens, inband)
        room.state = "running"
        self.stats["received"] += 1
        self.events.put(("received", "decode", room.plan.room))
        self._apply_faults(room, step=0)
        if room.plan.steps == 0:
            self._finish(room)

    def _step_all(self) -> bool:
        """One decode batch step over every running room.

        As SGLang's ``process_batch_result_decode`` hands the probe a whole batch:
        on every `step_interval`-th batch, the rooms still running get
        `decode_step` in one launch; then the step's faults land; then the rooms
        that produced their last token get `decode_finish` in one launch before
        their pages can go.
        """
        running = [r for r in self.active.values() if r.state == "running"]
        if not running:
            return False
        self.batches += 1
        for room in running:
            self._advance(room)
        if self.interval > 0 and self.batches % self.interval == 0:
            going_on = [r for r in running if r.steps_done < r.plan.steps]
            if self.monitor is not None and going_on:
                with self.clock.probe("step"):
                    self.monitor.batch_done([], [(r.rid, r.steps_done) for r in going_on])
            for room in going_on:
                self._oracle(room, "decode_step", room.steps_done)
            self.stats["step_digests"] += len(going_on)
        for room in running:
            self._apply_faults(room, step=room.steps_done)
        self._finish_all([r for r in running if r.steps_done == r.plan.steps])
        if self.cfg.decode_step_ms:
            self.clock.sleep(self.cfg.decode_step_ms / 1e3, self.model_wait)
            if self.cfg.decode_step_wait == "gpu":  # the forward waited on ran after every finish digest
                for room in self.active.values():
                    room.stream_passed = room.state == "retiring"
        self.clock.batch_done(len(running))
        return True

    def _advance(self, room: _Room) -> None:
        """The step's token: a new C4 slot whenever it completes one."""
        t = room.steps_done + 1
        position = room.plan.prompt_tokens + t - 1
        if (position + 1) % self.layout.tokens_per_slot == 0:  # this token completes a C4 slot
            self._write_slot(room, position // self.layout.tokens_per_slot)
        room.steps_done = t
        self.stats["steps"] += 1

    def _write_slot(self, room: _Room, slot: int) -> None:
        """A decode step's new C4 slot, in the tail page or a later one; never a frozen slot."""
        page, within = divmod(slot, self.layout.slots)
        if page < room.plan.pages and within < self.layout.frozen_slots(room.plan.prompt_tokens, page):
            raise AssertionError(f"room {room.plan.room}: decode step would overwrite frozen slot {slot}")
        phys = room.pages[page]
        for li, lid in enumerate(self.layer_ids):
            value = content.step_byte(self.cfg.seed, room.plan.room, lid, slot)
            for seg in self.layout.segments:
                start = seg.offset + within * seg.slot_bytes
                self.bufs[li][phys, start : start + seg.slot_bytes].fill_(value)  # no host copy, no sync

    def _finish(self, room: _Room) -> None:
        self._finish_all([room])

    def _finish_all(self, rooms: list[_Room]) -> None:
        """decode_finish: the last digest (one launch for all), then the pages may go."""
        if not rooms:
            return
        for room in rooms:
            self._oracle(room, "decode_finish", None)
            for target, _, _ in room.targets:
                if target.fault.when == "after_step" and target.fault.after_step > room.plan.steps:
                    reason = f"room finished after {room.plan.steps} decode steps"
                    self.events.put(("fault", "decode", _record(target.fault, room.plan.room, False, reason, target)))
        for room in rooms:  # announced first: a room's log line never precedes its event
            self.stats["finished"] += 1
            self.events.put(("finished", "decode", room.plan.room))
        pending = None
        if self.monitor is not None:
            with self.clock.probe("finish"):
                pending = self.monitor.batch_done([r.rid for r in rooms], [])
        for room in rooms:
            room.pending = pending
            room.state = "retiring"
            room.truth.clear()

    def _retire(self) -> bool:
        """Free the pages of finished rooms once the GPU has read them: as SGLang frees
        them, once a forward queued behind the finish digest has completed (the
        "gpu" model step), else once the digest itself reports done."""
        done = [r for r in self.active.values()
                if r.state == "retiring" and (r.pending is None or r.stream_passed or r.pending.ready())]
        for room in done:
            self.free_pages.extend(reversed(room.pages))
            self.free_meta.append(room.meta_row)
            del self.active[room.plan.room]
        return bool(done)

    # %% faults

    def _resolve_faults(self, room: _Room) -> None:
        for fault in self.faults.get(room.plan.room, []):
            rng = inject.rng_for(self.cfg.seed, fault, room.plan.room)
            target = inject.resolve(fault, room.plan, self.layout, self.layer_ids, rng)
            if isinstance(target, str):
                self.events.put(("fault", "decode", _record(fault, room.plan.room, False, target)))
                continue
            snapshot = None
            if fault.kind == "stale_page":  # the previous occupant's bytes, before this room's WRITE lands
                phys = room.pages[room.plan.prefix_pages + target.page]
                snapshot = [self.bufs[li][phys].cpu().numpy().copy() for li in target.layers]
            room.targets.append((target, rng, snapshot))

    def _apply_faults(self, room: _Room, *, in_flight: bool = False, step: int | None = None) -> None:
        for target, rng, snapshot in room.targets:
            fault = target.fault
            if in_flight != (fault.when == "in_flight"):
                continue
            if not in_flight and fault.after_step != step:
                continue
            when_stage = ("decode_recv", None) if in_flight else expect.next_digest_point(step, room.plan.steps, self.interval, self.batches)
            self._apply(room, target, rng, snapshot, when_stage)

    def _apply(self, room: _Room, target: inject.Target, rng, snapshot, stage) -> None:
        phys = room.pages[room.plan.prefix_pages + target.page]
        replacement, partner = snapshot, None
        if target.fault.kind == "swap_pages":
            partner = self._partner(room, target, rng)
            if isinstance(partner, str):
                self.events.put(("fault", "decode", _record(target.fault, room.plan.room, False, partner, target)))
                return
            other, other_page, other_phys = partner
            replacement = [self.bufs[li][other_phys].cpu().numpy().copy() for li in target.layers]
        old = inject.apply_in_place(self.bufs, phys, target, rng, replacement=replacement)
        effects = self._effects(room, target.page, target.frozen, target.layers, old, phys, stage)
        detail = target.describe()
        if partner is not None:
            other, other_page, other_phys = partner
            for j, li in enumerate(target.layers):
                self.bufs[li][other_phys] = torch.from_numpy(old[j]).to(self.bufs[li].device)
            frozen = self.layout.frozen_slots(other.plan.sent_tokens, other_page)
            other_stage = expect.next_digest_point(other.steps_done, other.plan.steps, self.interval, self.batches)
            effects += self._effects(other, other_page, frozen, target.layers, replacement, other_phys, other_stage)
            detail["partner"] = {"room": other.plan.room, "page": other_page}
        self.events.put(("fault", "decode", _record(target.fault, room.plan.room, True, "", detail=detail, effects=effects)))

    def _effects(self, room: _Room, page: int, frozen: int, layers, old, phys: int, stage) -> list[dict]:
        out = []
        for j, li in enumerate(layers):
            segs = inject.changed_segments(self.layout, old[j], self.bufs[li][phys].cpu().numpy(), frozen)
            out.append(expect.effect(room.plan.room, [self.layer_ids[li]], page, segs, stage))
        return out

    def _partner(self, room: _Room, target: inject.Target, rng):
        """A received, unfinished room to swap with: its bytes are settled and still checked."""
        want = target.fault.with_room
        pool = [r for r in self.active.values() if r.state == "running" and r is not room
                and (want is None or r.plan.room == want) and r.plan.sent_tokens >= self.layout.tokens_per_slot]
        if not pool:
            return f"no partner room resident on decode{'' if want is None else f' (room {want})'} at that moment"
        other = pool[int(rng.integers(len(pool)))]
        pages = [p for p in range(other.plan.sent_pages) if self.layout.frozen_slots(other.plan.sent_tokens, p) > 0]
        page = int(rng.choice(pages))
        return other, page, other.pages[other.plan.prefix_pages + page]

    # %% oracle

    def _oracle(self, room: _Room, stage: str, step: int | None) -> None:
        """Which frozen cells differ from the ground truth right now (no digest involved)."""
        if not self.cfg.oracle:
            return
        plan = room.plan
        logical = range(plan.sent_pages)
        frozen = content.page_frozen_slots(self.layout, plan.sent_tokens, logical)
        full = [plan.prefix_pages + p for p in logical]
        cells = []
        for li, lid in enumerate(self.layer_ids):
            truth = room.truth.get(li)
            if truth is None:
                truth = room.truth[li] = content.truth_rows(self.cfg.seed, plan.room, 0, lid, full, self.layout.row_bytes)
            actual = self.bufs[li][room.sent_phys].cpu().numpy()
            differ = content.frozen_differences(actual, truth, frozen, self.layout)
            cells += [[lid, int(p), self.layout.segments[s].name] for p, s in np.argwhere(differ)]
        self.events.put(("oracle", "decode", {"room": plan.room, "stage": stage, "step": step, "cells": cells}))

    def _shutdown(self) -> None:
        if self.probe is not None:
            self.probe.close()  # delivers every pending verdict before the log closes
        if self.sinks is not None:
            self.sinks.close()
        self.endpoint.close()
        self.events.put(("done", "decode", {**self.stats, "batches": self.batches, **self.clock.stats()}))


def _record(fault, room: int, applied: bool, reason: str, target=None, *, detail=None, effects=None) -> dict:
    return inject.Applied(
        fault=fault.index, name=fault.name, kind=fault.kind, when=fault.when, after_step=fault.after_step,
        side=fault.side, room=room, applied=applied, reason=reason,
        target=detail if detail is not None else (target.describe() if target is not None else {}),
        effects=effects or [],
    ).to_dict()
