"""Restore verification's plain parts: the bounded store of backup digests, and the
comparison of a load's digests with them (docs/hicache.md, "Restore verification")."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from dsv4_idxk_probe.hicache.restore_compare import compare_load
from dsv4_idxk_probe.hicache.restore_store import ENTRY_OVERHEAD_BYTES, HostPageDigests, entry_bytes
from dsv4_idxk_probe.hicache.settings import HiCacheConfigError, parse_settings

SEGMENTS = ("payload", "scale")


def contents(layers: int, rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, (layers, rows, len(SEGMENTS)), dtype=np.uint64)


def test_the_store_keeps_each_host_rows_digests_and_evicts_the_oldest_with_a_count():
    evicted = []
    store = HostPageDigests(3, evicted.append)
    first = contents(2, 2, seed=1)
    store.put(7, [10, 11], first)
    store.put(7, [12], contents(2, 1, seed=2))
    assert np.array_equal(store.get(7, [11])[0], first[:, 1, :]) and len(store) == 3
    store.put(7, [13, 14], contents(2, 2, seed=3))  # two past the bound: rows 10 and 11 go
    assert evicted == [2] and store.evicted == 2 and len(store) == 3
    assert store.get(7, [10, 11, 12]) [:2] == [None, None] and store.get(7, [12])[0] is not None
    assert store.lost(7, 10) and store.lost(7, 11) and not store.lost(7, 12)


def test_a_stored_pages_digests_count_once_compared_or_once_gone():
    """`put(stored=True)`: an L3 page's digests. A load's `take_stored` counts them once; an
    eviction, a drop, a backup over the row or a forgetting reports them lost, once."""
    lost = []
    store = HostPageDigests(3, on_stored_lost=lambda pool, n: lost.append((pool, n)))
    store.put(7, [1, 2], contents(2, 2), stored=True)
    assert store.take_stored(7, [1, 3]) == 1 and store.take_stored(7, [1]) == 0  # row 1 compared, once
    store.put(7, [2], contents(2, 1, seed=1))  # a backup over row 2 before any load compared it
    assert lost == [(7, 1)] and store.take_stored(7, [2]) == 0
    store.put(7, [4, 5], contents(2, 2, seed=2), stored=True)
    store.put(7, [6, 8], contents(2, 2, seed=3))  # past the bound the oldest go: 1, then 2 and 4 (stored)
    assert lost == [(7, 1), (7, 1)]
    store.drop(7, [5])
    store.put(8, [0], contents(2, 1), stored=True)
    store.forget_all(8, fence=True)
    assert lost == [(7, 1), (7, 1), (7, 1), (8, 1)]
    assert store.put(8, [0], contents(2, 1), generation=0, stored=True) is False  # refused: nothing pending
    store.forget_all(8)
    assert lost[-1] == (8, 1) and len(lost) == 4
    keeps_one = HostPageDigests(1, on_stored_lost=lambda pool, n: lost.append((pool, n)))
    keeps_one.put(9, [0, 1], contents(2, 2), stored=True)  # one kept: the other lost at once
    assert lost[-1] == (9, 1) and keeps_one.take_stored(9, [0, 1]) == 1


def test_storing_a_row_again_makes_it_the_newest_and_clears_its_loss():
    store = HostPageDigests(2)
    store.put(1, [0], contents(1, 1, 1))
    store.put(1, [1], contents(1, 1, 2))
    store.drop(1, [0])
    assert store.lost(1, 0)
    store.put(1, [0], contents(1, 1, 3))  # backed up again
    assert not store.lost(1, 0)
    store.put(1, [2], contents(1, 1, 4))  # row 1 is now the oldest
    assert store.get(1, [1]) == [None] and store.get(1, [0])[0] is not None


def test_pools_are_kept_apart_and_a_gone_pool_takes_its_rows_with_it():
    store = HostPageDigests(10)
    store.put(1, [5], contents(1, 1, 1))
    store.put(2, [5], contents(1, 1, 2))
    assert not np.array_equal(store.get(1, [5])[0], store.get(2, [5])[0])
    store.forget_pool(1)
    assert store.get(1, [5]) == [None] and store.get(2, [5])[0] is not None and not store.lost(1, 5)


def test_forgetting_a_pools_digests_marks_its_rows_lost_and_leaves_other_pools():
    store = HostPageDigests(10)
    store.put(1, [5, 6], contents(1, 2, 1))
    store.put(2, [5], contents(1, 1, 2))
    store.forget_all(1)
    assert store.get(1, [5, 6]) == [None, None] and store.lost(1, 5) and store.lost(1, 6)
    assert store.get(2, [5])[0] is not None and not store.lost(2, 5) and len(store) == 1
    assert store.drop(1, [5]) == 0  # nothing of a forgotten row is kept


class _NoWalk(OrderedDict):
    """A table that refuses to be walked: what a caller that must not walk it may not do."""

    def _refuse(self, *_a):
        raise AssertionError("the table was walked")

    __iter__ = keys = items = values = _refuse


def test_forgetting_a_pool_does_not_walk_the_table_and_the_next_store_sweeps_it():
    """SGLang's copying thread forgets a pool's digests (a token-granular backup): that must
    not cost a walk of the whole table there (~20 ms at the default bound). The forgotten
    rows read as lost at once; the collector's next store moves them to the lost table,
    and they are not counted as evictions."""
    evicted = []
    store = HostPageDigests(4, evicted.append)
    store.put(1, [0, 1, 2], contents(1, 3, 1))
    store.put(2, [0], contents(1, 1, 2))
    kept = store._table
    store._table = _NoWalk(kept)
    try:
        store.forget_all(1, fence=True)
        assert store.get(1, [0, 1, 2]) == [None] * 3 and all(store.lost(1, r) for r in range(3))
        assert store.get(2, [0])[0] is not None
    finally:
        store._table = kept  # (forgetting changed no entry)
    store.put(1, [3], contents(1, 1, 3), store.generations.get(1, 0))  # the collector's next store sweeps
    assert list(store._table) == [(2, 0), (1, 3)] and all(store.lost(1, r) for r in range(3))
    store.put(2, [1, 2, 3], contents(1, 3, 4))  # past the bound: the oldest, (2, 0), goes and counts
    assert evicted == [1] and len(store) == 4


def test_a_sweep_goes_a_chunk_a_store_and_a_pool_forgotten_meanwhile_is_swept_again(monkeypatch):
    from dsv4_idxk_probe.hicache import restore_store

    monkeypatch.setattr(restore_store, "SWEEP_CHUNK", 2)
    store = HostPageDigests(100)
    store.put(1, [0, 1, 2, 3], contents(1, 4, 1))
    store.put(2, [0], contents(1, 1, 2))
    store.forget_all(1)
    store.put(2, [1], contents(1, 1, 3))  # looks at (1, 0) and (1, 1)
    assert list(store._table)[:3] == [(1, 2), (1, 3), (2, 0)]
    assert store.get(1, [2, 3]) == [None, None] and store.lost(1, 0) and store.lost(1, 3)
    store.put(1, [9], contents(1, 1, 4))
    store.forget_all(1)  # during the sweep: (1, 9) is forgotten too
    for row in range(2, 6):
        store.put(2, [row], contents(1, 1, row))
    assert [key for key in store._table if key[0] == 1] == [] and len(store) == 6
    assert all(store.lost(1, r) for r in (0, 1, 2, 3, 9))


def test_a_fenced_forget_refuses_digests_submitted_before_it_and_only_those():
    """Forgotten out of the collector's order (the copying thread), a pool's digests stay
    forgotten: a digest submitted before the fence and stored after it describes bytes the
    rows no longer hold, and is refused (its rows lost); one submitted after is kept. A
    forget in the collector's own order needs no fence and raises none."""
    store = HostPageDigests(10)
    before = store.generations.get(1, 0)
    store.forget_all(1)  # the collector's order: no fence
    assert store.generations.get(1, 0) == before
    store.forget_all(1, fence=True)
    assert store.put(1, [5], contents(1, 1, 1), before) is False
    assert store.get(1, [5]) == [None] and store.lost(1, 5)
    assert store.put(1, [5], contents(1, 1, 2), store.generations.get(1, 0)) is True
    assert store.get(1, [5])[0] is not None
    assert store.put(2, [5], contents(1, 1, 3), before) is True  # other pools: their own count


