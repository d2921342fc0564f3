"""Enforce mode's protocol between the attention-TP ranks of one decode scheduler.

Why it exists: with ``enforce`` on, decode drops a room whose receipt digest
differs from prefill's, through SGLang's own checksum path
(``_verify_kv_checksums``). The ranks of an attention-TP group run the same
batch, so they must drop the same requests, or their batches diverge and the
next collective hangs. Two rules keep them together:

* at start, `agree_on_enforce`: every rank with an active decode side
  announces itself in the process group's store and waits for the others; a
  rank that does not see its whole group keeps enforce off (observe only),
  since a rank whose probe never started would never join the all-reduce;
* on every batch, `enforce_batch`: each rank's drop flags go through a MAX
  all-reduce over the attention-TP CPU group (as upstream's checksum does),
  so a request one rank finds corrupt is dropped on all of them. A rank that
  agreed at start always joins, with zero flags when its own judging failed.

What a rank finds corrupt (the digest comparison, per request) is the decode
hooks' business (``pd_decode.mismatch_flags``); this module only makes the
ranks act alike. It talks to torch.distributed and SGLang's scheduler, so it
lives with the SGLang adapter.
"""

from __future__ import annotations

from typing import Any, Callable

from ..safety import safe_invoke
from .accessors import room_of

ENFORCE_AGREEMENT_TIMEOUT_S = 20.0

#: (runtime, requests) -> one flag per request, 1 to drop it.
Judge = Callable[[Any, list], list[int]]


def agree_on_enforce(group: Any, timeout_s: float = ENFORCE_AGREEMENT_TIMEOUT_S) -> tuple[bool, str]:
    """Do all attention-TP ranks run an active probe? Only then may enforce all-reduce.

    A rank whose probe did not start never joins the all-reduce, and the
    others would hang in it. Each rank with an active decode side announces
    itself in the process group's store; a rank that does not see all of its
    group within `timeout_s` keeps enforce off (observe only). No collective:
    a rank without the probe is never waited on by a call it does not make.
    """
    try:
        import torch.distributed as dist

        if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return True, "one rank"
        ranks = dist.get_process_group_ranks(group)
        store = dist.distributed_c10d._get_default_store()
        prefix = "dsv4_idxk_probe/enforce/" + "-".join(str(r) for r in ranks)
        store.set(f"{prefix}/{dist.get_rank()}", "1")
        from datetime import timedelta

        store.wait([f"{prefix}/{r}" for r in ranks], timedelta(seconds=timeout_s))
        return True, ""
    except Exception as exc:
        return False, f"not every attention-TP rank announced an active probe ({type(exc).__name__}: {exc})"


def all_reduce_max(flags: list[int], group: Any) -> list[int]:
    """MAX over the group: every attention-TP rank drops the same requests, as upstream's own
    checksum makes them (sglang-0.5.23-pd-hooks.md, section 2.3)."""
    import torch
    import torch.distributed as dist

    if not flags or group is None or not dist.is_available() or not dist.is_initialized():
        return flags
    if dist.get_world_size(group) == 1:
        return flags
    tensor = torch.tensor(flags, dtype=torch.int32, device="cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def enforce_batch(runtime: Any, scheduler: Any, batch: Any, judge: Judge) -> None:
    """Judge a prebuilt batch (`judge`) and drop its mismatching rooms on every rank alike.

    Once the ranks agreed at start (`agree_on_enforce`), this rank takes part
    in the all-reduce on every batch, whatever else of the probe failed (its
    flags are then zeros), so no other rank waits for it in vain.
    """
    side = runtime.sides.get("decode")
    if side is None or not side.active or not getattr(side, "enforce_agreed", True):
        return
    reqs = list(batch.reqs)
    flags = safe_invoke("decode.enforce_flags", judge, runtime, reqs, fallback=None) or [0] * len(reqs)
    flags = safe_invoke("decode.enforce_all_reduce", all_reduce_max, flags,
                        getattr(scheduler, "attn_tp_cpu_group", None), fallback=None)
    if not flags or not any(flags):
        return
    dropped = set()
    for i, req in enumerate(reqs):
        if not flags[i]:
            continue
        message = f"dsv4-idxk-probe: index-K mismatch at receipt, room {room_of(req)} (rid {getattr(req, 'rid', '?')})"
        runtime.log.error(message)
        if safe_invoke("decode.enforce_abort", _abort, scheduler, req, message, fallback=False):
            dropped.add(i)
    if dropped:
        batch.filter_batch(keep_indices=[i for i in range(len(reqs)) if i not in dropped])


def _abort(scheduler: Any, req: Any, message: str) -> bool:
    scheduler._handle_kv_checksum_mismatch(req, message)
    return True
