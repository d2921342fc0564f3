"""Realistic room logs for the observability tests.

Digests come from the real NumPy reference over random index-K rows, and
records from the real `pd.records.room_record`, so the diff and report are
tested on what the serving side writes. A fault flips one byte of one
(layer, logical page) row from a given decode stage on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv4_idxk_probe.digest.layout import get_layout
from dsv4_idxk_probe.digest.reference import digest_room
from dsv4_idxk_probe.pd.records import room_record
from dsv4_idxk_probe.roomlog import RoomLogWriter

LAYOUT = get_layout("fp8")
LAYER_IDS = (0, 1, 2, 3)
N_TOKENS = 600  # 3 pages of 256 tokens, the last one partial


@dataclass
class Fault:
    """Corrupt (layer index, logical page, byte offset) from decode stage `from_stage` on."""

    layer_index: int
    page: int
    byte: int = 0
    from_stage: str = "decode_recv"


@dataclass
class RoomPlan:
    room: int
    attempt: int = 0
    steps: tuple[int, ...] = (40,)
    fault: Fault | None = None
    prefill: bool = True
    decode: bool = True
    signature_drift: bool = False  # decode uses other layer ids: not comparable
    rows: list = field(default_factory=list)


def _buffers(rng: np.random.Generator, n_pages: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, size=(n_pages, LAYOUT.row_bytes), dtype=np.uint8) for _ in LAYER_IDS]


def room_records(plan: RoomPlan, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(prefill records, decode records) for one room, as the monitors would emit them."""
    rng = np.random.default_rng(seed + plan.room)
    n_pages = -(-N_TOKENS // LAYOUT.page_tokens)
    buffers = _buffers(rng, n_pages)
    pages = list(range(n_pages))
    key = f"{plan.room}/{plan.attempt}"
    expected = digest_room(buffers, pages, N_TOKENS, LAYOUT, LAYER_IDS, key=key)
    prefill = []
    if plan.prefill:
        prefill.append(
            room_record(role="prefill", stage="prefill_send", room=plan.room, attempt=plan.attempt,
                        digest=expected, layout=LAYOUT.name)
        )
    decode = []
    if not plan.decode:
        return prefill, decode
    stages = [("decode_recv", None)] + [("decode_step", s) for s in plan.steps] + [("decode_finish", None)]
    corrupt = False
    order = ["decode_recv", "decode_step", "decode_finish"]
    for stage, step in stages:
        if plan.fault is not None and order.index(stage) >= order.index(plan.fault.from_stage):
            if not corrupt:
                buffers[plan.fault.layer_index][plan.fault.page, plan.fault.byte] ^= 0x10
                corrupt = True
        layer_ids = tuple(i + 10 for i in LAYER_IDS) if plan.signature_drift else LAYER_IDS
        observed = digest_room(buffers, pages, N_TOKENS, LAYOUT, layer_ids, key=key)
        decode.append(
            room_record(role="decode", stage=stage, room=plan.room, attempt=plan.attempt, digest=observed,
                        layout=LAYOUT.name, step=step, verdict="match")
        )
    return prefill, decode


def hicache_record(pool: str, branch: str, direction: str = "d2h", count: int = 1) -> dict:
    return {"v": 1, "kind": "hicache", "ts": 0.0, "role": "decode", "pool": pool, "direction": direction,
            "branch": branch, "count": count}


def write_logs(root: Path, plans: list[RoomPlan], *, extra_decode: list[dict] = (), max_bytes: int = 64 << 20,
               gzip_rotated: bool = True) -> tuple[Path, Path]:
    """Prefill and decode room logs for `plans`, written by the real writer, as two directories."""
    prefill = RoomLogWriter(root / "prefill", "prefill", max_bytes=max_bytes, max_files=1000, gzip_rotated=gzip_rotated)
    decode = RoomLogWriter(root / "decode", "decode", max_bytes=max_bytes, max_files=1000, gzip_rotated=gzip_rotated)
    for plan in plans:
        pre, dec = room_records(plan)
        for r in pre:
            assert prefill.emit(r)
        for r in dec:
            assert decode.emit(r)
    for r in extra_decode:
        assert decode.emit(r)
    prefill.close()
    decode.close()
    assert prefill.dropped == decode.dropped == 0
    return root / "prefill", root / "decode"


def roundtrip_record(host_row: int = 5, device_page: int = 6, layer: int = 1, leg_checks=None) -> dict:
    """A `roundtrip_diagnosis` record as prefill's HiCache probe emits it (hicache.culprit.record):
    host row 5 changed while resident, loaded into device page 6."""
    from dsv4_idxk_probe.hicache.culprit import record

    checks = leg_checks or {"d2h": "match", "host": "mismatch", "h2d": "match"}
    events = [
        {"t_ns": 1, "event": "hicache_backup", "page": device_page, "host_row": host_row, "pool": "deepseek_v4_c4_indexer"},
        {"t_ns": 2, "event": "hicache_load", "page": device_page, "host_row": host_row, "layer": 0,
         "pool": "deepseek_v4_c4_indexer", "host_row_checks": dict(checks, layers=[layer])},
    ]
    rec = record("deepseek_v4_c4_indexer", host_row, device_page, layer, checks, events)
    return {"v": 1, "kind": "hicache", "ts": 0.0, "role": "prefill", **rec}
