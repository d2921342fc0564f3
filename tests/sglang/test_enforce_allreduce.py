"""enforce: every attention-TP rank drops the same requests (MAX all-reduce, gloo, 2 processes)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4_idxk_probe.sglang.enforce import all_reduce_max


def _rank(rank: int, port: int, flags: list[int], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = all_reduce_max(flags, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_flags_are_max_reduced_across_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, flags, results)) for r, flags in enumerate(([0, 1, 0], [1, 0, 0]))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert dict(results) == {0: [1, 1, 0], 1: [1, 1, 0]}


def test_single_rank_or_no_group_leaves_flags_alone():
    assert all_reduce_max([0, 1], None) == [0, 1]
    assert all_reduce_max([], None) == []


# %% finding 5: enforce only where every attention-TP rank runs the probe


def _enforce_rank(rank: int, port: int, has_probe: bool, flags_fail: bool, results) -> None:
    import logging
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    from dsv4_idxk_probe.sglang import enforce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=10))
    try:
        if not has_probe:  # a rank whose probe never started: it runs SGLang only
            time.sleep(6)
            results[rank] = "no probe"
            return
        agreed, _why = enforce.agree_on_enforce(dist.group.WORLD, timeout_s=3)
        runtime = SimpleNamespace(sides={"decode": SimpleNamespace(active=True, enforce_agreed=agreed)},
                                  log=logging.getLogger("test"))

        def flags(runtime, reqs):
            if flags_fail:
                raise RuntimeError("this rank's probe broke after start")
            return [enforce.DROP if rank == 0 else enforce.KEEP, enforce.KEEP]

        dropped, kept = [], []
        scheduler = SimpleNamespace(attn_tp_cpu_group=dist.group.WORLD,
                                    _handle_kv_checksum_mismatch=lambda req, msg: dropped.append(req.rid))
        batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a", bootstrap_room=1), SimpleNamespace(rid="b", bootstrap_room=2)],
                                filter_batch=lambda keep_indices: kept.append(keep_indices))
        enforce.enforce_batch(runtime, scheduler, batch, flags)
        results[rank] = (agreed, dropped, kept)
    finally:
        dist.destroy_process_group()


def _run_ranks(has_probe: tuple[bool, bool], flags_fail: tuple[bool, bool]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_enforce_rank, args=(r, port, has_probe[r], flags_fail[r], results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    return dict(results)


def test_a_rank_without_the_probe_turns_enforce_off_instead_of_hanging_the_others():
    """Rank 1 never started its probe: rank 0 must not wait for it in an all-reduce."""
    results = _run_ranks((True, False), (False, False))
    assert results[1] == "no probe"
    agreed, dropped, kept = results[0]
    assert (agreed, dropped, kept) == (False, [], [])


def test_a_rank_whose_probe_broke_later_still_joins_the_all_reduce():
    """Both ranks agreed at start; rank 1's flags then fail: it joins with zeros and both drop alike."""
    results = _run_ranks((True, True), (False, True))
    assert results == {0: (True, ["a"], [[1]]), 1: (True, ["a"], [[1]])}


# %% issue 31: one decision for the whole group, reached by late ranks too


def _late_rank(rank: int, port: int, delay_s: float, window_s: float, results) -> None:
    import time
    from datetime import timedelta

    from dsv4_idxk_probe.sglang import enforce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=8))
    try:
        started = time.monotonic()
        time.sleep(delay_s)  # this rank's probe starts late
        agreed, _why = enforce.agree_on_enforce(dist.group.WORLD, timeout_s=window_s)
        joined = None
        if agreed:  # an enforcing rank all-reduces on every batch: alone, it would wait for the others in vain
            joined = all_reduce_max([rank], dist.group.WORLD)
        else:  # a live scheduler serves on (and rank 0 keeps the store up) while the late rank decides
            time.sleep(max(0.0, started + 7.0 - time.monotonic()))  # past the late rank's decision
        results[rank] = (agreed, joined)
    except Exception as exc:  # the gloo timeout: a rank all-reduced alone
        results[rank] = ("failed", type(exc).__name__)
    finally:
        dist.destroy_process_group()


def test_a_rank_arriving_after_the_agreement_window_joins_the_others_off():
    """Ranks 0 and 1 give up waiting for rank 2 after 2 s; rank 2 starts its probe at 4 s.
    All three must reach the same decision (off), and none may all-reduce alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_late_rank, args=(r, port, 4.0 if r == 2 else 0.0, 2.0, results)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert dict(results) == {0: (False, None), 1: (False, None), 2: (False, None)}


def test_ranks_arriving_within_the_window_all_turn_enforce_on():
    """The same three ranks, rank 2 0.5 s late within a 10 s window: all on, and the all-reduce pairs up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_late_rank, args=(r, port, 0.5 if r == 2 else 0.0, 10.0, results)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert dict(results) == {r: (True, [2]) for r in range(3)}


def test_the_decision_is_written_once_and_every_rank_adopts_it():
    """Store level: the first rank to time out writes "off"; a rank that then sees the
    whole group (the late one) adopts "off" instead of turning on alone."""
    from dsv4_idxk_probe.sglang.enforce import _decide

    store = dist.HashStore()
    prefix = "dsv4_idxk_probe/enforce/0-1"
    early = _decide(store, prefix, 0, [0, 1], timeout_s=0.2)
    late = _decide(store, prefix, 1, [0, 1], timeout_s=0.2)
    assert early[0] is False and late[0] is False
    assert "joins it off" in late[1]


# %% issue 31: a rank whose probe was switched off since still joins every all-reduce


def _switched_off_rank(rank: int, port: int, results) -> None:
    import logging
    from datetime import timedelta
    from types import SimpleNamespace

    from dsv4_idxk_probe.sglang import enforce, pd_decode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=6))
    try:
        agreed, _why = enforce.agree_on_enforce(dist.group.WORLD, timeout_s=10)
        side = SimpleNamespace(active=True, enforce_agreed=agreed)
        runtime = SimpleNamespace(sides={"decode": side}, log=logging.getLogger("test"), enabled=True,
                                  config=SimpleNamespace(enforce=True))
        dropped, kept = [], []
        scheduler = SimpleNamespace(attn_tp_cpu_group=dist.group.WORLD, waiting_queue=[],
                                    _handle_kv_checksum_mismatch=lambda req, msg: dropped.append(req.rid))
        batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a", bootstrap_room=1), SimpleNamespace(rid="b", bootstrap_room=2)],
                                filter_batch=lambda keep_indices: kept.append(keep_indices))
        if rank == 1:
            runtime.enabled = False  # this rank's probe was switched off after the agreement
        drop = getattr(enforce, "DROP", 1)
        pd_decode.mismatch_flags = lambda runtime, reqs: [drop if rank == 0 else 0, 0]
        wrapper = pd_decode.make_verify_checksums_wrapper(runtime)
        wrapper(lambda batch: None, scheduler, (batch,), {})
        results[rank] = (agreed, dropped, kept)
    finally:
        dist.destroy_process_group()


def test_a_rank_whose_probe_was_switched_off_still_joins_the_all_reduce():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_switched_off_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert dict(results) == {0: (True, ["a"], [[1]]), 1: (True, ["a"], [[1]])}
