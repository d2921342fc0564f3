"""Prefill hooks: digest each room as its last chunk is handed to the transfer.

Targets (configs/targets/sglang.yaml, "PD prefill / decode"):

* ``PrefillBootstrapQueue._init_kv_manager`` (after): build the prefill side
  (digest engine, monitor, exchange server) once SGLang's KV manager exists;
* ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` (around, acts only on
  ``last_chunk=True``): find the room's pages, enqueue its digest on the
  current stream, clear the probe slots of the metadata row and write what is
  already known, before SGLang's own send runs;
* ``CommonKVSender.send`` (before; before 0.5.23, where each backend's own
  ``send`` never calls it, ``CommonKVSender._prepare_send_indices``, which
  each of them calls first): the in-band write. The room digest is in
  pinned host memory once the stream has passed the kernel; on the NIXL path
  ``_send_kv_chunk`` has just blocked on that stream (``kv_to_page_indices``
  is a ``.cpu()``), so the value is ready here and is copied into the
  metadata row before the aux data leaves, with no sync of ours. Where the
  transport does not block (Mooncake's pinned async indices), the digest is
  not ready yet: observe mode leaves the slots empty and decode fetches the
  vectors from the exchange instead, in enforce mode too (decode waits for
  them there; this thread never waits).

No SGLang import: objects are read through accessors.py / index_k.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..pd import InbandDigest, RoomId
from ..pd.inband import endpoint_only_slots
from ..safety import safe_invoke
from .accessors import (
    ATTR_INBAND, ATTR_SENT, dcp_size, metadata_row, prefill_attempt, prefill_skip_reason, rid_of, room_of,
    row_slot_plan, sender_is_last_send,
)
from .index_k import prefill_room_pages
from .sides import build_side


class InbandWrite:
    """A room digest on its way into the metadata row."""

    __slots__ = ("pending", "row", "signature", "n_tokens", "port")

    def __init__(self, pending: Any, row: np.ndarray, signature: int, n_tokens: int, port: int = 0):
        self.pending = pending
        self.row = row
        self.signature = signature
        self.n_tokens = n_tokens
        self.port = port  # the exchange's port, carried in the digest's header (pd/inband.py)

    def commit(self) -> None:
        """Copy the (ready) room digest into the plan's digest slots (1-4 on 0.5.18-0.5.23). A
        digest of rows it could not read goes nowhere: the slots keep the port alone, and decode
        asks the exchange, whose digest of it compares as not comparable."""
        room = self.pending.whole_room_digest(0)
        if room is None:
            return
        value = InbandDigest(room, self.signature, self.n_tokens)
        self.row[row_slot_plan(self.row).digest] = np.array(value.to_slots(self.port), dtype=np.uint64)


def prefill_side(runtime: Any, scheduler: Any):
    """The active prefill side, built from the scheduler if the init hook did not run."""
    side = runtime.sides.get("prefill")
    if side is None:
        queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
        manager = getattr(queue, "kv_manager", None)
        if queue is None or manager is None:
            runtime.not_applicable("prefill.side", "the scheduler has no prefill bootstrap queue with a KV manager")
            return None
        side = build_side(runtime, "prefill", scheduler.token_to_kv_pool_allocator, manager.kv_args,
                          host=getattr(manager, "local_ip", None), gpu_id=getattr(queue, "gpu_id", None),
                          rank_port=getattr(manager, "rank_port", None), dcp_size=dcp_size(manager))
    return side if side.active else None


def on_queue_init(runtime: Any, queue: Any, manager: Any) -> None:
    build_side(runtime, "prefill", queue.token_to_kv_pool, manager.kv_args,
               host=getattr(manager, "local_ip", None), gpu_id=getattr(queue, "gpu_id", None),
               rank_port=getattr(manager, "rank_port", None),  # the port_offset rule (exchange/endpoint.py)
               dcp_size=dcp_size(manager))


def on_last_chunk(runtime: Any, scheduler: Any, req: Any, end_idx: int | None) -> None:
    """Digest the room whose last chunk is about to be sent; fill what the row can hold now."""
    row = metadata_row(getattr(scheduler, "disagg_metadata_buffers", None), getattr(req, "metadata_buffer_index", None))
    plan = row_slot_plan(row) if row is not None else None
    if plan is not None:
        row[plan.probe_slots] = 0  # rows are reused and prefill never clears them; SGLang's own slots untouched
    side = prefill_side(runtime, scheduler)
    if side is None or prefill_skip_reason(req) is not None:
        return
    pages = prefill_room_pages(scheduler, req, end_idx)
    if isinstance(pages, str):
        runtime.log.debug("dsv4-idxk-probe: room %s not digested: %s", room_of(req), pages)
        return
    mark = (room_of(req), prefill_attempt(req), pages.start, pages.start + pages.n_tokens)
    if getattr(req, ATTR_SENT, None) == mark:
        return  # this exact send was digested already
    setattr(req, ATTR_SENT, mark)
    # the token indices as they are where the engine reads them so (`PrefillSide`): no device op here
    table = pages.pages if pages.stride == getattr(side, "page_id_stride", 1) else pages.page_ids()
    pending = side.monitor.room_sent(RoomId(room_of(req)), table, pages.n_tokens, extra={"rid": rid_of(req)})
    if pending is None:
        runtime.metrics.records_dropped.labels(sink="digest_queue").inc()
        return
    if row is None:
        return  # metadata row on a device: the exchange alone carries this room
    if side.endpoint_slot and plan.endpoint is not None:
        row[plan.endpoint] = side.endpoint_slot
    if plan.digest is None:
        return  # SGLang uses the slots a digest would need: the exchange alone carries it
    port = exchange_port_of(side)
    if port:  # the port travels even if the digest never does (not ready when the aux data leaves)
        row[plan.digest] = np.array(endpoint_only_slots(port), dtype=np.uint64)
    write = InbandWrite(pending, row, side.signature, pages.n_tokens, port)
    sender = getattr(req, "disagg_kv_sender", None)
    # Host buffers are digested at submit (no event). With an event, a kernel launched a
    # moment ago has not run yet: asking would be a driver call on the scheduler thread
    # that answers no; the sender's send asks after NIXL's sync (`on_sender_send`).
    if pending.done is None and pending.ready():
        write.commit()
    elif sender is not None:
        setattr(sender, ATTR_INBAND, write)


def exchange_port_of(side: Any) -> int:
    """The port this rank's exchange serves on (0: none)."""
    server = getattr(side, "server", None)
    return int(getattr(server, "port", 0) or 0) if server is not None else 0


