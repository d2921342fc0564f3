"""Inside the rig's servers: the byte oracle.

At every digest the probe takes on decode (the hooks learn of it through
`pd.decode`'s digest observer), check every frozen byte of the room against
`truth` and write the bad (layer, logical page, segment) cells. No digest is
involved, and the pages checked are SGLang's (those decode published at
``_send_kv_metadata``), independently of the probe's own page bookkeeping.
"""

from __future__ import annotations

import numpy as np

from ...vocabulary import PAGE_TOKENS
from . import truth
from .output import Out
from .rooms import Rooms


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
        self.out.write("oracle", {"room": room, "attempt": attempt, "rid": track.rid, "rig_room": track.rig_room,
                                  "stage": stage, "step": step, "cells": cells, "index": track.points - 1,
                                  "start": track.start, "n_tokens": track.n_tokens, "transfer": track.transfer})

