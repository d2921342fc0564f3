"""The collector's deferral (`digest.collector_defer_ms`, `collector_defer_at`): a batch
waits `defer_s` before its device calls ("first_call") or, once done, before its fold and
callbacks ("done"); batches that queue up meanwhile go through without sleeping while the
serving thread stays quiet."""

import threading

import pytest

from dsv4_idxk_probe.digest import DigestEngine, RoomRequest, get_layout
from dsv4_idxk_probe.digest import collector

LAYOUT = get_layout("fp8")
DEFER_S = 0.0123  # a value no other sleep of the collector uses


@pytest.fixture
def deferrals(monkeypatch):
    """The collector's sleeps of `DEFER_S`, counted (and not slept: the test needs none)."""
    slept = []
    real_sleep = collector.time.sleep

    def sleep(seconds):
        if seconds == DEFER_S:
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(collector.time, "sleep", sleep)
    return slept


def _room(i: int) -> list[RoomRequest]:
    return [RoomRequest(f"r{i}", [0, 1], 512)]


@pytest.mark.parametrize("defer_at", ["first_call", "done"])
def test_a_lone_batch_is_deferred_once(random_buffers, deferrals, defer_at):
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=1), backend="reference", defer_s=DEFER_S,
                          defer_at=defer_at)
    done, got = threading.Event(), []
    engine.submit(_room(0), lambda result: (got.append(result), done.set()))
    assert done.wait(10)  # delivered before `close` queues its end (which would be a batch waiting)
    engine.close()
    assert len(got) == 1 and got[0].error is None
    assert deferrals == [DEFER_S]


@pytest.mark.parametrize("defer_at", ["first_call", "done"])
def test_batches_queued_behind_one_are_not_deferred(random_buffers, deferrals, defer_at):
    """The first batch's callback holds the collector until ten more are queued: of the
    eleven, at most two sleep ("done": the first, nothing behind it when it was done, and
    the last; "first_call": the first, and the next, the first submitted after the quiet
    period the first slept out)."""
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=2), backend="reference", defer_s=DEFER_S,
                          defer_at=defer_at)
    release, got = threading.Event(), []

    def first(result):
        release.wait(10)
        got.append(result)

    engine.submit(_room(0), first)
    for i in range(1, 11):
        engine.submit(_room(i), got.append)
    release.set()
    engine.close()
    assert len(got) == 11 and all(r.error is None for r in got)
    assert len(deferrals) <= 2, deferrals


def test_no_deferral_at_zero_and_the_config_reaches_the_engine(random_buffers, deferrals):
    from dsv4_idxk_probe.config import parse_config

    buffers = random_buffers(LAYOUT, 1, 2, seed=3)
    assert DigestEngine.from_config(LAYOUT, [0], buffers, parse_config({}), role="decode").defer_s == 0.003
    late = parse_config({"digest": {"collector_defer_at": "done"}})
    assert DigestEngine.from_config(LAYOUT, [0], buffers, late, role="decode").defer_at == "done"
    config = parse_config({"digest": {"collector_defer_ms": 0}})
    engine = DigestEngine.from_config(LAYOUT, [0], buffers, config, role="decode")
    assert engine.defer_s == 0
    got = []
    engine.submit(_room(0), got.append)
    engine.close()
    assert len(got) == 1 and deferrals == []
    with pytest.raises(ValueError, match="defer_s"):
        DigestEngine(LAYOUT, [0], buffers, backend="reference", defer_s=5.0)


@pytest.mark.parametrize("defer_at", ["first_call", "done"])
@pytest.mark.parametrize("busy_sleeps, expected", [(2, 3), (99, collector.DEFER_ROUNDS)])
def test_submits_during_the_sleep_extend_it_up_to_the_cap(random_buffers, monkeypatch, busy_sleeps, expected,
                                                         defer_at):
    """While the serving thread keeps submitting (here: during the first `busy_sleeps`
    sleeps), the collector sleeps again; once a sleep passes quietly it delivers, and it
    never sleeps more than DEFER_ROUNDS times for one batch."""
    engine = DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=4), backend="reference", defer_s=DEFER_S,
                          defer_rounds=collector.DEFER_ROUNDS, defer_at=defer_at)
    slept = []
    real_sleep = collector.time.sleep

    def sleep(seconds):
        if seconds != DEFER_S:
            return real_sleep(seconds)
        slept.append(seconds)
        if len(slept) <= busy_sleeps:
            engine.stats.submitted_rooms += 1  # what a submit on the serving thread meanwhile leaves

    monkeypatch.setattr(collector.time, "sleep", sleep)
    done, got = threading.Event(), []
    engine.submit(_room(0), lambda result: (got.append(result), done.set()))
    assert done.wait(10)
    engine.close()
    assert len(got) == 1 and got[0].error is None
    assert len(slept) == expected


