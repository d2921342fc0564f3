"""Inside the rig's servers: the byte oracle.

At every digest the probe takes on decode (the hooks learn of it through
`pd.decode`'s digest observer), check every frozen byte of the room against
`truth` and write the bad (layer, logical page, segment) cells. No digest is
involved, and the pages checked are SGLang's (those decode published at
``_send_kv_metadata``), independently of the probe's own page bookkeeping.

A DeepSeek-V4.1 pair's ratio-1 and ratio-2 index pools are checked at the same
points against the fp4 slots the stand-in model wrote there: their bad cells go
to ``pool_cells`` as [layer, row, segment, pool ratio] (rows in room order, as
the probe's pool localisation), with ``pools`` naming the pools checked, so
``cells`` stays the C4 pool's, as every other module reads it.
"""

from __future__ import annotations

import numpy as np

from ...vocabulary import PAGE_TOKENS
from . import truth
from .output import Out
from .rooms import LowRatioPool, Rooms, Track
from .standin_model import FP4_PAYLOAD, FP4_SCALE


class Oracle:
    def __init__(self, rooms: Rooms, out: Out):
        self.rooms = rooms
        self.out = out

    def point(self, room: int, attempt: int, stage: str, step: int | None) -> None:
        """One oracle point of `room`: the probe takes its `stage` digest now."""
        rooms = self.rooms
        with rooms.lock:
            track = rooms.tracks.get(room)
        if track is None or track.tokens is None:
            self.out.write("oracle", {"room": room, "attempt": attempt, "stage": stage, "step": step, "cells": None,
                                      "note": "room not known to the rig"})
            return
        cells = []
        for k, phys in enumerate(track.pages):
            frozen = rooms.layout.frozen_slots(track.n_tokens, k)
            if frozen <= 0:
                continue
            positions = track.start + k * PAGE_TOKENS + np.arange(frozen) * truth.TOKENS_PER_SLOT + 3
            for li, layer in enumerate(rooms.layer_ids):
                want = truth.slot_bytes(layer, positions, track.tokens[positions])
                row = rooms.buffers[li][phys].numpy()
                payload = row[: frozen * truth.PAYLOAD].reshape(frozen, truth.PAYLOAD)
                scale_at = rooms.layout.slots * truth.PAYLOAD
                scale = row[scale_at : scale_at + frozen * truth.SCALE].reshape(frozen, truth.SCALE)
                if not np.array_equal(payload, want[:, : truth.PAYLOAD]):
                    cells.append([layer, k, "payload"])
                if not np.array_equal(scale, want[:, truth.PAYLOAD :]):
                    cells.append([layer, k, "scale"])
        track.points += 1
        record = {"room": room, "attempt": attempt, "rid": track.rid, "rig_room": track.rig_room,
                  "stage": stage, "step": step, "cells": cells, "index": track.points - 1,
                  "start": track.start, "n_tokens": track.n_tokens, "transfer": track.transfer}
        if rooms.low_pools:
            record["pools"] = [pool.ratio for pool in rooms.low_pools]
            record["pool_cells"] = [cell for pool in rooms.low_pools for cell in low_ratio_cells(pool, track)]
        self.out.write("oracle", record)


def low_ratio_cells(pool: LowRatioPool, track: Track) -> list[list]:
    """[layer, row, segment, ratio] of each row of the room in `pool` whose frozen fp4 slots
    differ from the stand-in's (payload: the first 64 bytes of `truth.slot_bytes`, scale: its
    4 scale bytes; standin_model.store_low_ratio_index_k). Row q of the room is full page
    q // rows_per_page's index page q % rows_per_page."""
    cells = []
    row_tokens = pool.slots * pool.ratio
    scale_at = pool.slots * FP4_PAYLOAD
    for k, phys in enumerate(track.pages):
        for j in range(pool.rows_per_page):
            q = k * pool.rows_per_page + j
            frozen = max(0, min(pool.slots, (track.n_tokens - q * row_tokens) // pool.ratio))
            if frozen <= 0:
                continue
            positions = track.start + q * row_tokens + np.arange(frozen) * pool.ratio + pool.ratio - 1
            for buf, layer in zip(pool.buffers, pool.layer_ids):
                want = truth.slot_bytes(layer, positions, track.tokens[positions])
                row = buf[phys * pool.rows_per_page + j].numpy()
                payload = row[: frozen * FP4_PAYLOAD].reshape(frozen, FP4_PAYLOAD)
                scale = row[scale_at : scale_at + frozen * FP4_SCALE].reshape(frozen, FP4_SCALE)
                if not np.array_equal(payload, want[:, :FP4_PAYLOAD]):
                    cells.append([layer, q, "payload", pool.ratio])
                if not np.array_equal(scale, want[:, truth.PAYLOAD : truth.PAYLOAD + FP4_SCALE]):
                    cells.append([layer, q, "scale", pool.ratio])
    return cells