def on_sender_send(runtime: Any, sender: Any, write: InbandWrite, kv_indices: Any) -> None:
    """Before a chunk leaves: commit the in-band digest if it is ready (it is, after NIXL's .cpu()).

    Never waits for it: where the transport does not block before the aux data
    leaves (Mooncake's pinned async indices), this thread is the scheduler's,
    already behind the next forward. The slots stay empty and decode takes the
    digest from the exchange (enforce waits there, on decode).
    """
    if write.pending.ready():
        write.commit()
    elif not sender_is_last_send(sender, kv_indices):
        return  # the aux data does not leave with this send; try again at the next
    else:
        _count(runtime, "inband_deferred")  # decode will ask the exchange for this room
    delattr(sender, ATTR_INBAND)


def _count(runtime: Any, name: str) -> None:
    side = runtime.sides.get("prefill")
    if side is not None and hasattr(side, name):
        setattr(side, name, getattr(side, name) + 1)


# %% wrapper factories (named in the target table)


def make_queue_init_wrapper(runtime):
    """``PrefillBootstrapQueue._init_kv_manager(self)``, after: build the prefill side."""

    def wrapper(wrapped, instance, args, kwargs):
        manager = wrapped(*args, **kwargs)
        if runtime.enabled:
            safe_invoke("prefill.init", on_queue_init, runtime, instance, manager)
        return manager

    return wrapper


def make_send_kv_chunk_wrapper(runtime):
    """``send_kv_chunk(self, req, last_chunk=False, end_idx=None)``, around: digest on the last chunk."""

    def _pick(req, last_chunk=False, end_idx=None, *_a, **_k):
        return req, last_chunk, end_idx

    def wrapper(wrapped, instance, args, kwargs):
        if not runtime.enabled:
            return wrapped(*args, **kwargs)
        req, last_chunk, end_idx = _pick(*args, **kwargs)
        if last_chunk:
            safe_invoke("prefill.send_kv_chunk", on_last_chunk, runtime, instance, req, end_idx)
        return wrapped(*args, **kwargs)

    return wrapper


def make_sender_send_wrapper(runtime):
    """``CommonKVSender.send(self, kv_indices, ...)`` (0.5.23) or
    ``CommonKVSender._prepare_send_indices(self, kv_indices, ...)`` (0.5.18-0.5.22),
    before: the zero-sync in-band write."""

    def _pick(kv_indices, *_a, **_k):
        return kv_indices

    def wrapper(wrapped, instance, args, kwargs):
        write = getattr(instance, ATTR_INBAND, None)
        if write is not None and runtime.enabled:
            safe_invoke("prefill.sender_send", on_sender_send, runtime, instance, write, _pick(*args, **kwargs))
        return wrapped(*args, **kwargs)

    return wrapper
