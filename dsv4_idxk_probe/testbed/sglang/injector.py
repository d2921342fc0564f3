"""Inside the rig's servers: the fault injector.

Applies the faults of docs/faults.md where SGLang would suffer them (the hooks
call it at those points): ``before_send`` in prefill's ``CommonKVSender.send``
(after the probe's prefill digest, before the last WRITE is queued);
``in_flight`` and the transfer kinds in decode right before
``_commit_transfer_to_req`` (the WRITE landed, the completion not yet
processed; ``drop_page`` and ``partial_write`` restore what decode's page held
before the WRITE, the same bytes a dropped or cut write leaves);
``after_recv`` / ``after_step N`` at the start of the decode forward after
step N; ``in_host_pool`` on prefill, in the indexer's HiCache host pool row of
a page a room loads back from the host (armed at
``UnifiedRadixCache.init_load_back`` for that room, applied at the next
``L2TransferEngine.submit_host_to_device``: after the page's backup, before
its load).

Every fault application is written with the number of oracle points the room
had by then, so the driver knows the first digest point that could see it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from ...vocabulary import PAGE_TOKENS
from . import truth
from .output import Out
from .plan import PlanFile
from .rooms import Rooms, Track, rid_of

log = logging.getLogger("dsv4_idxk_probe.rig")

INDEXER_HOST_POOL = "deepseek_v4_c4_indexer"  # the index-K host pool's pool_name


class Injector:
    def __init__(self, role: str, plan_file: PlanFile, rooms: Rooms, out: Out):
        self.role = role
        self.plan_file = plan_file
        self.rooms = rooms
        self.out = out
        self.armed: tuple | None = None  # (req, in_host_pool faults) waiting for the room's host-to-device load
        self.host_done: set[tuple[int, str]] = set()  # (fault, rid) in_host_pool faults applied or refused

    def record_fault(self, fault, track_or_room: Any, applied: bool, reason: str = "", target: dict | None = None,
                     cells: list | None = None, point: int = 0, rid: str | None = None,
                     expect: list | None = None, roundtrip: list | None = None) -> None:
        """One record per (fault, room, transfer): applied with what it changed, or not
        applied with the reason. `n_tokens` and `transfer` name the room's transfer (a
        retracted room is sent again with more tokens), so the driver expects each
        application at its own transfer's digest points."""
        t = track_or_room
        if isinstance(t, Track):
            t.faults_done.add(fault.index)
            t.waiting.discard(fault.index)
            if applied and target and target.get("page") is not None:
                t.changed.add(int(target["page"]))
        self.out.write("faults", {
            "fault": fault.index, "name": fault.name, "kind": fault.kind, "when": fault.when,
            "after_step": fault.after_step, "side": self.role, "rid": rid or getattr(t, "rid", None),
            "rig_room": getattr(t, "rig_room", None), "room": getattr(t, "room", None),
            "n_tokens": getattr(t, "n_tokens", None), "transfer": getattr(t, "transfer", 0),
            "applied": applied, "reason": reason, "target": target or {}, "cells": cells or [], "point": point,
            "expect": expect or [], "roundtrip": roundtrip or [],
        })

    def apply(self, fault, track: Track) -> None:
        """Apply `fault` to `track` now; never raises: a target the room or the model cannot
        have (or an injector failure) is recorded as not applied, with the reason, and
        SGLang's call goes on."""
        try:
            self._apply(fault, track)
        except Exception as exc:  # the rig must never take a server down, nor leave a fault unrecorded
            log.exception("rig: applying fault %s to room %s failed", fault.index, track.rid)
            self.record_fault(fault, track, False, f"the injector failed: {type(exc).__name__}: {exc}",
                              point=track.points)

    def room_ended(self, track: Track, faults: list) -> None:
        """The room finished (SGLang released its pages): its faults that never came due
        (an after_step past its last step, a swap still waiting) are recorded as not
        applied, so every planned fault has a record."""
        for fault in faults:
            if fault.index in track.faults_done:
                continue
            if fault.index in track.waiting:
                reason = "no partner room resident"
            elif fault.when == "in_flight":
                reason = f"room ended at step {track.forwards} before decode committed its transfer"
            else:
                reason = f"room ended at step {track.forwards}"
            self.record_fault(fault, track, False, reason, point=track.points)

    def _apply(self, fault, track: Track) -> None:
        """Change the target rows of `track` now and record the frozen cells that changed."""
        from ..faults.inject import apply_in_place, changed_segments, resolve, rng_for
        from ..faults.plan import RoomPlan

        plan = RoomPlan(room=track.rig_room, prompt_tokens=track.start + track.n_tokens,
                        prefix_pages=track.start // PAGE_TOKENS, steps=0)
        rng = rng_for(self.plan_file.plan.seed, fault, track.rig_room)
        target = resolve(fault, plan, self.rooms.layout, self.rooms.layer_ids, rng)
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
            if partner is None:  # tried again at the room's next forward, while it lives
                track.waiting.add(fault.index)
                return
            return self._swap(fault, track, target, partner, rng)
        if kind in ("drop_page", "partial_write"):
            old = self.rooms.rows(phys, target.layers)
            for j, li in enumerate(target.layers):
                new = old[j].copy()
                keep = target.keep_bytes if kind == "partial_write" else 0
                new[keep:] = replacement[j][keep:]
                self.rooms.buffers[li][phys].copy_(torch.from_numpy(new))
        else:
            old = apply_in_place(self.rooms.buffers, phys, target, rng, replacement=replacement)
        new = self.rooms.rows(phys, target.layers)
        cells, expect = [], []
        before = track.before.get(target.page)
        previous = self._previous_room(track, phys)
        for j, layer in enumerate(target.layer_ids):
            for seg in changed_segments(self.rooms.layout, old[j], new[j], target.frozen):
                cells.append([layer, target.page, seg])
                kind = _diagnosis_of(self.rooms.layout, new[j], before[target.layers[j]] if before else None,
                                     target.frozen, seg)
                expect.append([layer, target.page, seg, kind, previous if kind == "previous_occupant" else None])
        self.record_fault(fault, track, True, target=target.describe(), cells=cells, point=track.points,
                          expect=expect)

    def apply_in_host_pool(self, fault, req, transfer) -> None:
        """`_apply_in_host_pool`, recorded as not applied (never raised) if it fails."""
        try:
            self._apply_in_host_pool(fault, req, transfer)
        except Exception as exc:
            log.exception("rig: applying host-pool fault %s failed", fault.index)
            rid = rid_of(req)
            track = Track(rid, self.plan_file.plan.rooms.get(rid), int(req.bootstrap_room), 0,
                          len(list(req.origin_input_ids)), [])
            self.record_fault(fault, track, False, f"the injector failed: {type(exc).__name__}: {exc}")

    def _apply_in_host_pool(self, fault, req, transfer) -> None:
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
            page = _page_of(layers[0][row].numpy(), self.rooms.layer_ids[0], tokens)
            if page is not None:
                loaded[page] = j
        rid = rid_of(req)
        track = Track(rid, self.plan_file.plan.rooms.get(rid), int(req.bootstrap_room), 0, len(tokens), [])
        plan = RoomPlan(room=track.rig_room, prompt_tokens=len(tokens), prefix_pages=0, steps=0)
        rng = rng_for(self.plan_file.plan.seed, fault, track.rig_room)
        target = resolve(fault, plan, self.rooms.layout, self.rooms.layer_ids, rng, random_pages=sorted(loaded))
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
                 for seg in changed_segments(self.rooms.layout, old[j], new[j], target.frozen)]
        # layers by their global ids, as the probe's records and `diff` name them (pool index beside)
        roundtrip = [{"pool": str(pool.pool_name), "host_row": host_row, "layer": layer, "pool_layer": li,
                      "device_page": device_row, "leg": "host", "at_backup": "match"}
                     for li, layer in zip(target.layers, target.layer_ids)]
        self.record_fault(fault, track, True, target=dict(target.describe(), pool=str(pool.pool_name),
                                                          host_row=host_row, device_page=device_row),
                          cells=cells, roundtrip=roundtrip)

    def _previous_room(self, track: Track, phys: int) -> str | None:
        """The probe's key of the room that held physical page `phys` before `track` (tracks
        are kept in the order decode allocated them), None if none did."""
        with self.rooms.lock:
            tracks = list(self.rooms.tracks.values())
        for t in reversed(tracks):
            if t is not track and phys in t.pages:
                return f"{t.room}/0"
        return None

    def _partner(self, fault, track: Track) -> Track | None:
        with self.rooms.lock:
            others = [t for t in self.rooms.tracks.values()  # a room of the run decode holds now (no health check)
                      if t is not track and t.tokens is not None and not t.released and t.rig_room is not None]
        if fault.with_room is not None:
            return next((t for t in others if t.rig_room == fault.with_room), None)
        # a room no fault names: its own fault would hide what the swap did to it; else one
        # whose faults all ran here already (the swap then avoids the pages they changed)
        by_room = self.plan_file.plan.by_room
        clean = [t for t in others if not by_room.get(t.rig_room)]
        settled = [t for t in others if all(f.index in t.faults_done for f in by_room.get(t.rig_room, ()))]
        others = clean or settled or others
        return others[0] if others else None

    def _swap(self, fault, track: Track, target, partner: Track, rng) -> None:
        # a partner page with as many frozen slots as the target's, where it has one: the
        # swapped bytes then have the same content digest in both rooms (docs/diagnosis.md)
        pages = [k for k in range(len(partner.pages)) if k not in partner.changed] or list(range(len(partner.pages)))
        alike = [k for k in pages if self.rooms.layout.frozen_slots(partner.n_tokens, k) == target.frozen]
        page_b = int(alike[rng.integers(len(alike))]) if alike else int(pages[rng.integers(len(pages))])
        phys_a, phys_b = track.pages[target.page], partner.pages[page_b]
        old_a, old_b = self.rooms.rows(phys_a, target.layers), self.rooms.rows(phys_b, target.layers)
        for j, li in enumerate(target.layers):
            self.rooms.buffers[li][phys_a].copy_(torch.from_numpy(old_b[j]))
            self.rooms.buffers[li][phys_b].copy_(torch.from_numpy(old_a[j]))
        cells_a, cells_b = [], []
        frozen_b = self.rooms.layout.frozen_slots(partner.n_tokens, page_b)
        for j, layer in enumerate(target.layer_ids):
            cells_a += [[layer, target.page, s] for s in _changed(self.rooms.layout, old_a[j], old_b[j], target.frozen)]
            cells_b += [[layer, page_b, s] for s in _changed(self.rooms.layout, old_b[j], old_a[j], frozen_b)]
        # each room's cell holds the other's page, found as such when the frozen counts agree
        alike = frozen_b == target.frozen
        expect_a = [c + (["other_room", f"{partner.room}/0"] if alike else [_diagnosis_of(
            self.rooms.layout, old_b[target.layer_ids.index(c[0])], None, target.frozen, c[2]), None]) for c in cells_a]
        expect_b = [c + (["other_room", f"{track.room}/0"] if alike else [_diagnosis_of(
            self.rooms.layout, old_a[target.layer_ids.index(c[0])], None, frozen_b, c[2]), None]) for c in cells_b]
        described = dict(target.describe(), partner_rid=partner.rid, partner_page=page_b)
        partner.changed.add(page_b)
        self.record_fault(fault, track, True, target=described, cells=cells_a, point=track.points, expect=expect_a)
        self.out.write("faults", {
            "fault": fault.index, "name": fault.name, "kind": fault.kind, "when": fault.when,
            "after_step": fault.after_step, "side": self.role, "rid": partner.rid, "rig_room": partner.rig_room,
            "room": partner.room, "n_tokens": partner.n_tokens, "transfer": partner.transfer,
            "applied": True, "reason": "swap partner", "target": described,
            "cells": cells_b, "point": partner.points, "partner_of": track.rid,
            "partner_of_tokens": track.n_tokens, "expect": expect_b,
        })


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

