"""Enforce mode's protocol between the attention-TP ranks of one decode scheduler.

Why it exists: with ``enforce`` on, decode drops a room whose receipt digest
differs from prefill's, through SGLang's own checksum path
(``_verify_kv_checksums``). The ranks of an attention-TP group run the same
batch, so they must drop the same requests, or their batches diverge and the
next collective hangs. Two rules keep them together:

* at start, `agree_on_enforce`: one decision the whole group reaches
  together. Every rank with an active decode side announces itself in the
  process group's store and waits (up to the agreement window) for the
  others; the first rank to see its whole group writes "on", the first to
  time out writes "off", atomically (``compare_set``: the first writer wins),
  and every rank adopts what was written. A rank arriving after the window
  reads "off" and joins off: never on alone. A rank whose probe never
  started writes nothing and makes no collective call, so no one waits for
  it in an all-reduce;
* on every batch, `enforce_batch`: each rank's verdicts go through a MAX
  all-reduce over the attention-TP CPU group (as upstream's checksum does),
  so a request one rank finds corrupt is dropped on all of them. A rank that
  agreed at start always joins, with KEEP verdicts when its own judging
  failed or its probe was switched off since (the hook keeps calling in).

A verdict is KEEP, HOLD or DROP (MAX: DROP wins, then HOLD). HOLD is for a
room whose prefill digest did not ride in band and whose exchange fetch is
still in flight on a worker thread: the request leaves this prebuilt batch
and goes back to the scheduler's waiting queue, to be judged at a later
batch, instead of a blocking fetch on the scheduler thread. The hold is
bounded: past the longest a fetch may take, the room is admitted unjudged
(exchange/prefetch.py).

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

#: A request's verdict; the MAX over the ranks wins.
KEEP, HOLD, DROP = 0, 1, 2

#: (runtime, requests) -> one verdict per request (KEEP, HOLD or DROP).
Judge = Callable[[Any, list], list[int]]

_ON, _OFF = b"on", b"off"


def agree_on_enforce(group: Any, timeout_s: float = ENFORCE_AGREEMENT_TIMEOUT_S) -> tuple[bool, str]:
    """Do all attention-TP ranks run an active probe? One answer for the whole group.

    A rank whose probe did not start never joins the all-reduce, and the
    others would hang in it; a rank that turned on while the others turned
    off would hang alone. So the store holds one decision, written once
    (`_decide`): "on" by the first rank that sees every rank announced, "off"
    by the first that times out waiting; every rank, early or late, adopts it.
    No collective: a rank without the probe is never waited on by a call it
    does not make.
    """
    try:
        import torch.distributed as dist

        if single_rank(group):
            return True, "one rank"
        ranks = dist.get_process_group_ranks(group)
        store = dist.distributed_c10d._get_default_store()
        prefix = "dsv4_idxk_probe/enforce/" + "-".join(str(r) for r in ranks)
        return _decide(store, prefix, dist.get_rank(), ranks, timeout_s)
    except Exception as exc:
        return False, f"the enforce agreement failed on this rank ({type(exc).__name__}: {exc})"


def _decide(store: Any, prefix: str, rank: int, ranks: list[int], timeout_s: float) -> tuple[bool, str]:
    """Announce `rank`, wait for the others, then take the group's one decision from `store`."""
    from datetime import timedelta

    decision_key = f"{prefix}/decision"
    store.set(f"{prefix}/{rank}", "1")
    try:
        store.wait([f"{prefix}/{r}" for r in ranks], timedelta(seconds=timeout_s))
        proposal, why = _ON, ""
    except Exception as exc:
        proposal = _OFF
        why = f"not every attention-TP rank announced an active probe within {timeout_s:g} s ({type(exc).__name__})"
    decided = bytes(store.compare_set(decision_key, "", proposal))
    if decided == _ON:
        return True, ""
    return False, why or "another attention-TP rank timed out waiting for the group first; this rank joins it off"


def single_rank(group: Any) -> bool:
    """No other rank to agree with: no group, no torch.distributed, or a group of one."""
    try:
        import torch.distributed as dist

        return group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1
    except Exception:
        return False


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
    """Judge a prebuilt batch (`judge`) and act on the verdicts on every rank alike.

    Once the ranks agreed at start (`agree_on_enforce`), this rank takes part
    in the all-reduce on every batch, whatever else of the probe failed or was
    switched off since (its verdicts are then KEEP), so no other rank waits
    for it in vain. DROP aborts the request through SGLang's checksum path;
    HOLD sends it back to the waiting queue for a later batch.
    """
    side = runtime.sides.get("decode")
    if side is None or getattr(side, "enforce_agreed", None) is not True:
        return
    reqs = list(batch.reqs)
    judging = getattr(runtime, "enabled", True) and getattr(side, "active", False)
    verdicts = safe_invoke("decode.enforce_flags", judge, runtime, reqs, fallback=None) if judging else None
    verdicts = verdicts or [KEEP] * len(reqs)
    verdicts = safe_invoke("decode.enforce_all_reduce", all_reduce_max, verdicts,
                           getattr(scheduler, "attn_tp_cpu_group", None), fallback=None)
    if not verdicts or not any(verdicts):
        return
    removed = set()
    held = []
    for i, req in enumerate(reqs):
        if verdicts[i] == HOLD:
            removed.add(i)
            held.append(req)
            continue
        if verdicts[i] != DROP:
            continue
        message = f"dsv4-idxk-probe: index-K mismatch at receipt, room {room_of(req)} (rid {getattr(req, 'rid', '?')})"
        runtime.log.error(message)
        if safe_invoke("decode.enforce_abort", _abort, scheduler, req, message, fallback=False):
            removed.add(i)
        elif safe_invoke("decode.enforce_abort", _finished, req, fallback=False):
            # the abort raised past marking it finished: out of the batch, as SGLang's path takes it
            # (kept, SGLang's prebuilt step would assert on checkpointing a finished request)
            removed.add(i)
            runtime.log.error("dsv4-idxk-probe: SGLang's abort of room %s raised after finishing it (counted)",
                              room_of(req))
        elif safe_invoke("decode.enforce_abort", _finish_with_abort, req, fallback=False):
            # SGLang's abort raised (by design where SGLANG_IS_IN_CI is set): it stays in this batch
            # to be finished by SGLang as an abort after this step (answered with the error, freed)
            runtime.log.error("dsv4-idxk-probe: SGLang's abort of room %s raised (counted); finishing it as an "
                              "abort after this step instead", room_of(req))
    if removed:
        batch.filter_batch(keep_indices=[i for i in range(len(reqs)) if i not in removed])
    if held:
        safe_invoke("decode.enforce_hold", _hold, scheduler, held)


def _hold(scheduler: Any, reqs: list) -> None:
    """Back to the front of the waiting queue: the next prebuilt batch takes them first."""
    scheduler.waiting_queue[:0] = reqs


def _abort(scheduler: Any, req: Any, message: str) -> bool:
    scheduler._handle_kv_checksum_mismatch(req, message)
    return True


def _finish_with_abort(req: Any) -> bool:
    """SGLang's own deferred finish (`Req.to_finish`, taken at the step's end): the error
    SGLang's checksum path answers, and the request freed as any finished one. Taken out
    of the batch unanswered instead, it was never answered nor freed; kept as it was, served."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT("KV checksum mismatch", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
    # its pages are checkpointed into the prefix cache in this step and at its release unless barred:
    # later rooms matching that prefix would reuse the corrupt bytes, and decode digests after the prefix
    req.skip_radix_cache_insert = True
    return True


def _finished(req: Any) -> bool:
    return bool(req.finished())
