"""Decode hooks: digest each room when it lands and later in its life.

Targets (configs/targets/sglang.yaml, "PD prefill / decode"):

* ``DecodePreallocQueue._init_kv_manager`` (after): build the decode side
  and, in enforce mode, agree with the other attention-TP ranks
  (sglang/enforce.py);
* ``DecodePreallocQueue._send_kv_metadata`` (before; 0.5.21 on): remember the
  room's destination pages (the exact list decode publishes to prefill); with
  diagnosis on, journal them as allocated to the room and digest what they
  hold before the transfer writes them (docs/diagnosis.md): before the call,
  since prefill may write as soon as the metadata is out;
* ``DecodePreallocQueue.pop_preallocated`` (after; before 0.5.21, which has
  no ``_send_kv_metadata``): the same pages, read back from req_to_token for
  every room it preallocated; journalled without the before-transfer digest;
* ``DecodeTransferQueue._commit_transfer_to_req`` (around): read the in-band
  digest and the prefill's exchange endpoint from the metadata row before
  SGLang clears it (or rebuild the endpoint: `prefill_endpoint`; one per
  stage for a PP prefill, whose digests decode combines), then, unless the
  commit aborted the request, enqueue the ``decode_recv`` digest on the
  current stream (every decode forward waits on that stream, so it runs
  before the first one);
* ``SchedulerDisaggregationDecodeMixin._verify_kv_checksums`` (around,
  enforce only; 0.5.21 on): judge each room's receipt digest against
  prefill's (`mismatch_flags`) and drop the mismatching ones on every
  attention-TP rank alike (sglang/enforce.py); a room whose prefill digest
  is still being fetched (off this thread) is held for a later batch;
* ``SchedulerBatchResultProcessor.process_batch_result_decode`` (after, once
  per batch): ``decode_finish`` for rooms that finished in the batch
  (enqueued before any later batch can reuse their pages) and, every
  ``step_interval`` decode batches, ``decode_step`` for every other room of
  the batch; both in one launch;
* ``release_kv_cache`` as the batch result processor calls it (before):
  ``decode_finish`` of a finished room while its pages are still its own;
* ``SchedulerBatchResultProcessor.process_batch_result_prebuilt`` (after):
  ``decode_finish`` for rooms that finished at once;
* ``ScheduleBatch.retract_decode`` (after): a retracted room is `skipped`;
* ``DecodeTransferQueue._abort_failed_transfer`` (before; 0.5.22 on): a room whose
  transfer failed is `skipped` with "transfer failed: <SGLang's reason>";
* ``DecodeTransferQueue._release_request`` (before; 0.5.21 on): a room the queue lets
  go of without a commit (a host-received room aborted at `KVPoll.Success`; before
  0.5.22 a failed transfer) is `skipped` with SGLang's reason, unless already counted.

Only frozen bytes are digested (the kernel counts them from each room's tokens), so the tail slots
later decode steps write never count. No SGLang import.
"""

from __future__ import annotations

from typing import Any

from ..exchange.endpoint import rebuild_endpoint
from ..exchange.prefetch import prefetch, prefetched
from ..exchange.stages import StageEndpoints, describe_endpoint
from ..hicache.probe import probe_if_made
from ..pd.coverage import skip_reason
from ..pd.inband import port_from_slots
from ..pd import InbandDigest, RoomId
from ..safety import safe_invoke
from . import enforce
from .accessors import (
    ATTR_DEST, ATTR_RECV, ATTR_STEPS, HOST_RECEIVE, cache_protected_len, dcp_size, decode_skip_reason,
    is_host_destination, metadata_row, origin_len, prefill_peer_host, req_pool_idx, restore_failed, rid_of,
    room_of, row_slot_plan,
)
from .index_k import RoomPages, decode_room_pages
from .sides import build_side

ATTR_ROOM = "_dsv4_idxk_room"  # on a decode Req: its RoomId while the probe tracks it
#: On a DecodeRequest: the probe has accounted for the room (its receipt taken, or counted
#: skipped), so the transfer queue's release of it counts nothing more.
ATTR_ACCOUNTED = "_dsv4_idxk_accounted"


