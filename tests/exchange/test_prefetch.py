"""Enforce's prefetch (exchange/prefetch.py): a held room's wait is bounded, whatever its fetch does."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from dsv4_idxk_probe.exchange import VectorClient
from dsv4_idxk_probe.exchange.prefetch import Prefetcher, prefetched
from dsv4_idxk_probe.metrics.definitions import ProbeMetrics


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def blocked_fetch(release: threading.Event):
    def fetch(key):
        release.wait(30)
        return f"digest of {key}"
    return fetch


def test_a_fetch_running_past_its_deadline_is_given_up_and_counted():
    release, clock, late = threading.Event(), Clock(), []
    prefetcher = Prefetcher(blocked_fetch(release), deadline_s=1.2, gave_up=lambda: late.append(1), clock=clock)
    try:
        prefetcher.start("7/0")
        clock.now += 1.0
        assert prefetcher.poll("7/0") == (False, None)  # within its deadline: held
        clock.now += 0.3
        assert (prefetcher.poll("7/0"), late) == ((True, None), [1])  # past it: admitted unjudged
    finally:
        release.set()
        prefetcher.close()


def test_a_fetch_done_within_its_deadline_hands_out_its_answer_once():
    release, clock = threading.Event(), Clock()
    prefetcher = Prefetcher(blocked_fetch(release), deadline_s=1.2, clock=clock)
    try:
        prefetcher.start("7/0")
        release.set()
        for _ in range(3000):  # the worker's answer, however busy the machine (the clock stands still)
            done, digest = prefetcher.poll("7/0")
            if done:
                break
            threading.Event().wait(0.01)
        assert (done, digest) == (True, "digest of 7/0")
        assert prefetcher.poll("7/0") == (False, None)  # forgotten once read (a new poll starts anew)
    finally:
        prefetcher.close()


def test_a_room_the_full_table_let_go_is_admitted_not_started_again():
    """It was started again at the back of the queue, let go again by the next rooms before its
    turn, and so held forever while rooms kept landing."""
    release, late, calls = threading.Event(), [], []

    def fetch(key):
        calls.append(key)
        release.wait(30)

    prefetcher = Prefetcher(fetch, cap=2, workers=1, gave_up=lambda: late.append(1))
    try:
        for key in ("a/0", "b/0", "c/0"):  # "a/0" is let go for "c/0"
            prefetcher.start(key)
        assert (prefetcher.poll("a/0"), late) == ((True, None), [1])
        release.set()
    finally:
        prefetcher.close()
    assert "a/0" not in calls[1:]  # never queued again


def test_a_sides_prefetch_deadline_is_the_clients_timeout_plus_the_retry_window_and_counted_late():
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry, role="decode")
    client = VectorClient(timeout_ms=300, metrics=metrics)
    release = threading.Event()
    side = SimpleNamespace(client=client, _retry_s=1.0, fetch_to_localise=blocked_fetch(release))
    try:
        prefetched(side, "9/0")  # made and started here
        prefetcher = side._dsv4_idxk_prefetcher
        assert prefetcher._deadline_s == 1.3
        prefetcher._deadline_s = 0.0
        prefetcher._clock = lambda: float("inf")
        assert prefetched(side, "9/0") == (True, None)
        late = [s.value for f in registry.collect() for s in f.samples
                if s.name == "dsv4_idxk_probe_exchange_errors_total" and s.labels["kind"] == "late"]
        assert late == [1.0]
    finally:
        release.set()
        side._dsv4_idxk_prefetcher.close()
        client.close()


def test_prefill_pp_stages_are_asked_at_once_within_one_retry_window(monkeypatch):
    """Stages asked one after another, each answering late, outlasted enforce's hold
    (`timeout_ms` + `retry_s`): the room was admitted unjudged. Each stage here answers only
    once all four are being asked (a barrier): one at a time, the first waits in vain."""
    from dsv4_idxk_probe.exchange import client as client_module
    from dsv4_idxk_probe.exchange.stages import StageEndpoints

    clock = Clock()
    monkeypatch.setattr(client_module.time, "monotonic", clock)
    client = VectorClient(timeout_ms=200)
    all_asked = threading.Barrier(4, timeout=10)
    windows, whole_fetch = [], client.fetch

    def fetch(endpoint, key, *, retry_s=0.0, until=None):
        if isinstance(endpoint, StageEndpoints):
            return whole_fetch(endpoint, key, retry_s=retry_s)
        windows.append((round(retry_s, 6), round(until, 6)))
        try:
            all_asked.wait()
        except threading.BrokenBarrierError:
            return None
        return ("digest of", endpoint[1])

    monkeypatch.setattr(client, "fetch", fetch)
    monkeypatch.setattr(client_module, "combine_stage_digests", lambda key, digests, layout: digests)
    try:
        stages = StageEndpoints([("127.0.0.1", p) for p in (1, 2, 3, 4)], layout=None)
        got = client.fetch(stages, "9/0", retry_s=1.0)
    finally:
        client.close()
    assert got == [("digest of", p) for p in (1, 2, 3, 4)]  # combined in stage order
    assert windows == [(1.0, 101.2)] * 4  # one window from the room's first try, and its time: + timeout_ms


def test_a_stage_without_the_room_leaves_it_unjudged_and_a_closed_client_asks_no_stage():
    from dsv4_idxk_probe.exchange.stages import StageEndpoints

    client = VectorClient(timeout_ms=200)
    asked = []

    def fetch(endpoint, key, *, retry_s=0.0, until=None):
        if isinstance(endpoint, StageEndpoints):
            return VectorClient.fetch(client, endpoint, key, retry_s=retry_s)
        asked.append(endpoint[1])
        return None if endpoint[1] == 2 else object()

    client.fetch = fetch
    stages = StageEndpoints([("127.0.0.1", p) for p in (1, 2, 3)], layout=None)
    assert client.fetch(stages, "9/0") is None
    client.close()
    assert client.fetch(stages, "9/0") is None  # closed: nothing more goes to the network
    assert sorted(asked) == [1, 2, 3]


def test_a_stage_request_past_its_room_s_time_is_not_sent_and_counts_late(monkeypatch):
    """A stage request that waited for a stage worker past its room's `timeout_ms` +
    `retry_s` (many rooms of several stages at once) still spent a whole `timeout_ms` once
    sent, outlasting enforce's hold: now it is not sent."""
    from dsv4_idxk_probe.exchange import client as client_module

    clock = Clock()
    monkeypatch.setattr(client_module.time, "monotonic", clock)
    client = VectorClient(timeout_ms=200)
    sent = []
    monkeypatch.setattr(client, "_fetch", lambda *a: sent.append(a) or (None, "timeout"))
    try:
        assert client.fetch(("127.0.0.1", 1), "9/0", retry_s=1.0, until=clock.now) is None
    finally:
        client.close()
    assert sent == [] and client.failures == {"late": 1}


