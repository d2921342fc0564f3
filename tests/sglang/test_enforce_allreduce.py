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
            return [1 if rank == 0 else 0, 0]

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
