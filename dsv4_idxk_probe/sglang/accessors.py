"""Reading SGLang's requests, queues and transfer objects (0.5.23 attribute names).

Companion of index_k.py: every attribute of a Req, DecodeRequest, KV sender,
KV receiver or MetadataBuffers the hooks read is named here. Values SGLang
defines as constants are taken from its loaded modules when present (so a
fork's values win) and fall back to 0.5.23's, so these helpers work without
SGLang imported (stand-ins in the sync audit).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

#: Attributes the probe adds to SGLang objects (Req has no __slots__).
ATTR_INBAND = "_dsv4_idxk_inband"  # on a KV sender: the in-band write waiting for its digest
ATTR_SENT = "_dsv4_idxk_sent"  # on a prefill Req: (room, start, end) already digested
ATTR_DEST = "_dsv4_idxk_dest"  # on a DecodeRequest: RoomPages recorded at _send_kv_metadata
ATTR_RECV = "_dsv4_idxk_recv"  # on a decode Req: (PendingDigest, InbandDigest, n_tokens) at receipt
ATTR_STEPS = "_dsv4_idxk_steps"  # on a decode Req: decode batches seen

#: Metadata row slots (bootstrap_room[idx, :]) when SGLang uses only slot 0
#: (its room), as every release 0.5.18-0.5.23 does: 1-4 the in-band digest
#: (pd.InbandDigest), 5 the prefill rank's exchange endpoint. `slot_plan`
#: steps aside from slots a newer SGLang reserves for itself.
SLOT_DIGEST = slice(1, 5)
SLOT_ENDPOINT = 5
DIGEST_SLOTS = 4

#: Where upstream (after 0.5.23) names the bootstrap_room slots its own KV
#: checksum writes (ROOM_SLOT_CHECKSUM_SIG / _DIGEST / _TOKENS = 1, 2, 3).
KV_CHECKSUM_MODULE = "sglang.srt.disaggregation.kv_checksum"


def sglang_room_slots(row_width: int) -> set[int]:
    """Slots of a bootstrap_room row SGLang itself uses: 0 (the room), plus every
    ``ROOM_SLOT_*`` constant of its kv_checksum module when that module exists."""
    used = {0}
    module = sys.modules.get(KV_CHECKSUM_MODULE)
    if module is None:
        try:
            import importlib.util

            if importlib.util.find_spec(KV_CHECKSUM_MODULE) is not None:
                import importlib

                module = importlib.import_module(KV_CHECKSUM_MODULE)
        except Exception:  # no such module (every release up to 0.5.23), or it fails to import
            module = None
    for name in dir(module) if module is not None else ():
        value = getattr(module, name, None)
        if name.startswith("ROOM_SLOT_") and isinstance(value, int) and 0 <= value < row_width:
            used.add(value)
    return used


class SlotPlan:
    """Which slots of a bootstrap_room row carry the in-band digest and the endpoint.

    Four consecutive slots SGLang does not use for the digest, the next free one
    for the endpoint; where the row has no four free consecutive slots the
    digest goes out of band only (decode fetches it from the exchange), and
    where no slot is left at all, the endpoint too. Prefill and decode compute
    the same plan from the same SGLang; a mismatched plan reads no digest (the
    magic header does not match), never a wrong one.
    """

    __slots__ = ("digest", "endpoint", "width")

    def __init__(self, width: int, used: set[int]):
        free = [s for s in range(width) if s not in used]
        self.width = width
        self.digest: slice | None = None
        for start in free:
            if all(s in free for s in range(start, start + DIGEST_SLOTS)):
                self.digest = slice(start, start + DIGEST_SLOTS)
                break
        taken = set(range(self.digest.start, self.digest.stop)) if self.digest else set()
        rest = [s for s in free if s not in taken]
        self.endpoint: int | None = rest[0] if rest else None

    @property
    def probe_slots(self) -> list[int]:
        """Every slot the probe writes (and clears on a reused row)."""
        slots = list(range(self.digest.start, self.digest.stop)) if self.digest else []
        return slots + ([self.endpoint] if self.endpoint is not None else [])


_PLANS: dict[int, SlotPlan] = {}  # by row width; SGLang's own slots do not change in a process


def slot_plan(row_width: int) -> SlotPlan:
    plan = _PLANS.get(row_width)
    if plan is None:
        plan = _PLANS[row_width] = SlotPlan(row_width, sglang_room_slots(row_width))
    return plan


def row_slot_plan(row: Any) -> SlotPlan:
    return slot_plan(int(len(row)))


def req_pool_idx(req: Any) -> Any:
    """A Req's row in req_to_token: ``req.kv.req_pool_idx`` (0.5.19+), else ``req.req_pool_idx`` (0.5.18)."""
    kv = getattr(req, "kv", None)
    if kv is not None and getattr(kv, "req_pool_idx", None) is not None:
        return kv.req_pool_idx
    return getattr(req, "req_pool_idx", None)