def test_a_store_that_would_keep_nothing_is_refused():
    # it would take every backup's digest, keep none, and count the backup verified
    with pytest.raises(ValueError, match="max_pages must be >= 1, got 0"):
        HostPageDigests(0)


def test_a_one_page_bound_keeps_the_newest_and_counts_the_rest():
    evicted = []
    store = HostPageDigests(1, evicted.append)
    store.put(1, [0, 1], contents(1, 2))
    assert len(store) == 1 and evicted == [1] and store.lost(1, 0) and store.get(1, [1])[0] is not None


def test_the_stated_memory_per_host_page():
    assert entry_bytes(30, 2) == 30 * 2 * 8 + ENTRY_OVERHEAD_BYTES


def test_a_load_matching_its_backup_is_a_match():
    kept = contents(2, 3, seed=5)
    result = compare_load([kept[:, j, :] for j in range(3)], kept.copy(), [4, 5, 6], [40, 50, 60], SEGMENTS)
    assert (result.verdict, result.verified_rows, result.cells) == ("match", 3, [])


def test_a_changed_cell_is_localised_to_layer_host_row_device_page_and_segment():
    kept = contents(3, 2, seed=6)
    loaded = kept.copy()
    loaded[2, 1, 1] ^= np.uint64(1)  # layer 2, the second host row, the scale segment
    result = compare_load([kept[:, j, :] for j in range(2)], loaded, [8, 9], [80, 90], SEGMENTS)
    assert result.verdict == "mismatch" and result.mismatch_rows == [9]
    ((layer, row, page, segment),) = [(c.pool_layer, c.host_row, c.device_page, c.segment) for c in result.cells]
    assert (layer, row, page, segment) == (2, 9, 90, "scale")