def test_a_request_cut_short_by_its_room_s_time_counts_late_and_leaves_the_peer_alone():
    """The room's time, not the peer's: backing the peer off would fail the next rooms' fetches
    from it at once (`peer_down`), unverified for nothing."""
    import socket
    import time

    client = VectorClient(timeout_ms=30_000)
    with socket.socket() as silent:  # accepts (the kernel's backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        peer = silent.getsockname()
        try:
            assert client.fetch(peer, "9/0", until=time.monotonic() + 0.05) is None
            assert client.failures == {"late": 1}
            assert client.backoff_left(peer) == 0.0
        finally:
            client.close()


def test_a_close_cancels_the_stage_requests_still_queued(monkeypatch):
    """They went to the network after the close, and the interpreter's exit waited for them."""
    from dsv4_idxk_probe.exchange import client as client_module
    from dsv4_idxk_probe.exchange.stages import StageEndpoints

    monkeypatch.setattr(client_module, "STAGE_WORKERS", 1)
    client = VectorClient(timeout_ms=200)
    asked, both_asked, release = [], threading.Barrier(3, timeout=10), threading.Event()

    def fetch(endpoint, key, *, retry_s=0.0, until=None):
        if isinstance(endpoint, StageEndpoints):
            return VectorClient.fetch(client, endpoint, key, retry_s=retry_s)
        asked.append(endpoint[1])
        if endpoint[1] in (1, 2):  # the caller's own stage, and the one worker's
            both_asked.wait()
            release.wait(10)
        return object()

    client.fetch = fetch
    got = []
    stages = StageEndpoints([("127.0.0.1", p) for p in (1, 2, 3, 4)], layout=None)
    room = threading.Thread(target=lambda: got.append(client.fetch(stages, "9/0")))
    room.start()
    both_asked.wait()  # stages 1 and 2 asked; 3 and 4 queued for the one worker
    client.close()
    release.set()
    room.join(10)
    assert got == [None] and sorted(asked) == [1, 2]


