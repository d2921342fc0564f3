"""A phase's settling (RigSession._settle, no servers): on a busy machine the servers'
records arrive slowly, and the wait must go on while they still arrive, yet end once
nothing has moved for the stall limit (a real stall is then reported by the phase)."""

from __future__ import annotations

import time

from dsv4_idxk_probe.testbed.sglang.run import RigSession


class SlowServers(RigSession):
    """Records that arrive one room per poll, then (optionally) stop arriving."""

    poll_s = 0.05

    def __init__(self, tmp_path, rids: list[str], arriving: int):
        super().__init__(tmp_path)
        self.rids, self.arriving, self.polls = rids, arriving, 0

    def _rooms_of(self, rids):
        self.polls += 1
        return {rid: n for n, rid in enumerate(self.rids[: min(self.polls, self.arriving)], 1) if rid in rids}

    def _read(self, kind):
        return [{"room": n, "stage": "decode_finish"} for n in range(1, len(self.rids) + 1)]

    def _logged(self, rooms):
        return True

    def _fault_records(self, rids):
        return []


def test_settling_waits_as_long_as_records_keep_arriving(tmp_path):
    rids = [f"r{n}" for n in range(60)]
    servers = SlowServers(tmp_path, rids, arriving=len(rids))
    started = time.monotonic()
    servers._settle(set(rids), stall_s=1.0)
    # every room's record was seen, though they took longer than the stall limit to arrive
    assert servers.polls >= len(rids) and time.monotonic() - started > 1.0


def test_settling_ends_after_the_stall_limit_once_nothing_moves(tmp_path):
    rids = [f"r{n}" for n in range(10)]
    servers = SlowServers(tmp_path, rids, arriving=3)  # three rooms, then a stall
    started = time.monotonic()
    servers._settle(set(rids), stall_s=0.5)
    waited = time.monotonic() - started
    assert 0.5 <= waited < 60 and servers.polls > 3  # it ends (60: a hung wait, not a speed)
