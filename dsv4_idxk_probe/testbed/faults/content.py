"""Ground truth: the bytes every frozen slot of every room must hold.

Prefill's "forward" writes index-K from a seeded generator keyed by (seed,
room, attempt, layer, page), so any process can recompute what a row should
hold. Decode uses that to check its frozen bytes independently of the digest
(the rig's oracle), and the tests use it to know what a fault changed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...digest.layout import RowLayout

_STEP_SALT = 0xDEC0DE


def truth_rows(seed: int, room: int, attempt: int, layer_id: int, pages: Sequence[int], row_bytes: int) -> np.ndarray:
    """uint8 [len(pages), row_bytes]: the row each prompt page (full-prompt index) holds."""
    out = np.empty((len(pages), row_bytes), dtype=np.uint8)
    for i, page in enumerate(pages):
        gen = np.random.default_rng([seed, room, attempt, layer_id, int(page)])
        out[i] = np.frombuffer(gen.bytes(row_bytes), dtype=np.uint8)
    return out


def page_frozen_slots(layout: RowLayout, tokens: int, pages: Sequence[int]) -> np.ndarray:
    """Frozen slots of each page for a sequence of `tokens` tokens starting at page 0."""
    return np.array([layout.frozen_slots(tokens, int(p)) for p in pages], dtype=np.int64)


def write_frozen(buf: torch.Tensor, phys: Sequence[int], truth: np.ndarray, frozen: np.ndarray, layout: RowLayout) -> None:
    """Write the frozen slots of each row (nothing else: the rest keeps what was there)."""
    if not len(phys):
        return
    full = frozen == layout.slots
    for seg in layout.segments:
        span = layout.slots * seg.slot_bytes
        if full.any():
            idx = torch.as_tensor(np.asarray(phys)[full], dtype=torch.long, device=buf.device)
            src = torch.from_numpy(np.ascontiguousarray(truth[full, seg.offset : seg.offset + span]))
            buf[idx, seg.offset : seg.offset + span] = src.to(buf.device)
        for row in np.flatnonzero(~full):
            n = int(frozen[row]) * seg.slot_bytes
            if n:
                src = torch.from_numpy(np.ascontiguousarray(truth[row, seg.offset : seg.offset + n]))
                buf[int(phys[row]), seg.offset : seg.offset + n] = src.to(buf.device)


def frozen_differences(actual: np.ndarray, truth: np.ndarray, frozen: np.ndarray, layout: RowLayout) -> np.ndarray:
    """bool [rows, segments]: which segments of which rows differ in a frozen byte."""
    out = np.zeros((actual.shape[0], len(layout.segments)), dtype=bool)
    slot_ids = np.arange(layout.slots)
    live = slot_ids[None, :] < frozen[:, None]  # [rows, slots]
    for s, seg in enumerate(layout.segments):
        span = slice(seg.offset, seg.offset + layout.slots * seg.slot_bytes)
        a = actual[:, span].reshape(-1, layout.slots, seg.slot_bytes)
        t = truth[:, span].reshape(-1, layout.slots, seg.slot_bytes)
        out[:, s] = ((a != t).any(axis=2) & live).any(axis=1)
    return out


def frozen_byte(layout: RowLayout, segment: str, offset: int, frozen: int) -> bool:
    """True when byte `offset` of `segment` lies in one of the page's `frozen` slots."""
    seg = next(s for s in layout.segments if s.name == segment)
    return offset // seg.slot_bytes < frozen


def step_byte(seed: int, room: int, layer_id: int, slot: int) -> int:
    """The byte a decode step fills its new slot with (its value never matters: it is not frozen)."""
    return (seed * 131 + room * 31 + layer_id * 7 + slot + _STEP_SALT) % 251 + 1