def test_a_room_given_up_while_its_fetch_is_queued_costs_the_workers_nothing():
    """Its fetch ran anyway, for a room already admitted, and rooms landing after a burst
    queued behind such fetches past their own deadlines."""
    release, clock, calls = threading.Event(), Clock(), []

    def fetch(key):
        calls.append(key)
        release.wait(30)

    prefetcher = Prefetcher(fetch, workers=1, deadline_s=1.2, clock=clock)
    try:
        prefetcher.start("busy/0")
        prefetcher.start("queued/0")
        clock.now += 2.0
        assert prefetcher.poll("queued/0") == (True, None)
        release.set()
        prefetcher._pool.shutdown(wait=True)
    finally:
        release.set()
        prefetcher.close()
    assert "queued/0" not in calls


def test_an_answer_that_lands_while_it_is_polled_is_handed_out_once_and_forgotten():
    """The entry was forgotten on one look at the fetch and the answer handed out on a second:
    a fetch ending between the two was handed out and kept (handed out again, a slot held)."""
    from concurrent.futures import Future

    class EndsBetweenLooks(Future):
        looks = 0

        def done(self):
            self.looks += 1
            was = super().done()
            if self.looks == 1 and not was:
                self.set_result("digest")  # the worker ends right after this look
            return was

    prefetcher = Prefetcher(lambda key: None)
    prefetcher._pool.shutdown()
    prefetcher._pool = SimpleNamespace(submit=lambda fn, key: EndsBetweenLooks(), shutdown=lambda **k: None)
    prefetcher.start("7/0")
    first = prefetcher.poll("7/0")
    second = prefetcher.poll("7/0")
    assert first in ((False, None), (True, "digest"))
    assert [first, second].count((True, "digest")) == 1 and "7/0" not in prefetcher._futures


def test_a_room_landing_again_is_fetched_afresh():
    """A rebootstrap resends the same room id. Its first transfer's fetch, done and never read
    (the room was retracted before enforce judged it), answered for that transfer: enforce
    judged the second by it and dropped a clean room whose bytes were recomputed."""
    answers = iter(("first transfer's digest", "second transfer's digest"))
    prefetcher = Prefetcher(lambda key: next(answers))
    try:
        prefetcher.start("7/0")
        for _ in range(3000):
            if prefetcher._futures["7/0"][0].done():
                break
            threading.Event().wait(0.01)
        prefetcher.start("7/0")  # a poll's restart keeps what is under way
        prefetcher.start("7/0", fresh=True)  # the room landed again
        for _ in range(3000):
            done, digest = prefetcher.poll("7/0")
            if done:
                break
            threading.Event().wait(0.01)
        assert (done, digest) == (True, "second transfer's digest")
    finally:
        prefetcher.close()
