"""Inside the rig's servers: the hooks on SGLang's classes that feed the plan, the injector and the oracle.

The rig's driver (`run`) hands each server a plan file (``DSV4_IDXK_RIG_PLAN``,
read by `plan`) and an output folder (``DSV4_IDXK_RIG_OUT``, written by
`output`). `apply`, called by the rig's plugin, then hooks SGLang's decode and
prefill paths (wrapt, at import) to:

* remember each room as decode publishes its destination pages
  (``DecodePreallocQueue._send_kv_metadata``: pages, prefix, token count, and
  a snapshot of what those pages held before the WRITE), its tokens and its
  request pool index at ``DecodeTransferQueue._commit_transfer_to_req``
  (`rooms`);
* run the `oracle` at every digest the probe takes on decode (`pd.decode`'s
  digest observer tells when one is taken; the pages it checks are SGLang's);
* call the `injector` where SGLang would suffer each fault: ``before_send`` in
  prefill's ``CommonKVSender.send`` (on the room's last send, tracked at
  ``send_kv_chunk``); ``in_flight`` right before decode's
  ``_commit_transfer_to_req``; ``after_recv`` / ``after_step N`` at the start
  of the stand-in's decode forward; ``in_host_pool`` armed at
  ``UnifiedRadixCache.init_load_back`` and applied at the next
  ``L2TransferEngine.submit_host_to_device``;
* when SGLang's ``release_kv_cache`` frees a finished room, record each of its
  faults that never came due (an ``after_step`` past its last step) as not
  applied, "room ended at step N"; with `scribble_freed`, zero the room's pages;
* fail the transfer of the plan's `fail_transfer` rooms at their last send, as
  the NIXL transfer worker does on an error (``conclude_failure``).

Every hook is fail-open: a failure is logged and SGLang's call goes on. The
injector never raises: a fault it cannot apply is recorded "not applied" with
the reason.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import wrapt

from ...vocabulary import PAGE_TOKENS
from .env import ENV_OUT, ENV_PLAN, ENV_ROLE
from .injector import INDEXER_HOST_POOL, Injector
from .oracle import Oracle
from .output import Out
from .plan import PlanFile
from .rooms import Rooms, Track, rid_of

log = logging.getLogger("dsv4_idxk_probe.rig")

FAILED_ON_PURPOSE = "dsv4-idxk-probe rig: transfer failed on purpose"

# the timings decode applies (the transfer kinds too: their WRITE's landing is restored on decode)
DECODE_WHENS = ("in_flight", "after_recv", "after_step")
# A decode forward holding a room whose swap waits for a partner sleeps this long: 16 s over
# a 160-step swap room (workload.fault_workload), time for prefill to send the next rooms.
SWAP_WAIT_PAUSE_S = 0.1


@dataclass
class _Rig:
    """The in-server parts of this process, built by `apply`."""

    role: str
    plan_file: PlanFile
    out: Out
    rooms: Rooms
    injector: Injector
    oracle: Oracle
    failing: dict = field(default_factory=dict)  # bootstrap room -> rid: its last send fails the transfer
    failed_rids: set = field(default_factory=set)


_rig: _Rig | None = None


# %% decode


def _on_send_metadata(wrapped, instance, args, kwargs):
    try:  # before: the pages' bytes before the transfer, which may land once the metadata is out
        _record_room(instance, *args, **kwargs)
    except Exception:
        log.exception("rig: recording a room failed")
    return wrapped(*args, **kwargs)


def _record_room(queue, decode_req, kv_indices, page_size, state_indices=None, **metadata):
    rig = _rig
    rig.plan_file.refresh()
    rig.rooms.bind_pool(queue.token_to_kv_pool)
    req = decode_req.req
    start = int(metadata.get("decode_prefix_len", 0) or 0)
    indices = np.asarray(kv_indices).reshape(-1)
    pages = [int(p) for p in indices[::page_size] // page_size]
    track = Track(rid_of(req), rig.plan_file.plan.rooms.get(rid_of(req)), int(req.bootstrap_room), start,
                  len(indices), pages)
    if rig.plan_file.faults_for(track.rid, DECODE_WHENS):
        track.before = {k: rig.rooms.rows(p) for k, p in enumerate(pages)}
    with rig.rooms.lock:
        earlier = rig.rooms.tracks.get(track.room)
        if earlier is not None and earlier.rid == track.rid:
            track.transfer = earlier.transfer + 1  # a retracted room, sent again (rebootstrap)
        rig.rooms.tracks[track.room] = track


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
    rig = _rig
    req = decode_req.req
    track = rig.rooms.tracks.get(int(req.bootstrap_room))
    if track is None:
        return
    track.tokens = np.asarray(list(req.origin_input_ids) + list(req.output_ids), dtype=np.int64)
    for fault in rig.plan_file.faults_for(track.rid, ("in_flight",)):
        rig.injector.apply(fault, track)


def _after_commit(decode_req) -> None:
    rig = _rig
    req = decode_req.req
    track = rig.rooms.tracks.get(int(req.bootstrap_room))
    if track is None:
        return
    idx = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if idx is not None:
        track.req_pool_idx = int(idx)
        with rig.rooms.lock:
            rig.rooms.by_pool_idx[int(idx)] = track


def _before_decode_forward(forward_batch) -> None:
    """after_recv / after_step N: at the start of the decode forward after step N.
    Called inside the model's forward: it never raises (a failure is logged)."""
    try:
        _decode_forward_faults(forward_batch)
    except Exception:
        log.exception("rig: decode-step faults failed")