def test_a_row_without_a_kept_digest_is_unverified_never_a_match():
    kept = contents(1, 2, seed=7)
    result = compare_load([kept[:, 0, :], None], kept, [1, 2], [3, 4], SEGMENTS)
    assert result.verdict == "unverified" and result.unverified_rows == [2] and result.verified_rows == 1
    # a kept digest of another shape (layout changed since the backup) is not compared either
    result = compare_load([kept[:1, 0, :1], kept[:, 1, :]], kept, [1, 2], [3, 4], SEGMENTS)
    assert result.unverified_rows == [1] and result.verdict == "unverified"


def test_compare_refuses_digests_that_do_not_fit_the_load():
    with pytest.raises(ValueError, match="2 host rows"):
        compare_load([None], contents(1, 2), [1, 2], [3, 4], SEGMENTS)


@pytest.mark.parametrize("section,message", [
    ({"restore_verify": "yes"}, "hicache.restore_verify must be true or false"),
    ({"restore_max_pages": -1}, "hicache.restore_max_pages must be an integer >= 1"),
    ({"restore_max_pages": 0}, "hicache.restore_max_pages must be an integer >= 1"),
    ({"restore_max_pages": 10**9}, "hicache.restore_max_pages must be an integer <= 100_000_000"),
    ({"restore_queue_max": 0}, "hicache.restore_queue_max must be an integer >= 1"),
    ({"restore_queue_max": 10**7}, "hicache.restore_queue_max must be an integer <= 1_000_000"),
])
def test_restore_settings_are_bounded_and_errors_name_the_field(section, message):
    with pytest.raises(HiCacheConfigError, match=message):
        parse_settings(section)


def test_restore_verification_is_on_by_default():
    settings = parse_settings({})
    assert settings.restore_verify is True and settings.roundtrip is False
    assert parse_settings({"restore_max_pages": 1, "restore_queue_max": 1_000_000}).restore_max_pages == 1
