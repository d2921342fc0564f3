"""Inside the rig's servers: the byte oracle and the fault injector.

The rig's driver (`run`) hands each server a plan file (``DSV4_IDXK_RIG_PLAN``:
the requests by rid, the fault spec, the seed) and an output folder
(``DSV4_IDXK_RIG_OUT``). This module, loaded by the rig's plugin, hooks
SGLang's decode and prefill paths (wrapt, at import) to:

* remember each room as decode publishes its destination pages
  (``DecodePreallocQueue._send_kv_metadata``: pages, prefix, token count, and
  a snapshot of what those pages held before the WRITE);
* check, at every digest the probe takes on decode, every frozen byte of the
  room against `truth` (the oracle: no digest involved) and write the bad
  (layer, logical page, segment) cells, independently of the probe's own page
  bookkeeping (`DecodeMonitor._submit_jobs` is where it learns a digest is
  taken; the pages it checks are SGLang's);
* apply the faults of docs/faults.md where SGLang would suffer them:
  ``before_send`` in prefill's ``CommonKVSender.send`` (after the probe's
  prefill digest, before the last WRITE is queued); ``in_flight`` and the
  transfer kinds in decode right before ``_commit_transfer_to_req`` (the
  WRITE landed, the completion not yet processed; ``drop_page`` and
  ``partial_write`` restore what decode's page held before the WRITE, the same
  bytes a dropped or cut write leaves); ``after_recv`` / ``after_step N`` at
  the start of the decode forward after step N; ``in_host_pool`` on prefill,
  in the indexer's HiCache host pool row of a page a room loads back from the
  host (armed at ``UnifiedRadixCache.init_load_back`` for that room, applied
  at the next ``L2TransferEngine.submit_host_to_device``: after the page's
  backup, before its load).

Every fault application is written with the number of oracle points the room
had by then, so the driver knows the first digest point that could see it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import wrapt

from ...vocabulary import C4_RATIO as C4, PAGE_TOKENS
from . import truth
from .plugin import ENV_OUT, ENV_PLAN, ENV_ROLE

log = logging.getLogger("dsv4_idxk_probe.rig")

INDEXER_HOST_POOL = "deepseek_v4_c4_indexer"  # the index-K host pool's pool_name


# %% output


class _Out:
    """Append-only JSONL files of this process, one line per record, flushed."""

    def __init__(self, folder: Path, role: str):
        self._folder = folder
        self._role = role
        self._files: dict[str, Any] = {}  # opened on first record: only the scheduler writes any
        self._lock = threading.Lock()

    def write(self, kind: str, record: dict) -> None:
        with self._lock:
            f = self._files.get(kind)
            if f is None:
                self._folder.mkdir(parents=True, exist_ok=True)
                f = self._files[kind] = open(self._folder / f"{self._role}-{os.getpid()}-{kind}.jsonl", "a")
            f.write(json.dumps(record) + "\n")
            f.flush()


# %% what the driver planned


@dataclass
class Plan:
    rooms: dict[str, int]  # rid -> rig room number
    seed: int
    scribble_freed: bool = False  # overwrite a finished room's pages right after SGLang frees them
    faults: Any = None  # sim.faults.FaultSpec
    by_room: dict[int, list] = field(default_factory=dict)  # rig room -> faults that hit it

    @classmethod
    def load(cls, path: str) -> "Plan":
        doc = json.loads(Path(path).read_text())
        plan = cls({str(k): int(v) for k, v in doc["rooms"].items()}, int(doc.get("seed", 0)),
                   bool(doc.get("scribble_freed", False)))
        if doc.get("faults"):
            from ..faults.spec import load_fault_spec
            from ..faults.plan import RoomPlan

            plan.faults = load_fault_spec(doc["faults"])
            rooms = [RoomPlan(room=r, prompt_tokens=1, prefix_pages=0, steps=0) for r in sorted(plan.rooms.values())]
            plan.by_room = plan.faults.by_room(rooms, plan.seed)
        return plan


# A swap due when no other room is resident waits for one this many forwards of its room
# (its effects are placed from where it was applied, not from its after_step).
SWAP_WAIT_FORWARDS = 16


@dataclass
class Track:
    """One room on decode, as the rig sees it (from SGLang's own objects)."""

    rid: str
    rig_room: int | None
    room: int
    start: int  # decode prefix (page aligned)
    n_tokens: int  # transferred tokens
    pages: list[int]  # physical page of each logical page
    tokens: np.ndarray | None = None  # token ids by absolute position, known at commit
    before: dict[int, list[np.ndarray]] = field(default_factory=dict)  # logical page -> rows before the WRITE
    points: int = 0  # oracle points so far
    forwards: int = 0  # decode forwards run
    req_pool_idx: int | None = None
    released: bool = False  # SGLang freed its pages (a swap partner must still hold them)
    faults_done: set = field(default_factory=set)  # indices of its faults applied or refused here
    changed: set = field(default_factory=set)  # logical pages its faults changed
    waiting: set = field(default_factory=set)  # swap faults due, waiting for a partner room


class InServer:
    def __init__(self, role: str, plan_path: str, out: _Out):
        from ...digest import get_layout

        self.role = role
        self.plan_path = plan_path
        self.plan_mtime = None
        self.plan = Plan({}, 0)
        self.refresh()
        self.out = out
        self.layout = get_layout("fp8")
        self.tracks: dict[int, Track] = {}  # bootstrap room -> Track (decode)
        self.by_pool_idx: dict[int, Track] = {}
        self.buffers: list[torch.Tensor] = []
        self.layer_ids: list[int] = []
        self.lock = threading.Lock()
        self.armed: tuple | None = None  # (req, in_host_pool faults) waiting for the room's host-to-device load
        self.host_done: set[tuple[int, str]] = set()  # (fault, rid) in_host_pool faults applied or refused

    def refresh(self) -> None:
        """Re-read the plan when the driver replaced it (a new phase)."""
        try:
            mtime = os.stat(self.plan_path).st_mtime_ns
        except OSError:
            return
        if mtime != self.plan_mtime:
            self.plan = Plan.load(self.plan_path)
            self.plan_mtime = mtime

    # %% the pool

    def bind_pool(self, pool: Any) -> None:
        if self.buffers:
            return
        pool = pool.get_kvcache() if hasattr(pool, "get_kvcache") else pool
        indexer = pool.index_pools[C4] if getattr(pool, "index_pools", None) else pool.c4_indexer_kv_pool
        self.buffers = list(indexer.index_k_with_scale_buffer)
        ratios = list(pool.compression_ratios)
        self.layer_ids = [layer for layer, ratio in enumerate(ratios) if ratio == C4]

    def rows(self, page: int, layers: list[int] | None = None) -> list[np.ndarray]:
        idx = range(len(self.buffers)) if layers is None else layers
        return [self.buffers[i][page].numpy().copy() for i in idx]

    # %% faults

    def faults_for(self, rid: str, when: tuple[str, ...]) -> list:
        rig_room = self.plan.rooms.get(rid)
        if rig_room is None:
            return []
        return [f for f in self.plan.by_room.get(rig_room, []) if f.when in when]

    def record_fault(self, fault, track_or_room: Any, applied: bool, reason: str = "", target: dict | None = None,
                     cells: list | None = None, point: int = 0, rid: str | None = None,
                     expect: list | None = None, roundtrip: list | None = None) -> None:
        t = track_or_room
        if isinstance(t, Track):
            t.faults_done.add(fault.index)
            if applied and target and target.get("page") is not None:
                t.changed.add(int(target["page"]))
        self.out.write("faults", {
            "fault": fault.index, "name": fault.name, "kind": fault.kind, "when": fault.when,
            "after_step": fault.after_step, "side": self.role, "rid": rid or getattr(t, "rid", None),
            "rig_room": getattr(t, "rig_room", None), "room": getattr(t, "room", None),
            "applied": applied, "reason": reason, "target": target or {}, "cells": cells or [], "point": point,
            "expect": expect or [], "roundtrip": roundtrip or [],
        })

    def apply(self, fault, track: Track, *, replacement_for=None) -> None:
        """Change the target rows of `track` now and record the frozen cells that changed."""
        from ..faults.inject import apply_in_place, changed_segments, resolve, rng_for
        from ..faults.plan import RoomPlan

        plan = RoomPlan(room=track.rig_room, prompt_tokens=track.start + track.n_tokens,
                        prefix_pages=track.start // PAGE_TOKENS, steps=0)
        rng = rng_for(self.plan.seed, fault, track.rig_room)
        target = resolve(fault, plan, self.layout, self.layer_ids, rng)
        if isinstance(target, str):
            self.record_fault(fault, track, False, target, point=track.points)
            return
        phys = track.pages[target.page]
        kind = fault.kind
        replacement = None
        if kind in ("stale_page", "drop_page", "partial_write"):
            before = track.before.get(target.page)
            if before is None:
                self.record_fault(fault, track, False, "no snapshot of the page before the WRITE", point=track.points)
                return
            replacement = [before[i] for i in target.layers]
        if kind == "swap_pages":
            partner = self._partner(fault, track)
            if partner is None:
                if track.forwards - fault.after_step < SWAP_WAIT_FORWARDS:
                    track.waiting.add(fault.index)  # tried again at the room's next forward
                    return
                self.record_fault(fault, track, False, "no partner room resident", point=track.points)
                return
            return self._swap(fault, track, target, partner, rng)
        if kind in ("drop_page", "partial_write"):
            old = self.rows(phys, target.layers)
            for j, li in enumerate(target.layers):
                new = old[j].copy()
                keep = target.keep_bytes if kind == "partial_write" else 0
                new[keep:] = replacement[j][keep:]
                self.buffers[li][phys].copy_(torch.from_numpy(new))
        else:
            old = apply_in_place(self.buffers, phys, target, rng, replacement=replacement)
        new = self.rows(phys, target.layers)
        cells, expect = [], []
        before = track.before.get(target.page)
        previous = self._previous_room(track, phys)
        for j, layer in enumerate(target.layer_ids):
            for seg in changed_segments(self.layout, old[j], new[j], target.frozen):
                cells.append([layer, target.page, seg])
                kind = _diagnosis_of(self.layout, new[j], before[target.layers[j]] if before else None,
                                     target.frozen, seg)
                expect.append([layer, target.page, seg, kind, previous if kind == "previous_occupant" else None])
        self.record_fault(fault, track, True, target=target.describe(), cells=cells, point=track.points,
                          expect=expect)

    def apply_in_host_pool(self, fault, req, transfer) -> None:
        """in_host_pool: change the host-pool row of one page `req` is loading back, before the
        load copies it (the backup has stored it and round-trip mode its digest). Both sides
        then digest the changed bytes, so only round-trip mode can see it: it must report the
        row's `host` leg, and that the row matched at backup."""
        from ..faults.inject import apply_in_place, changed_segments, resolve, rng_for
        from ..faults.plan import RoomPlan

        pool = transfer.host_pool
        size = int(pool.slot_page_size)
        host_rows = [int(r) for r in (transfer.host_indices.reshape(-1)[::size] // size).tolist()]
        device_rows = [int(r) for r in (transfer.device_indices.reshape(-1)[::size] // size).tolist()]
        layers = _host_layers(pool)
        tokens = np.asarray(list(req.origin_input_ids), dtype=np.int64)
        # which of the room's pages each loaded row is, read from the row's own bytes (the truth)
        loaded = {}
        for j, row in enumerate(host_rows):
            page = _page_of(layers[0][row].numpy(), self.layer_ids[0], tokens)
            if page is not None:
                loaded[page] = j
        track = Track(_rid(req), self.plan.rooms.get(_rid(req)), int(req.bootstrap_room), 0, len(tokens), [])
        plan = RoomPlan(room=track.rig_room, prompt_tokens=len(tokens), prefix_pages=0, steps=0)
        rng = rng_for(self.plan.seed, fault, track.rig_room)
        target = resolve(fault, plan, self.layout, self.layer_ids, rng, random_pages=sorted(loaded))
        if isinstance(target, str):
            self.record_fault(fault, track, False, target)
            return
        if target.page not in loaded:
            self.record_fault(fault, track, False, f"logical page {target.page} was not loaded from the host "
                                                   f"(pages {sorted(loaded)} were)")
            return
        host_row, device_row = host_rows[loaded[target.page]], device_rows[loaded[target.page]]
        old = apply_in_place(layers, host_row, target, rng)
        new = [layers[li][host_row].numpy().copy() for li in target.layers]
        cells = [[layer, target.page, seg] for j, layer in enumerate(target.layer_ids)
                 for seg in changed_segments(self.layout, old[j], new[j], target.frozen)]
        roundtrip = [{"pool": str(pool.pool_name), "host_row": host_row, "layer": li, "device_page": device_row,
                      "leg": "host", "at_backup": "match"} for li in target.layers]
        self.record_fault(fault, track, True, target=dict(target.describe(), pool=str(pool.pool_name),
                                                          host_row=host_row, device_page=device_row),
                          cells=cells, roundtrip=roundtrip)

    def _previous_room(self, track: Track, phys: int) -> str | None:
        """The probe's key of the room that held physical page `phys` before `track` (tracks
        are kept in the order decode allocated them), None if none did."""
        with self.lock:
            tracks = list(self.tracks.values())
        for t in reversed(tracks):
            if t is not track and phys in t.pages:
                return f"{t.room}/0"
        return None

    def _partner(self, fault, track: Track) -> Track | None:
        with self.lock:
            others = [t for t in self.tracks.values()  # a room of the run decode holds now (no health check)
                      if t is not track and t.tokens is not None and not t.released and t.rig_room is not None]
        if fault.with_room is not None:
            return next((t for t in others if t.rig_room == fault.with_room), None)
        # a room no fault names: its own fault would hide what the swap did to it; else one
        # whose faults all ran here already (the swap then avoids the pages they changed)
        clean = [t for t in others if not self.plan.by_room.get(t.rig_room)]
        settled = [t for t in others if all(f.index in t.faults_done for f in self.plan.by_room.get(t.rig_room, ()))]
        others = clean or settled or others
        return others[0] if others else None

    def _swap(self, fault, track: Track, target, partner: Track, rng) -> None:
        # a partner page with as many frozen slots as the target's, where it has one: the
        # swapped bytes then have the same content digest in both rooms (docs/diagnosis.md)
        pages = [k for k in range(len(partner.pages)) if k not in partner.changed] or list(range(len(partner.pages)))
        alike = [k for k in pages if self.layout.frozen_slots(partner.n_tokens, k) == target.frozen]
        page_b = int(alike[rng.integers(len(alike))]) if alike else int(pages[rng.integers(len(pages))])
        phys_a, phys_b = track.pages[target.page], partner.pages[page_b]
        old_a, old_b = self.rows(phys_a, target.layers), self.rows(phys_b, target.layers)
        for j, li in enumerate(target.layers):
            self.buffers[li][phys_a].copy_(torch.from_numpy(old_b[j]))
            self.buffers[li][phys_b].copy_(torch.from_numpy(old_a[j]))
        cells_a, cells_b = [], []
        frozen_b = self.layout.frozen_slots(partner.n_tokens, page_b)
        for j, layer in enumerate(target.layer_ids):
            cells_a += [[layer, target.page, s] for s in _changed(self.layout, old_a[j], old_b[j], target.frozen)]
            cells_b += [[layer, page_b, s] for s in _changed(self.layout, old_b[j], old_a[j], frozen_b)]
        # each room's cell holds the other's page, found as such when the frozen counts agree
        alike = frozen_b == target.frozen
        expect_a = [c + (["other_room", f"{partner.room}/0"] if alike else [_diagnosis_of(
            self.layout, old_b[target.layer_ids.index(c[0])], None, target.frozen, c[2]), None]) for c in cells_a]
        expect_b = [c + (["other_room", f"{track.room}/0"] if alike else [_diagnosis_of(
            self.layout, old_a[target.layer_ids.index(c[0])], None, frozen_b, c[2]), None]) for c in cells_b]
        described = dict(target.describe(), partner_rid=partner.rid, partner_page=page_b)
        partner.changed.add(page_b)
        self.record_fault(fault, track, True, target=described, cells=cells_a, point=track.points, expect=expect_a)
        self.out.write("faults", {
            "fault": fault.index, "name": fault.name, "kind": fault.kind, "when": fault.when,
            "after_step": fault.after_step, "side": self.role, "rid": partner.rid, "rig_room": partner.rig_room,
            "room": partner.room, "applied": True, "reason": "swap partner", "target": described,
            "cells": cells_b, "point": partner.points, "partner_of": track.rid, "expect": expect_b,
        })

    # %% the oracle

    def oracle_point(self, room: int, attempt: int, stage: str, step: int | None) -> None:
        with self.lock:
            track = self.tracks.get(room)
        if track is None or track.tokens is None:
            self.out.write("oracle", {"room": room, "attempt": attempt, "stage": stage, "step": step, "cells": None,
                                      "note": "room not known to the rig"})
            return
        cells = []
        for k, phys in enumerate(track.pages):
            frozen = self.layout.frozen_slots(track.n_tokens, k)
            if frozen <= 0:
                continue
            positions = track.start + k * PAGE_TOKENS + np.arange(frozen) * truth.TOKENS_PER_SLOT + 3
            for li, layer in enumerate(self.layer_ids):
                want = truth.slot_bytes(layer, positions, track.tokens[positions])
                row = self.buffers[li][phys].numpy()
                payload = row[: frozen * truth.PAYLOAD].reshape(frozen, truth.PAYLOAD)
                scale_at = self.layout.slots * truth.PAYLOAD
                scale = row[scale_at : scale_at + frozen * truth.SCALE].reshape(frozen, truth.SCALE)
                if not np.array_equal(payload, want[:, : truth.PAYLOAD]):
                    cells.append([layer, k, "payload"])
                if not np.array_equal(scale, want[:, truth.PAYLOAD :]):
                    cells.append([layer, k, "scale"])
        track.points += 1
        self.out.write("oracle", {"room": room, "attempt": attempt, "rid": track.rid, "rig_room": track.rig_room,
                                  "stage": stage, "step": step, "cells": cells, "index": track.points - 1,
                                  "start": track.start, "n_tokens": track.n_tokens})


def _diagnosis_of(layout, new: np.ndarray, before: np.ndarray | None, frozen: int, segment: str) -> str:
    """What the probe must say a changed cell became, from the bytes themselves: its frozen
    bytes all zero, or those the page held before the WRITE, or neither (docs/diagnosis.md)."""
    seg = next(s for s in layout.segments if s.name == segment)
    span = slice(seg.offset, seg.offset + frozen * seg.slot_bytes)
    if not new[span].any():
        return "zeroed"
    if before is not None and np.array_equal(new[span], before[span]):
        return "previous_occupant"
    return "unknown"


def _page_of(row: np.ndarray, layer: int, tokens: np.ndarray) -> int | None:
    """The full prompt page whose true bytes (`truth`) a row of `layer` holds, if any."""
    slots = PAGE_TOKENS // truth.TOKENS_PER_SLOT
    for page in range(len(tokens) // PAGE_TOKENS):
        positions = page * PAGE_TOKENS + np.arange(slots) * truth.TOKENS_PER_SLOT + 3
        want = truth.slot_bytes(layer, positions, tokens[positions])[:, : truth.PAYLOAD]
        if np.array_equal(row[: slots * truth.PAYLOAD].reshape(slots, truth.PAYLOAD), want):
            return page
    return None


def _host_layers(pool) -> list[torch.Tensor]:
    """A DeepSeek-V4 host pool's rows, one uint8 [host pages, item_bytes] view per layer."""
    if pool.layout == "layer_first":
        return list(pool.kv_buffer)
    if pool.layout == "page_first":
        return [pool.kv_buffer[:, layer, :] for layer in range(pool.layer_num)]
    return [pool.kv_buffer[:, layer, 0, :] for layer in range(pool.layer_num)]


def _changed(layout, old: np.ndarray, new: np.ndarray, frozen: int) -> list[str]:
    from ..faults.inject import changed_segments

    return changed_segments(layout, old, new, frozen)


# %% hooks

_state: InServer | None = None


def _rid(req: Any) -> str:
    return str(getattr(req, "rid", ""))


def _on_send_metadata(wrapped, instance, args, kwargs):
    try:  # before: the pages' bytes before the transfer, which may land once the metadata is out
        _record_room(instance, *args, **kwargs)
    except Exception:
        log.exception("rig: recording a room failed")
    return wrapped(*args, **kwargs)


def _record_room(queue, decode_req, kv_indices, page_size, state_indices=None, **metadata):
    state = _state
    state.refresh()
    state.bind_pool(queue.token_to_kv_pool)
    req = decode_req.req
    start = int(metadata.get("decode_prefix_len", 0) or 0)
    indices = np.asarray(kv_indices).reshape(-1)
    pages = [int(p) for p in indices[::page_size] // page_size]
    track = Track(_rid(req), state.plan.rooms.get(_rid(req)), int(req.bootstrap_room), start, len(indices), pages)
    if state.faults_for(track.rid, ("in_flight", "after_recv", "after_step")):
        track.before = {k: state.rows(p) for k, p in enumerate(pages)}
    with state.lock:
        state.tracks[track.room] = track


def _on_commit(wrapped, instance, args, kwargs):
    def _pick(decode_req, *_a, **_k):
        return decode_req

    decode_req = _pick(*args, **kwargs)
    try:
        _before_commit(decode_req)
    except Exception:
        log.exception("rig: in-flight faults failed")
    result = wrapped(*args, **kwargs)
    try:
        _after_commit(decode_req)
    except Exception:
        log.exception("rig: recording a commit failed")
    return result


def _before_commit(decode_req) -> None:
    state = _state
    req = decode_req.req
    track = state.tracks.get(int(req.bootstrap_room))
    if track is None:
        return
    track.tokens = np.asarray(list(req.origin_input_ids) + list(req.output_ids), dtype=np.int64)
    for fault in state.faults_for(track.rid, ("in_flight",)):
        state.apply(fault, track)


def _after_commit(decode_req) -> None:
    state = _state
    req = decode_req.req
    track = state.tracks.get(int(req.bootstrap_room))
    if track is None:
        return
    idx = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if idx is not None:
        track.req_pool_idx = int(idx)
        with state.lock:
            state.by_pool_idx[int(idx)] = track


def _before_decode_forward(forward_batch) -> None:
    """after_recv / after_step N: at the start of the decode forward after step N."""
    state = _state
    if state is None or not forward_batch.forward_mode.is_decode():
        return
    for idx in forward_batch.req_pool_indices.tolist():
        track = state.by_pool_idx.get(int(idx))
        if track is None:
            continue
        done = track.forwards
        track.forwards += 1
        for fault in state.faults_for(track.rid, ("after_recv", "after_step")):
            if fault.after_step == done or fault.index in track.waiting:
                track.waiting.discard(fault.index)
                state.apply(fault, track)


def _on_release(wrapped, instance, args, kwargs):
    """After SGLang freed a finished room's pages: with `scribble_freed`, zero them at once,
    as the next room's transfer or a HiCache load into a reused page would overwrite them."""
    result = wrapped(*args, **kwargs)
    try:
        _scribble(*args, **kwargs)
    except Exception:
        log.exception("rig: scribbling freed pages failed")
    return result


def _scribble(req, *_a, **_k) -> None:
    state = _state
    if not req.finished():
        return
    track = state.tracks.get(int(getattr(req, "bootstrap_room", -1) or -1))
    if track is not None:
        track.released = True
        for fault in state.faults_for(track.rid, ("after_step",)):
            if fault.index in track.waiting:  # it finished before another room was resident
                track.waiting.discard(fault.index)
                state.record_fault(fault, track, False, "no partner room resident", point=track.points)
    if not state.plan.scribble_freed:
        return
    if track is None or _rid(req) not in state.plan.rooms:
        return
    for buf in state.buffers:
        for page in track.pages:
            buf[page].zero_()
    state.out.write("events", {"event": "scribbled_freed_pages", "rid": track.rid, "room": track.room,
                               "pages": track.pages})


def _on_submit_jobs(wrapped, instance, args, kwargs):
    def _pick(jobs, *_a, **_k):
        return jobs

    try:
        for job_state, stage, step in _pick(*args, **kwargs):
            _state.oracle_point(int(job_state.room.room), int(job_state.room.attempt), stage, step)
    except Exception:
        log.exception("rig: oracle failed")
    return wrapped(*args, **kwargs)


def _on_prefill_send(wrapped, instance, args, kwargs):
    try:
        _before_send(instance, *args, **kwargs)
    except Exception:
        log.exception("rig: before_send faults failed")
    return wrapped(*args, **kwargs)


def _before_send(sender, kv_indices, *_a, **_k) -> None:
    """before_send: on the sender's last send, after the probe's digest, before the WRITE is queued."""
    state = _state
    total = getattr(sender, "num_kv_indices", None)
    if total is None or int(getattr(sender, "curr_idx", 0)) + len(kv_indices) != int(total):
        return
    room = int(sender.bootstrap_room)
    track = state.tracks.get(room)
    if track is None:
        return
    for fault in state.faults_for(track.rid, ("before_send",)):
        # only pages of this (last) send can still change what decode receives
        state.apply(fault, track)


def _prefill_track(scheduler, req, last_chunk=False, end_idx=None, *_a, **_k) -> None:
    state = _state
    if last_chunk:
        state.refresh()
    if not last_chunk or _rid(req) not in state.plan.rooms:
        return
    for fault in state.faults_for(_rid(req), ("in_host_pool",)):
        if (fault.index, _rid(req)) not in state.host_done:  # its last chunk is sent: no load is coming
            state.host_done.add((fault.index, _rid(req)))
            track = Track(_rid(req), state.plan.rooms.get(_rid(req)), int(req.bootstrap_room), 0, 0, [])
            state.record_fault(fault, track, False, "the room loaded no page from the HiCache host pool")
    if not state.faults_for(_rid(req), ("before_send",)):
        return
    state.bind_pool(scheduler.token_to_kv_pool_allocator)
    start = int(req.disagg_decode_prefix_len or 0)
    end = int(end_idx) if end_idx is not None else min(int(req.extend_end), len(req.origin_input_ids))
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end]
    pages = [int(p) for p in (row[::PAGE_TOKENS] // PAGE_TOKENS).tolist()]
    track = Track(_rid(req), state.plan.rooms.get(_rid(req)), int(req.bootstrap_room), start, end - start, pages)
    with state.lock:
        state.tracks[track.room] = track


def _around_send_kv_chunk(wrapped, instance, args, kwargs):
    try:
        _prefill_track(instance, *args, **kwargs)
    except Exception:
        log.exception("rig: tracking a prefill room failed")
    return wrapped(*args, **kwargs)


def _around_init_load_back(wrapped, instance, args, kwargs):
    """Arm the room's in_host_pool faults for the load this call queues."""
    def _pick(params, *_a, **_k):
        return params

    params = _pick(*args, **kwargs)
    try:
        _arm_host_faults(instance, params)
    except Exception:
        log.exception("rig: arming a host-pool fault failed")
    result = wrapped(*args, **kwargs)
    if _state is not None and _state.armed is not None and (not result or not result[0]):
        _state.armed = None  # nothing was loaded
    return result


def _arm_host_faults(cache, params) -> None:
    state = _state
    req = getattr(params, "req", None)
    if req is None:
        return
    state.refresh()
    faults = [f for f in state.faults_for(_rid(req), ("in_host_pool",)) if (f.index, _rid(req)) not in state.host_done]
    if faults:
        state.bind_pool(cache.token_to_kv_pool_allocator)
        state.armed = (req, faults)


def _around_submit_host_to_device(wrapped, instance, args, kwargs):
    def _pick(transfers, *_a, **_k):
        return transfers

    try:
        _apply_host_faults(_pick(*args, **kwargs))
    except Exception:
        log.exception("rig: a host-pool fault failed")
    return wrapped(*args, **kwargs)


def _apply_host_faults(transfers) -> None:
    state = _state
    armed, state.armed = state.armed, None
    if armed is None:
        return
    req, faults = armed
    transfer = next((t for t in transfers if str(getattr(t.host_pool, "pool_name", "")) == INDEXER_HOST_POOL
                     and t.host_indices is not None and t.host_indices.numel()), None)
    for fault in faults:
        state.host_done.add((fault.index, _rid(req)))
        if transfer is None:
            track = Track(_rid(req), state.plan.rooms.get(_rid(req)), int(req.bootstrap_room), 0, 0, [])
            state.record_fault(fault, track, False, "the room's load moved no index-K page")
        else:
            state.apply_in_host_pool(fault, req, transfer)


def apply() -> None:
    """Arm the hooks of this server's role (decode or prefill) if the driver gave a plan."""
    global _state
    plan_path, out = os.environ.get(ENV_PLAN), os.environ.get(ENV_OUT)
    if not plan_path or not out:
        return
    role = os.environ.get(ENV_ROLE, "")
    _state = InServer(role, plan_path, _Out(Path(out), role))
    from . import standin_model

    if role == "decode":
        standin_model.BEFORE_FORWARD.append(_before_decode_forward)
        wrapt.register_post_import_hook(lambda m: (
            wrapt.wrap_function_wrapper(m, "DecodePreallocQueue._send_kv_metadata", _on_send_metadata),
            wrapt.wrap_function_wrapper(m, "DecodeTransferQueue._commit_transfer_to_req", _on_commit),
        ), "sglang.srt.disaggregation.decode")
        wrapt.register_post_import_hook(
            lambda m: wrapt.wrap_function_wrapper(m, "DecodeMonitor._submit_jobs", _on_submit_jobs),
            "dsv4_idxk_probe.pd.decode",
        )
        wrapt.register_post_import_hook(
            lambda m: wrapt.wrap_function_wrapper(m, "release_kv_cache", _on_release),
            "sglang.srt.managers.scheduler_components.batch_result_processor",
        )
    elif role == "prefill":
        wrapt.register_post_import_hook(
            lambda m: wrapt.wrap_function_wrapper(m, "CommonKVSender.send", _on_prefill_send),
            "sglang.srt.disaggregation.common.conn",
        )
        wrapt.register_post_import_hook(
            lambda m: wrapt.wrap_function_wrapper(m, "SchedulerDisaggregationPrefillMixin.send_kv_chunk",
                                                  _around_send_kv_chunk),
            "sglang.srt.disaggregation.prefill",
        )
        wrapt.register_post_import_hook(
            lambda m: wrapt.wrap_function_wrapper(m, "UnifiedRadixCache.init_load_back", _around_init_load_back),
            "sglang.srt.mem_cache.unified_radix_cache",
        )
        wrapt.register_post_import_hook(
            lambda m: wrapt.wrap_function_wrapper(m, "L2TransferEngine.submit_host_to_device",
                                                  _around_submit_host_to_device),
            "sglang.srt.mem_cache.l2_transfer",
        )