def decode_side(runtime: Any, scheduler: Any = None):
    side = runtime.sides.get("decode")
    if side is None and scheduler is not None:
        queue = getattr(scheduler, "disagg_decode_prealloc_queue", None)
        manager = getattr(queue, "kv_manager", None)
        if queue is None or manager is None:
            runtime.not_applicable("decode.side", "the scheduler has no decode prealloc queue with a KV manager")
            return None
        side = build_side(runtime, "decode", queue.token_to_kv_pool, manager.kv_args, dcp_size=dcp_size(manager))
        if runtime.config.enforce and getattr(side, "active", False) and not hasattr(side, "enforce_agreement"):
            # built here, the agreement never ran: enforce only where there is no one to agree with
            side.enforce_agreed = enforce.single_rank(getattr(scheduler, "attn_tp_cpu_group", None))
            side.enforce_agreement = "not run (side built after the KV manager's init)"
    return side if side is not None and side.active else None


def on_queue_init(runtime: Any, queue: Any, manager: Any) -> None:
    side = build_side(runtime, "decode", queue.token_to_kv_pool, manager.kv_args, dcp_size=dcp_size(manager))
    if runtime.config.enforce and side.active:
        scheduler = getattr(queue, "scheduler", None)
        agreed, why = enforce.agree_on_enforce(getattr(scheduler, "attn_tp_cpu_group", None))
        side.enforce_agreed = agreed
        side.enforce_agreement = why or "agreed"
        if not agreed:
            runtime.log.error("dsv4-idxk-probe: enforce is off on this rank, decode observes only: %s", why)


def on_send_metadata(runtime: Any, queue: Any, decode_req: Any, kv_indices: Any, page_size: int, kwargs: dict) -> None:
    side = decode_side(runtime, getattr(queue, "scheduler", None))  # first: it may build the side, host receive or not
    if is_host_destination(kwargs):
        # Host-receive: prefill writes this room into decode's HiCache host pool, unseen by
        # the host-pool wrappers: the rows' kept digests go (their restore counts
        # `digest_lost`); the device pages named later by the restore are not known here.
        hicache = probe_if_made(runtime)
        if hicache is not None:
            hicache.rows_written_elsewhere(kv_indices)
        setattr(decode_req, ATTR_DEST, HOST_RECEIVE)  # an inactive side counts it `host_dest` too
        return
    if side is None:
        return
    dest = decode_room_pages(kv_indices, page_size, kwargs, *_hisparse_extent(queue, decode_req, kwargs))
    setattr(decode_req, ATTR_DEST, dest)
    room = room_of(getattr(decode_req, "req", None))
    if not isinstance(dest, str) and room is not None:  # diagnosis: a journal event, the pages' bytes before
        runtime.sides["decode"].monitor.room_allocated(RoomId(room), dest.pages, dest.n_tokens)


def _hisparse_extent(queue: Any, decode_req: Any, kwargs: dict) -> tuple[int | None, int | None]:
    """Where a HiSparse room's published pages end and the device page size, read only where
    decode named device pages (`device_kv_indices`): SGLang sends the host rows of the C4 KV
    as `kv_indices` then, which say nothing of the room's length."""
    if kwargs.get("device_kv_indices") is None:
        return None, None
    try:
        return published_len(queue, decode_req.req), int(queue.token_to_kv_pool_allocator.page_size)
    except Exception:
        return None, None  # the room is skipped with the reason, not judged at a wrong length


def on_preallocated(runtime: Any, queue: Any, preallocated: Any) -> None:
    """SGLang 0.5.18-0.5.20 (no `_send_kv_metadata`): the pages each preallocated room
    published, read back from req_to_token exactly as `pop_preallocated` took them
    (``[cache_protected_len, len(origin_input_ids))`` of the room's row). With diagnosis
    on, journalled as allocated, without the before-transfer snapshot: `pop_preallocated`
    has already told prefill where to write, so the pages may hold the room already."""
    if not preallocated or decode_side(runtime, getattr(queue, "scheduler", None)) is None:
        return
    rows = queue.req_to_token_pool.req_to_token
    for decode_req in preallocated:
        req = decode_req.req
        if getattr(decode_req, ATTR_DEST, None) is not None:
            continue
        index, start, end = req_pool_idx(req), cache_protected_len(req), published_len(queue, req)
        if index is None or end <= start:
            setattr(decode_req, ATTR_DEST, "nothing to receive")
            continue
        kv_indices = rows[int(index), start:end]
        dest = decode_room_pages(kv_indices, int(queue.token_to_kv_pool_allocator.page_size), {"decode_prefix_len": start})
        setattr(decode_req, ATTR_DEST, dest)
        room = room_of(req)
        if not isinstance(dest, str) and room is not None:
            runtime.sides["decode"].monitor.room_allocated(RoomId(room), dest.pages, dest.n_tokens, snapshot=False)