def extend_end(req: Any) -> int:
    """End of the request's extended tokens: ``req.extend_end`` (0.5.22+), else
    ``req.extend_range.end`` (0.5.18-0.5.21)."""
    value = getattr(req, "extend_end", None)
    if value is None:
        value = req.extend_range.end
    return int(value)


def cache_protected_len(req: Any) -> int:
    """Tokens decode already holds (the prefix it told prefill): ``req.kv.cache_protected_len``
    (0.5.19+), else ``req.cache_protected_len`` (0.5.18)."""
    kv = getattr(req, "kv", None)
    value = getattr(kv, "cache_protected_len", None) if kv is not None else None
    if value is None:
        value = getattr(req, "cache_protected_len", 0)
    return int(value or 0)


def _constant(module: str, name: str, default: Any) -> Any:
    return getattr(sys.modules.get(module), name, default)


def rid_of(req: Any) -> str | None:
    """SGLang's request id, the one an operator sees in its logs and responses."""
    rid = getattr(req, "rid", None)
    return str(rid) if rid is not None else None


def room_of(req: Any) -> int | None:
    room = getattr(req, "bootstrap_room", None)
    return int(room) if room is not None else None


def is_health_check(req: Any) -> bool:
    prefix = _constant("sglang.srt.constants", "HEALTH_CHECK_RID_PREFIX", "HEALTH_CHECK")
    rid = getattr(req, "rid", None)
    return isinstance(rid, str) and rid.startswith(prefix)


def is_fake_transfer(req: Any) -> bool:
    fake_host = _constant("sglang.srt.disaggregation.utils", "FAKE_BOOTSTRAP_HOST", "2.2.2.2")
    return getattr(req, "bootstrap_host", None) == fake_host


def is_aborted(req: Any) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


def prefill_skip_reason(req: Any) -> str | None:
    """Why a last-chunk send is not digested (None: digest it)."""
    common = decode_skip_reason(req)
    if common is not None:
        return common
    if getattr(req, "pending_bootstrap", False):
        return "superseded attempt (bootstrap pending; it is sent again)"
    sender = getattr(req, "disagg_kv_sender", None)
    state = getattr(sender, "conclude_state", None)
    if state is not None and getattr(state, "name", "") == "Failed":
        return "transfer already failed"
    if sends_nothing(sender):
        return "this rank sends nothing (another prefill rank sends the room)"
    return None


def sends_nothing(sender: Any) -> bool:
    """Whether this prefill rank's sender moves no KV for its room: a CP rank past 0
    (``kv_mgr.is_dummy_cp_rank``: only CP rank 0 sends), or a rank every decode rank
    registered as dummy (``transfer_infos[room]``, all ``is_dummy``: prefill's attention
    TP exceeds decode's and another rank holds the same KV). Its digest would never be
    asked for: decode reads the aux row, and asks the exchange, of non-dummy ranks only.
    The room's registrations are complete before its forward (SGLang admits it at
    ``WaitingForInput``); taken in one C call, so the bootstrap thread cannot change the
    dict under the loop."""
    manager = getattr(sender, "kv_mgr", None)
    if manager is None:
        return False
    if getattr(manager, "is_dummy_cp_rank", False) is True:
        return True
    infos = getattr(manager, "transfer_infos", None)
    per_room = infos.get(getattr(sender, "bootstrap_room", None)) if isinstance(infos, dict) else None
    if not isinstance(per_room, dict):
        return False
    registered = tuple(per_room.values())
    return bool(registered) and all(_is_dummy(info) for info in registered)


def _is_dummy(info: Any) -> bool:
    """A decode rank's registration's dummy flag: a field from 0.5.20, a method of NIXL's
    ``TransferInfo`` in 0.5.18-0.5.19 (its answer taken; anything else: not dummy)."""
    flag = getattr(info, "is_dummy", False)
    if callable(flag):
        try:
            flag = flag()
        except Exception:
            return False
    return isinstance(flag, (bool, np.bool_)) and bool(flag)


def decode_skip_reason(req: Any) -> str | None:
    """Why a received room is not verified (None: verify it); prefill adds its own reasons."""
    if room_of(req) is None:
        return "no bootstrap room"
    if is_health_check(req):
        return "health check"
    if is_fake_transfer(req):
        return "fake bootstrap host"
    if is_aborted(req):
        return "transfer failed (SGLang aborted the room)" if _aborted_for_a_failed_transfer(req) else "aborted"
    return None


