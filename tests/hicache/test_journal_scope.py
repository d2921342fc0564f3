"""What the page journal keeps of HiCache copies, and which of them decode's diagnosis reads
(SGLang 0.5.23's real `DeepSeekV4PagedHostPool`s through the probe's wrappers)."""

from __future__ import annotations

import gc
import weakref

import torch
from tests.diagnosis.test_decode_diagnosis import Bed, _bad

from dsv4_idxk_probe.diagnosis import PageJournal
from dsv4_idxk_probe.pd import RoomId


def test_decode_diagnosis_names_no_copy_of_a_pool_whose_pages_are_not_index_k_s(hicache, make_pool):
    """HiSparse's C4 KV host pool numbers device pages of its own: its backup of "page 5" never
    touched index-K's page 5, and was named as the last event of the cells zeroed there."""
    bed = Bed()
    try:
        hicache(journal=bed.journal)  # the process's one journal
        hisparse = make_pool("hisparse_c4")
        size = hisparse.slot_page_size
        room = RoomId(1)
        bed.receive(room, [1, 2, 3], [4, 5, 6])  # index-K device pages 4, 5, 6
        assert bed.records(room, 1)[0]["verdict"] == "match"
        hisparse.backup_from_device_all_layer(None, torch.arange(0, 3 * size), torch.arange(4 * size, 7 * size), "kernel")
        assert len(bed.journal) and any(
            e.get("pool") == hisparse.pool_name for e in bed.journal.events_for(5))  # journalled (round trip reads it)
        bed.dec[1][5].zero_()  # not by HiCache
        bed.decode.batch_done([], [(room, 1)])
        cells = _bad(bed.records(room, 2)[1])
        assert cells and all(c["kind"] == "zeroed" for c in cells)
        assert [e.get("pool") for c in cells for e in c.get("events", []) if e["event"].startswith("hicache")] == []
    finally:
        bed.close()


def test_a_hicache_copy_s_journal_event_keeps_one_index_a_page(hicache, make_pool):
    """Each event held the copy's whole token indices (SGLang's tensors, or a pinned copy of
    them on a GPU): 16 KiB for a 4-page copy, 256 times what the event needs, where the
    journal's bound counts events."""
    journal = PageJournal()
    hicache(journal=journal, restore_verify=False, index_checks=False)
    pool = make_pool("fp8_indexer")
    size = pool.slot_page_size
    host, device = torch.arange(8 * size, 12 * size), torch.arange(20 * size, 24 * size)
    held = weakref.ref(host)
    pool.backup_from_device_all_layer(None, host, device, "kernel")
    del host
    gc.collect()
    assert held() is None  # SGLang's index tensor is not kept alive by the journal
    assert journal.nbytes() <= 1024
    (event,) = journal.events_for(21)
    assert (event["event"], event["page"], event["host_row"]) == ("hicache_backup", 21, 9)


def test_page_groups_read_any_container_of_token_indices():
    """A NumPy 2 array has a `device` too, and was taken for a tensor (`.numel()` raised)."""
    import numpy as np

    from dsv4_idxk_probe.diagnosis.journal import PageGroups

    for indices in (np.arange(512, 1024 + 3), list(range(512, 1024 + 3)), torch.arange(512, 1024 + 3)):
        assert PageGroups(indices, 256).resolve().tolist() == [2, 3], type(indices)
