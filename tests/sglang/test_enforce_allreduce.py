"""enforce: every attention-TP rank drops the same requests (MAX all-reduce, gloo, 2 processes)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4_idxk_probe.sglang.pd_decode import all_reduce_max


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