def restore_failed(decode_req: Any) -> bool:
    """SGLang's `HiCacheRestoreResult.FAILED` on the room (decode HiCache, 0.5.23): decode
    could not restore the prefix it promised prefill."""
    status = getattr(decode_req, "hicache_restore_status", None)
    return getattr(status, "value", None) == "failed"


#: How SGLang's decode words the abort of a room whose transfer failed (0.5.18-0.5.23).
_TRANSFER_FAILED_ABORT = "Decode transfer failed"


def _aborted_for_a_failed_transfer(req: Any) -> bool:
    """Before 0.5.22 SGLang aborts a room whose transfer failed and releases it with no hook
    of its own (`_abort_failed_transfer` came then): its abort's message is what tells it
    from a client's abort."""
    message = getattr(getattr(req, "finished_reason", None), "message", None)
    return isinstance(message, str) and message.startswith(_TRANSFER_FAILED_ABORT)


def prefill_attempt(req: Any) -> int:
    return int(getattr(req, "prefill_attempt_count", 0) or 0)


# %% metadata row


def metadata_row(metadata_buffers: Any, index: Any) -> np.ndarray | None:
    """Host view (uint64) of a request's metadata row, or None when it lives on
    a device (reading it would synchronise) or the index is unset."""
    if metadata_buffers is None or index is None or int(index) < 0:
        return None
    rows = getattr(metadata_buffers, "bootstrap_room", None)
    if rows is None or rows.device.type != "cpu":
        return None
    return rows[int(index)].numpy().view(np.uint64)


def sender_is_last_send(sender: Any, kv_indices: Any) -> bool:
    """The sender's own notion of "last": this send reaches num_kv_indices."""
    total = getattr(sender, "num_kv_indices", None)
    return total is not None and int(getattr(sender, "curr_idx", 0)) + len(kv_indices) == int(total)


# %% decode destinations

#: Why a host-received room's receipt is not digested on the device (see pd_decode).
HOST_RECEIVE = "received into the HiCache host pool (host-receive); not verified"


def is_host_destination(metadata_kwargs: Any) -> bool:
    """`_send_kv_metadata(..., destination=KVTransferDestination.HOST)`: decode's host pool."""
    dest = metadata_kwargs.get("destination") if isinstance(metadata_kwargs, dict) else None
    return dest is not None and str(getattr(dest, "name", getattr(dest, "value", dest))).upper() == "HOST"


# %% decode peers


def prefill_peer_host(decode_req: Any) -> str | None:
    """Address of the prefill rank that sent the KV (the non-dummy bootstrap info)."""
    receiver = getattr(decode_req, "kv_receiver", None)
    infos = getattr(receiver, "bootstrap_infos", None) or []
    for info in infos:
        if isinstance(info, dict) and not info.get("is_dummy", False) and info.get("rank_ip"):
            return str(info["rank_ip"])
    return None


def origin_len(req: Any) -> int:
    return len(req.origin_input_ids)


# %% process identity (metric labels, room-log file names)


def identity() -> dict[str, str]:
    """This scheduler's metric labels, as SGLang builds them for its own metrics
    (observability/metrics_collector.py, SchedulerMetricsCollector.init_new):
    model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, dp_rank when the
    process has one, and --extra-metric-labels. Only what SGLang has published
    ({} before that; a rank SGLang has not written yet is left out)."""
    rc = sys.modules.get("sglang.srt.runtime_context")
    if rc is None:
        return {}
    out: dict[str, str] = {}
    try:
        out["model_name"] = str(rc.get_serving().served_model_name)
    except Exception:
        pass
    try:
        disagg = rc.get_disagg()
        if getattr(disagg, "enable_pd_role_switch", False):
            out["engine_type"] = "dynamic"
        else:
            mode = str(getattr(disagg.disaggregation_mode, "value", disagg.disaggregation_mode))
            out["engine_type"] = mode if mode in ("prefill", "decode") else "unified"
    except Exception:
        pass
    parallel = None
    try:
        parallel = rc.get_parallel()
    except Exception:
        pass
    for name in ("tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"):
        try:
            value = getattr(parallel, name)
        except Exception:
            continue
        if value is not None:
            out[name] = str(value)
    try:
        extra = rc.get_observability().extra_metric_labels
        for name, value in dict(extra or {}).items():
            out.setdefault(str(name), str(value))
    except Exception:
        pass
    return out


def dcp_size(manager: Any) -> int:
    """The KV manager's decode context parallel size (`attn_dcp_size`; 1 where it has none)."""
    try:
        return max(1, int(getattr(manager, "dcp_size", 1) or 1))
    except (TypeError, ValueError):
        return 1