def published_len(queue: Any, req: Any) -> int:
    """Where the pages `pop_preallocated` published end: SGLang's own
    `_rebootstrap_prefill_len` (prompt + outputs for a room being rebootstrapped after a
    retraction, which prefill sends again whole; else the prompt), a static method of the
    prealloc queue, looked up there when `queue` is the transfer queue (which has none);
    where neither is at hand, the same rule (0.5.18-0.5.23) read off the request."""
    measure = getattr(queue, "_rebootstrap_prefill_len", None)
    if measure is None:
        prealloc = getattr(getattr(queue, "scheduler", None), "disagg_decode_prealloc_queue", None)
        measure = getattr(prealloc, "_rebootstrap_prefill_len", None)
    if measure is not None:
        try:
            return int(measure(req))
        except Exception:
            pass
    if getattr(req, "pd_rebootstrap_in_progress", False):
        return origin_len(req) + len(getattr(req, "output_ids", None) or ())
    return origin_len(req)


#: The low-cardinality coverage reason of an inactive side's code (InactiveSide.code).
_INACTIVE_COVERAGE_REASON = {"layout_unknown": "layout_unknown", "build_failed": "probe_error"}
_said_metadata_on_device = False


def count_inactive_room(runtime: Any, queue: Any, decode_req: Any) -> None:
    """A room lands on a decode side that cannot read its pool: its index-K bytes moved
    unverified, counted with the side's reason (none for a pool that is not DeepSeek-V4).
    As on an active side, rooms that move no index-K (health checks, fake bootstrap hosts)
    are not counted, an aborted one is `skipped` (`aborted`) and a host-received one
    `skipped` (`host_dest`). Marked accounted, as
    `_skipped_unreceived` marks its rooms, so a later hook counts nothing more."""
    setattr(decode_req, ATTR_ACCOUNTED, True)
    side = runtime.sides.get("decode")
    req = getattr(decode_req, "req", None)
    per_page = getattr(side, "bytes_per_page", 0)
    if side is None or side.active or not per_page or req is None or runtime.metrics is None:
        return
    why = decode_skip_reason(req)
    if why is None and getattr(decode_req, ATTR_DEST, None) == HOST_RECEIVE:
        why = HOST_RECEIVE  # as an active side counts it: the path's reason before the side's
    if why is None:
        outcome, reason = "unverified", _INACTIVE_COVERAGE_REASON.get(getattr(side, "code", ""), "other")
    else:
        outcome, reason = "skipped", skip_reason(why)
        if reason is None:
            return  # moved no index-K
    n_tokens = received_tokens(queue, decode_req)
    if n_tokens is None:
        raise ValueError("the room's length cannot be read")  # counted as the probe's error
    pages = -(-n_tokens // max(1, int(getattr(side, "page_tokens", 256))))
    runtime.metrics.count_coverage("pd", outcome, reason, pages * per_page)


def metadata_on_device(transfer_queue: Any) -> bool:
    """Whether SGLang keeps the metadata rows on a device (NPU; CUDA with Mooncake's
    intra-node NVLink pool): the probe does not read them there (that would sync)."""
    rows = getattr(getattr(transfer_queue, "metadata_buffers", None), "bootstrap_room", None)
    device = getattr(rows, "device", None)
    return device is not None and getattr(device, "type", "cpu") != "cpu"


def say_metadata_on_device(runtime: Any) -> None:
    """No in-band digest and no endpoint to ask (both live in a metadata row on a device):
    the room's record carries ``unverified_reason: metadata_on_device``, which its
    coverage count takes as the reason (pd/decode.py); said once in the log."""
    global _said_metadata_on_device
    if not _said_metadata_on_device:
        _said_metadata_on_device = True
        runtime.log.warning(
            "dsv4-idxk-probe: decode's metadata rows live on a device (NPU, or Mooncake's NVLink pool); "
            "the probe does not read them (that would synchronise the serving thread), so rooms without "
            "another way to reach prefill's digests are unverified (coverage reason metadata_on_device)")


def before_commit(transfer_queue: Any, decode_req: Any) -> tuple[list[int], int | None, str | None]:
    """What the commit clears: the probe's digest and endpoint slots of the metadata
    row (as `slot_plan` places them), and the sending rank's address."""
    row = metadata_row(getattr(transfer_queue, "metadata_buffers", None), getattr(decode_req, "metadata_buffer_index", None))
    plan = row_slot_plan(row) if row is not None else None
    digest = [int(v) for v in row[plan.digest]] if plan is not None and plan.digest is not None else []
    endpoint = int(row[plan.endpoint]) if plan is not None and plan.endpoint is not None else None
    return digest, endpoint, prefill_peer_host(decode_req), prefill_stages(decode_req)


def prefill_stages(decode_req: Any) -> tuple[tuple[str, int, int], ...]:
    """(rank_ip, rank_port, pp_rank) of each prefill PP stage that sends this room (the
    non-dummy bootstrap infos, one per stage, in stage order): one entry without PP."""
    receiver = getattr(decode_req, "kv_receiver", None)
    stages: dict[int, tuple[str, int, int]] = {}
    for info in getattr(receiver, "bootstrap_infos", None) or []:
        if not isinstance(info, dict) or info.get("is_dummy", False) or not info.get("rank_ip"):
            continue
        stage = int(info.get("pp_rank", 0) or 0)
        stages.setdefault(stage, (str(info["rank_ip"]), int(info.get("rank_port", 0) or 0), stage))
    return tuple(stages[k] for k in sorted(stages))


def prefill_endpoint(runtime: Any, side: Any, seen: tuple) -> tuple[Any, bool]:
    """(where to ask for the room's vectors, whether its in-band digest describes the whole room).

    One stage: the endpoint slot, else the port in the digest's header, else the
    ``port_offset`` rule, at the rank's bootstrap address (exchange/endpoint.py).
    Several PP stages: each wrote its own layers' digest into the same row, so
    the row's digest is one stage's; every stage's endpoint comes from the rule
    and decode combines their digests (exchange/stages.py); None without the rule."""
    digest_slots, endpoint_slot, peer_host = seen[:3]
    stages = seen[3] if len(seen) > 3 else ()
    offset = getattr(runtime.config.exchange, "port_offset", 0)
    if len(stages) > 1:
        endpoints = [rebuild_endpoint(None, None, ip, port, offset) for ip, port, _stage in stages]
        if any(e is None for e in endpoints):
            return None, False
        return StageEndpoints(endpoints, side.layout), False
    rank_port = stages[0][1] if stages else None
    return rebuild_endpoint(endpoint_slot, port_from_slots(digest_slots), peer_host, rank_port, offset), True


def after_commit(runtime: Any, transfer_queue: Any, decode_req: Any, seen: tuple[list[int], int | None, str | None]) -> None:
    side = decode_side(runtime, getattr(transfer_queue, "scheduler", None))
    req = decode_req.req
    setattr(decode_req, ATTR_ACCOUNTED, True)
    if side is None:
        count_inactive_room(runtime, transfer_queue, decode_req)
    if side is None or room_of(req) is None:
        return
    room = RoomId(room_of(req))
    reason = decode_skip_reason(req)
    dest = getattr(decode_req, ATTR_DEST, None)
    if reason is None and (dest is None or isinstance(dest, str)):
        reason = dest or "destination pages were not recorded"
    if reason is not None:
        _skipped_unreceived(side, transfer_queue, decode_req, reason)
        return
    digest_slots = seen[0]
    endpoint, whole_room = prefill_endpoint(runtime, side, seen)
    inband = InbandDigest.from_slots(digest_slots) if digest_slots and whole_room else None
    side.remember_peer(room.key, endpoint)
    extra = {"rid": rid_of(req), **({"prefill_endpoint": describe_endpoint(endpoint)} if endpoint else {})}
    if not whole_room and endpoint is None:
        extra["unverified_reason"] = "pp_stage"  # PP prefill without the port_offset rule (docs/pd.md)
    enforcing = runtime.config.enforce and getattr(side, "enforce_agreed", False) is True  # the ranks agreed
    if enforcing and inband is None and endpoint is not None:
        prefetch(side, room.key)  # enforce judges it later from this, never with a fetch on this thread
    if (inband is None and endpoint is None and getattr(side, "peer_override", None) is None
            and metadata_on_device(transfer_queue)):
        extra["unverified_reason"] = "metadata_on_device"
        say_metadata_on_device(runtime)
    pending = side.monitor.room_received(room, dest.pages, dest.n_tokens, inband, extra)
    setattr(req, ATTR_ROOM, room)
    setattr(req, ATTR_STEPS, 0)
    setattr(req, ATTR_RECV, (pending, inband, dest.n_tokens))


def commit_failed(runtime: Any, transfer_queue: Any, decode_req: Any) -> None:
    """The probe's own commit read (`before_commit`) or its receipt (`after_commit`)
    raised (the error is counted): a room it did not start tracking is counted
    `skipped` (`probe_error`) with the bytes it received, so it is not left out of the
    coverage; one the monitor took before the failure is retired the same way (no hook
    would finish it: the request does not carry the room), its bytes counted once, as
    its receipt left them (the unreadable pools' bytes too)."""
    req = getattr(decode_req, "req", None)
    if room_of(req) is None or getattr(req, ATTR_ROOM, None) is not None:
        return  # no room, or tracked and carried: its life goes on as usual
    side = decode_side(runtime, getattr(transfer_queue, "scheduler", None))
    if side is None:  # an inactive side counts its rooms in after_commit, unless the read before it raised
        if not getattr(decode_req, ATTR_ACCOUNTED, False):
            count_inactive_room(runtime, transfer_queue, decode_req)
        return
    _skipped_unreceived(side, transfer_queue, decode_req, "probe error at the commit")


def _skipped_unreceived(side: Any, queue: Any, decode_req: Any, reason: str) -> None:
    """A room decode's monitor never took, counted `skipped` with the bytes it received
    (`n_tokens`: its coverage bytes, docs/coverage.md), and marked so that the transfer
    queue's release of it counts nothing more. (One the monitor took after all is retired
    with its own length: `room_skipped`.)"""
    req = decode_req.req
    setattr(decode_req, ATTR_ACCOUNTED, True)
    side.monitor.room_skipped(RoomId(room_of(req)), reason, extra={"rid": rid_of(req)},
                              n_tokens=received_tokens(queue, decode_req))


def received_tokens(queue: Any, decode_req: Any) -> int | None:
    """Tokens a room receives: those of the pages it published (`_send_kv_metadata`), else
    its published length past decode's prefix (prompt + outputs for a room rebootstrapped
    after a retraction, `published_len`); None where unreadable."""
    dest = getattr(decode_req, ATTR_DEST, None)
    if isinstance(dest, RoomPages):
        return dest.n_tokens
    try:
        return max(0, published_len(queue, decode_req.req) - cache_protected_len(decode_req.req))
    except Exception:
        return None


def on_decode_batch(runtime: Any, batch: Any) -> None:
    """After a decode batch: `decode_finish` for rooms that finished in it and, on
    every `step_interval`-th batch, `decode_step` for the rest; one launch.

    A finished room's pages were just released, but the digest is enqueued on
    the scheduler stream before any later batch is scheduled, and every forward
    waits on that stream, so no forward can rewrite them first.
    """
    side = decode_side(runtime)
    if side is None:
        return
    side.batches += 1
    due = side.monitor.step_due(side.batches)
    finished, stepped = [], []
    for req in batch.reqs:
        room = getattr(req, ATTR_ROOM, None)
        if room is None:
            continue
        if req.finished():
            setattr(req, ATTR_ROOM, None)
            finished.append(room)
            continue
        steps = getattr(req, ATTR_STEPS, 0) + 1
        setattr(req, ATTR_STEPS, steps)
        if due:
            stepped.append((room, steps))
    side.monitor.batch_done(finished, stepped)  # one launch for the whole batch


def on_release(runtime: Any, req: Any) -> None:
    """Before a received room's pages go back to the allocator, wherever SGLang frees them.

    Finished (its output done, or aborted: SGLang sets the abort's finish reason
    first): its `decode_finish` digest, enqueued here, before the free, so no later
    allocation of those pages (a new room's transfer, a HiCache load) can be
    ordered ahead of it; the batch hook then finds the room already finished and
    skips it. Not finished: its pages are taken from a running room, which only a
    retraction does (`retract_decode`, and `retract_all` when generation pauses):
    the room is retired as `retracted` (`on_retract`, which then finds it gone).
    """
    if getattr(req, ATTR_ROOM, None) is None:
        return
    if req.finished():
        finish_room(runtime, req)
    else:
        on_retract(runtime, (req,))


def finish_room(runtime: Any, req: Any) -> None:
    room = getattr(req, ATTR_ROOM, None)
    if room is None or not req.finished():
        return
    setattr(req, ATTR_ROOM, None)
    side = decode_side(runtime)
    if side is not None:
        side.monitor.room_finished(room)


def on_prebuilt_result(runtime: Any, batch: Any) -> None:
    for req in batch.reqs:
        finish_room(runtime, req)


def on_retract(runtime: Any, retracted: Any) -> None:
    side = decode_side(runtime)
    for req in retracted:
        room = getattr(req, ATTR_ROOM, None)
        if room is None:
            continue
        setattr(req, ATTR_ROOM, None)
        setattr(req, ATTR_RECV, None)
        if side is not None:
            side.monitor.room_skipped(room, "retracted", stage="decode_step")


def on_transfer_failed(runtime: Any, transfer_queue: Any, decode_req: Any) -> None:
    """SGLang found the room's transfer Failed and aborts it: a `skipped` record at
    `decode_recv` whose reason says the transfer failed (and why, where SGLang recorded
    it), so the room's prefill record does not stand alone in the logs. With decode
    HiCache (0.5.23) SGLang also fails a room whose transfer completed when the local
    restore of the prefix it promised prefill failed: `aborted`, with that reason."""
    side = decode_side(runtime, getattr(transfer_queue, "scheduler", None))
    req = getattr(decode_req, "req", None)
    if side is None or room_of(req) is None:
        return
    if restore_failed(decode_req):
        _skipped_unreceived(side, transfer_queue, decode_req, HICACHE_RESTORE_FAILED)
        return
    room = room_of(req)
    receiver = getattr(decode_req, "kv_receiver", None)
    manager = getattr(receiver, "kv_mgr", None)
    records = getattr(manager, "failure_records", None)
    why = records.get(room) if isinstance(records, dict) else None  # read, not taken: SGLang pops it next
    _skipped_unreceived(side, transfer_queue, decode_req, f"transfer failed: {why}" if why else "transfer failed")


#: A room SGLang aborts because decode's HiCache could not restore the prefix it promised
#: prefill (`decode_prefix_len`): the transfer itself may have completed (coverage `aborted`).
HICACHE_RESTORE_FAILED = "aborted: decode's HiCache restore of the promised prefix failed"


def on_transfer_release(runtime: Any, transfer_queue: Any, decode_req: Any) -> None:
    """The transfer queue lets go of a room that never reached its commit: aborted while its
    bytes went into the HiCache host pool (host receive: released at `KVPoll.Success`
    without a commit), or, before 0.5.22 (no `_abort_failed_transfer`), its transfer failed.
    Counted `skipped` with SGLang's reason (an abort) and the bytes it received, unless the
    probe accounted for it already (its commit, a failed transfer's hook)."""
    req = getattr(decode_req, "req", None)
    if getattr(decode_req, ATTR_ACCOUNTED, False) or room_of(req) is None or getattr(req, ATTR_ROOM, None) is not None:
        return
    side = decode_side(runtime, getattr(transfer_queue, "scheduler", None))
    if side is None:
        count_inactive_room(runtime, transfer_queue, decode_req)
        return
    _skipped_unreceived(side, transfer_queue, decode_req,
                        decode_skip_reason(req) or "released by the transfer queue before its commit")


# %% enforce: what this rank judges (sglang/enforce.py makes the ranks act alike)


def mismatch_flags(runtime: Any, reqs: list) -> list[int]:
    """A verdict for each request (sglang/enforce.py): DROP where its receipt digest differs
    from prefill's (`expected_room_digest`), HOLD while prefill's digest is still being
    fetched off this thread, KEEP otherwise: enforce's judge, passed to `enforce.enforce_batch`.

    Waits for decode's own digests still in flight: the one host sync enforce mode
    costs. Never waits on the exchange. Rooms without a comparable prefill digest are
    kept (not judged here).
    """
    side = decode_side(runtime)
    flags = [enforce.KEEP] * len(reqs)
    if side is None:
        return flags
    for i, req in enumerate(reqs):
        received = getattr(req, ATTR_RECV, None)
        if received is None:
            continue
        pending, inband, n_tokens = received
        expected = expected_room_digest(side, getattr(req, ATTR_ROOM, None), inband)
        if expected is HOLD_FOR_FETCH:
            flags[i] = enforce.HOLD  # judged at a later batch, once the fetch has ended
            continue
        setattr(req, ATTR_RECV, None)  # judged once, as upstream does (a retraction rewrites the tail)
        if pending is None or expected is None or expected[1] != side.signature or expected[2] != n_tokens:
            continue
        if pending.wait():  # else the digest failed (counted): the request is kept, not judged
            observed = pending.whole_room_digest(0)  # None: rows it could not read (a probe fault): not judged
            flags[i] = enforce.DROP if observed is not None and observed != expected[0] else enforce.KEEP
    return flags


#: `expected_room_digest`'s answer while the exchange fetch is still in flight.
HOLD_FOR_FETCH = ("hold",)


def expected_room_digest(side: Any, room: Any, inband: Any) -> Any:
    """(room digest, signature, tokens) of prefill: in band, or else from its exchange;
    None where there is none; `HOLD_FOR_FETCH` while the fetch is under way.

    Prefill leaves the slots empty where its transport does not block before
    the aux data leaves (Mooncake), and PP stages each send only a part: the
    digest then comes from the exchange, fetched on a worker thread from the
    moment the room landed (exchange/prefetch.py); this thread only looks.
    """
    if inband is not None:
        return inband.room_digest, inband.signature, inband.n_tokens
    if room is None or getattr(side, "client", None) is None:
        return None
    done, digest = prefetched(side, room.key)
    if not done:
        return HOLD_FOR_FETCH
    return None if digest is None else (int(digest.room), int(digest.signature), int(digest.n_tokens))


# %% wrapper factories (named in the target table)


def make_queue_init_wrapper(runtime):
    """``DecodePreallocQueue._init_kv_manager(self)``, after: build the decode side."""

    def wrapper(wrapped, instance, args, kwargs):
        manager = wrapped(*args, **kwargs)
        if runtime.enabled:
            safe_invoke("decode.init", on_queue_init, runtime, instance, manager)
        return manager

    return wrapper


def make_send_kv_metadata_wrapper(runtime):
    """``_send_kv_metadata(self, decode_req, kv_indices, page_size, state_indices=None, **kw)``,
    before: the pages' bytes before the transfer are digested before prefill can learn
    where to write (after `send_metadata`, prefill's WRITE can land first)."""

    def _pick(decode_req, kv_indices, page_size, state_indices=None, **metadata_kwargs):
        return decode_req, kv_indices, page_size, metadata_kwargs

    def wrapper(wrapped, instance, args, kwargs):
        if runtime.enabled:
            safe_invoke("decode.send_kv_metadata", on_send_metadata, runtime, instance, *_pick(*args, **kwargs))
        return wrapped(*args, **kwargs)

    return wrapper


def make_preallocated_wrapper(runtime):
    """``DecodePreallocQueue.pop_preallocated(self, ...)`` (0.5.18-0.5.20), after: the
    destination pages of every room it preallocated (what `_send_kv_metadata` gives later releases)."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if runtime.enabled and isinstance(result, tuple) and result:
            safe_invoke("decode.preallocated", on_preallocated, runtime, instance, list(result[0]))
        return result

    return wrapper


def make_commit_transfer_wrapper(runtime):
    """``_commit_transfer_to_req(self, decode_req)``, around: in-band read, then `decode_recv`.

    Upstream after 0.5.23 may return False for "not ready, keep it in the
    queue": the row is then neither cleared nor committed, so the room is
    digested at the commit that returns anything else (None in 0.5.18-0.5.23)."""

    def _pick(decode_req, *_a, **_k):
        return decode_req

    def wrapper(wrapped, instance, args, kwargs):
        if not runtime.enabled:
            return wrapped(*args, **kwargs)
        decode_req = _pick(*args, **kwargs)
        seen = safe_invoke("decode.commit_read", before_commit, instance, decode_req)
        result = wrapped(*args, **kwargs)
        if result is not False:
            done = seen is not None and safe_invoke("decode.commit", after_commit, runtime, instance, decode_req, seen,
                                                    fallback=False) is not False
            if not done:
                safe_invoke("decode.commit_lost", commit_failed, runtime, instance, decode_req)
        return result

    return wrapper


def make_decode_step_wrapper(runtime):
    """``process_batch_result_decode(self, batch, result)``, after: `decode_step` / `decode_finish`."""

    def _pick(batch, *_a, **_k):
        return batch

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if runtime.enabled and runtime.sides.get("decode") is not None:
            safe_invoke("decode.step", on_decode_batch, runtime, _pick(*args, **kwargs))
        return result

    return wrapper


def make_prebuilt_result_wrapper(runtime):
    """``process_batch_result_prebuilt(self, batch)``, after: rooms that finished at once."""

    def _pick(batch, *_a, **_k):
        return batch

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if runtime.enabled and runtime.sides.get("decode") is not None:
            safe_invoke("decode.prebuilt", on_prebuilt_result, runtime, _pick(*args, **kwargs))
        return result

    return wrapper


def make_retract_wrapper(runtime):
    """``ScheduleBatch.retract_decode(self)``, after: retracted rooms are `skipped`."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if runtime.enabled and runtime.sides.get("decode") is not None:
            retracted = list(result[0]) + list(result[2]) if isinstance(result, tuple) and len(result) == 3 else []
            safe_invoke("decode.retract", on_retract, runtime, retracted)
        return result

    return wrapper


def make_release_wrapper(runtime):
    """``release_kv_cache(req, tree_cache, ...)`` as each module that frees a decode room
    calls it (the batch result processor, the scheduler's abort, the transfer queue's
    checksum drop, a retraction's release), before: `on_release`."""

    def _pick(req, *_a, **_k):
        return req

    def wrapper(wrapped, instance, args, kwargs):
        if runtime.enabled and runtime.sides.get("decode") is not None:
            safe_invoke("decode.release", on_release, runtime, _pick(*args, **kwargs))
        return wrapped(*args, **kwargs)

    return wrapper


def make_transfer_release_wrapper(runtime):
    """``DecodeTransferQueue._release_request(self, decode_req)`` (0.5.21 on), before: a room the
    transfer queue releases without a commit is counted (`on_transfer_release`)."""

    def _pick(decode_req, *_a, **_k):
        return decode_req

    def wrapper(wrapped, instance, args, kwargs):
        if runtime.enabled and runtime.sides.get("decode") is not None:
            safe_invoke("decode.transfer_release", on_transfer_release, runtime, instance, _pick(*args, **kwargs))
        return wrapped(*args, **kwargs)

    return wrapper


def make_transfer_failed_wrapper(runtime):
    """``DecodeTransferQueue._abort_failed_transfer(self, decode_req)`` (0.5.22 on), before:
    the room's transfer failed; record it (`on_transfer_failed`)."""

    def _pick(decode_req, *_a, **_k):
        return decode_req

    def wrapper(wrapped, instance, args, kwargs):
        if runtime.enabled and runtime.sides.get("decode") is not None:
            safe_invoke("decode.transfer_failed", on_transfer_failed, runtime, instance, _pick(*args, **kwargs))
        return wrapped(*args, **kwargs)

    return wrapper


def make_verify_checksums_wrapper(runtime):
    """``_verify_kv_checksums(self, batch)``, around: enforce mode drops mismatching rooms."""

    def _pick(batch, *_a, **_k):
        return batch

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if runtime.config.enforce:  # a rank that agreed joins every all-reduce, switched off since or not
            enforce.enforce_batch(runtime, instance, _pick(*args, **kwargs), mismatch_flags)
        return result

    return wrapper