def test_restore_engines_take_the_hicache_deferral():
    """`hicache.restore_defer_ms` reaches each pool's restore engine (3 ms by default)."""
    from types import SimpleNamespace

    from dsv4_idxk_probe.hicache.restore import RestoreVerifier
    from dsv4_idxk_probe.hicache.settings import parse_settings

    assert parse_settings({}).restore_defer_ms == 3.0
    settings = parse_settings({"restore_defer_ms": 7.5})
    made = []

    def factory(layout, layer_ids, buffers, queue_max, **options):
        made.append(SimpleNamespace(backend="triton", **options))
        return made[-1]

    verifier = RestoreVerifier(4, 4, lambda *a: None, lambda *a: None, lambda *a: None, engine_factory=factory,
                               defer_s=settings.restore_defer_ms / 1000)
    geom = SimpleNamespace(name="deepseek_v4_c4_indexer", layers=2, item_bytes=8448, page_size=256)
    views = SimpleNamespace(device_layer=lambda layer: None)
    assert verifier.pool(SimpleNamespace(key=1, geom=geom, views=views, invariants_failed=False)) is not None
    assert made[0].defer_s == 0.0075 and made[0].defer_rounds == collector.DEFER_ROUNDS
    assert made[0].page_id_stride == 256  # the engine reads the copy's token indices, a page size apart
    assert made[0].record == "collector" and made[0].defer_at == "first_call"
    with pytest.raises(Exception, match="restore_defer_ms"):
        parse_settings({"restore_defer_ms": 5000})


def test_hicache_restore_record_reaches_each_pools_engine():
    """`hicache.restore_record` from the probe config to each pool's restore engine: "copy"
    has the copying thread record the event (the engine's "submit"); a bad value names the key."""
    from types import SimpleNamespace

    from dsv4_idxk_probe.hicache.probe import HiCacheProbe
    from dsv4_idxk_probe.hicache.settings import parse_settings

    assert parse_settings({}).restore_record == "collector"
    probe = HiCacheProbe(SimpleNamespace(), parse_settings({"restore_record": "copy", "index_checks": False}))
    made = []

    def factory(layout, layer_ids, buffers, queue_max, **options):
        made.append(SimpleNamespace(backend="triton", **options))
        return made[-1]

    probe.restore._engine_factory = factory
    geom = SimpleNamespace(name="deepseek_v4_c4_indexer", layers=2, item_bytes=8448, page_size=256)
    views = SimpleNamespace(device_layer=lambda layer: None)
    assert probe.restore.pool(SimpleNamespace(key=1, geom=geom, views=views, invariants_failed=False)) is not None
    assert made[0].record == "submit"
    with pytest.raises(Exception, match="hicache.restore_record"):
        parse_settings({"restore_record": "forward"})


def test_the_pd_engines_sleep_one_round_while_submits_keep_coming(random_buffers, monkeypatch):
    """From the config (the PD sides) one sleep only: prefill publishes a room's vectors from
    its collector, and a decode receipt judged before they are out is not localised."""
    from dsv4_idxk_probe.config import parse_config

    engine = DigestEngine.from_config(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=5), parse_config({}),
                                      role="prefill")
    slept = []
    real_sleep = collector.time.sleep

    def sleep(seconds):
        if seconds != engine.defer_s:
            return real_sleep(seconds)
        slept.append(seconds)
        engine.stats.submitted_rooms += 1  # the serving thread never stops submitting

    monkeypatch.setattr(collector.time, "sleep", sleep)
    done = threading.Event()
    engine.submit(_room(0), lambda result: done.set())
    assert done.wait(10)
    engine.close()
    assert slept == [engine.defer_s]
    with pytest.raises(ValueError, match="defer_rounds"):
        DigestEngine(LAYOUT, [0], random_buffers(LAYOUT, 1, 2, seed=6), backend="reference", defer_rounds=0)