def _decode_forward_faults(forward_batch) -> None:
    rig = _rig
    if rig is None or not forward_batch.forward_mode.is_decode():
        return
    waiting = False
    for idx in forward_batch.req_pool_indices.tolist():
        track = rig.rooms.by_pool_idx.get(int(idx))
        if track is None:
            continue
        done = track.forwards
        track.forwards += 1
        for fault in rig.plan_file.faults_for(track.rid, ("after_recv", "after_step")):
            if fault.index in track.faults_done:
                continue
            if fault.after_step == done or fault.index in track.waiting:
                track.waiting.discard(fault.index)
                rig.injector.apply(fault, track)
        waiting = waiting or bool(track.waiting)
    if waiting:
        # a swap waits for a partner room: slow this room's decode so prefill's next rooms
        # arrive while it still decodes (on a quiet machine a room's 160 decode steps can
        # take less than one prefill, and decode would then hold one room at a time)
        time.sleep(SWAP_WAIT_PAUSE_S)


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
    rig = _rig
    if not req.finished():
        return
    track = rig.rooms.tracks.get(int(getattr(req, "bootstrap_room", -1) or -1))
    if track is not None and track.rid == rid_of(req):
        track.released = True
        # faults it never reached (an after_step past its last step, a swap with no partner):
        # "not applied: room ended at step N", so every planned fault has its record
        rig.injector.room_ended(track, rig.plan_file.faults_for(track.rid, DECODE_WHENS))
    if not rig.plan_file.plan.scribble_freed:
        return
    if track is None or rid_of(req) not in rig.plan_file.plan.rooms:
        return
    for buf in rig.rooms.buffers:
        for page in track.pages:
            buf[page].zero_()
    rig.out.write("events", {"event": "scribbled_freed_pages", "rid": track.rid, "room": track.room,
                             "pages": track.pages})


def _on_digests(points) -> None:
    """The probe is taking decode digests (`pd.decode.add_digest_observer`): an oracle point each."""
    try:
        for room, stage, step in points:
            _rig.oracle.point(int(room.room), int(room.attempt), stage, step)
    except Exception:
        log.exception("rig: oracle failed")


# %% prefill


def _on_prefill_send(wrapped, instance, args, kwargs):
    try:
        _before_send(instance, *args, **kwargs)
    except Exception:
        log.exception("rig: before_send faults failed")
    return wrapped(*args, **kwargs)


def _before_send(sender, kv_indices, *_a, **_k) -> None:
    """before_send: on the sender's last send, after the probe's digest, before the WRITE is queued."""
    rig = _rig
    total = getattr(sender, "num_kv_indices", None)
    if total is None or int(getattr(sender, "curr_idx", 0)) + len(kv_indices) != int(total):
        return
    room = int(sender.bootstrap_room)
    rid = rig.failing.pop(room, None)
    if rid is not None:
        # what the transfer worker does on a NIXL error: record the reason, mark the room
        # Failed and tell decode; the chunk queued next is skipped for a Failed room
        sender.kv_mgr.conclude_failure(bootstrap_room=room, failure_reason=FAILED_ON_PURPOSE)
        rig.out.write("events", {"event": "transfer_failed_on_purpose", "rid": rid, "room": room})
        return
    track = rig.rooms.tracks.get(room)
    if track is None:
        return
    for fault in rig.plan_file.faults_for(track.rid, ("before_send",)):
        # only pages of this (last) send can still change what decode receives
        rig.injector.apply(fault, track)


def _prefill_track(scheduler, req, last_chunk=False, end_idx=None, *_a, **_k) -> None:
    rig = _rig
    plan_file, injector = rig.plan_file, rig.injector
    if last_chunk:
        plan_file.refresh()
    rid = rid_of(req)
    if not last_chunk or rid not in plan_file.plan.rooms:
        return
    if rid in plan_file.plan.fail_transfer and rid not in rig.failed_rids:
        rig.failed_rids.add(rid)  # once: a retry of the request is served
        rig.failing[int(req.bootstrap_room)] = rid
    for fault in plan_file.faults_for(rid, ("in_host_pool",)):
        if (fault.index, rid) not in injector.host_done:  # its last chunk is sent: no load is coming
            injector.host_done.add((fault.index, rid))
            track = Track(rid, plan_file.plan.rooms.get(rid), int(req.bootstrap_room), 0, 0, [])
            injector.record_fault(fault, track, False, "the room loaded no page from the HiCache host pool")
    if not plan_file.faults_for(rid, ("before_send",)):
        return
    rig.rooms.bind_pool(scheduler.token_to_kv_pool_allocator)
    start = int(req.disagg_decode_prefix_len or 0)
    end = int(end_idx) if end_idx is not None else min(int(req.extend_end), len(req.origin_input_ids))
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end]
    pages = [int(p) for p in (row[::PAGE_TOKENS] // PAGE_TOKENS).tolist()]
    track = Track(rid, plan_file.plan.rooms.get(rid), int(req.bootstrap_room), start, end - start, pages)
    with rig.rooms.lock:
        earlier = rig.rooms.tracks.get(track.room)
        if earlier is not None and earlier.rid == rid and earlier.n_tokens != track.n_tokens:
            track.transfer = earlier.transfer + 1  # a retracted room, sent again (rebootstrap)
        rig.rooms.tracks[track.room] = track


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
    if _rig is not None and _rig.injector.armed is not None and (not result or not result[0]):
        _rig.injector.armed = None  # nothing was loaded
    return result


def _arm_host_faults(cache, params) -> None:
    rig = _rig
    req = getattr(params, "req", None)
    if req is None:
        return
    rig.plan_file.refresh()
    rid = rid_of(req)
    done = rig.injector.host_done
    faults = [f for f in rig.plan_file.faults_for(rid, ("in_host_pool",)) if (f.index, rid) not in done]
    if faults:
        rig.rooms.bind_pool(cache.token_to_kv_pool_allocator)
        rig.injector.armed = (req, faults)


def _around_submit_host_to_device(wrapped, instance, args, kwargs):
    def _pick(transfers, *_a, **_k):
        return transfers

    try:
        _apply_host_faults(_pick(*args, **kwargs))
    except Exception:
        log.exception("rig: a host-pool fault failed")
    return wrapped(*args, **kwargs)


def _apply_host_faults(transfers) -> None:
    rig = _rig
    injector = rig.injector
    armed, injector.armed = injector.armed, None
    if armed is None:
        return
    req, faults = armed
    rid = rid_of(req)
    transfer = next((t for t in transfers if str(getattr(t.host_pool, "pool_name", "")) == INDEXER_HOST_POOL
                     and t.host_indices is not None and t.host_indices.numel()), None)
    for fault in faults:
        injector.host_done.add((fault.index, rid))
        if transfer is None:
            track = Track(rid, rig.plan_file.plan.rooms.get(rid), int(req.bootstrap_room), 0, 0, [])
            injector.record_fault(fault, track, False, "the room's load moved no index-K page")
        else:
            injector.apply_in_host_pool(fault, req, transfer)


# %% arming


def apply() -> None:
    """Arm the hooks of this server's role (decode or prefill) if the driver gave a plan."""
    global _rig
    plan_path, out_folder = os.environ.get(ENV_PLAN), os.environ.get(ENV_OUT)
    if not plan_path or not out_folder:
        return
    role = os.environ.get(ENV_ROLE, "")
    plan_file = PlanFile(plan_path)
    out = Out(Path(out_folder), role)
    rooms = Rooms()
    _rig = _Rig(role, plan_file, out, rooms, Injector(role, plan_file, rooms, out), Oracle(rooms, out))
    from . import standin_model

    if role == "decode":
        standin_model.BEFORE_FORWARD.append(_before_decode_forward)
        wrapt.register_post_import_hook(lambda m: (
            wrapt.wrap_function_wrapper(m, "DecodePreallocQueue._send_kv_metadata", _on_send_metadata),
            wrapt.wrap_function_wrapper(m, "DecodeTransferQueue._commit_transfer_to_req", _on_commit),
        ), "sglang.srt.disaggregation.decode")
        # registered when the probe's decode module loads (not imported here: the probe loads it)
        wrapt.register_post_import_hook(lambda m: m.add_digest_observer(_on_digests), "dsv4_idxk_probe.pd.decode")
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
