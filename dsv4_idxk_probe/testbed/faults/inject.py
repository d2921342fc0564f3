"""Applying one fault to one room: pick the exact bytes, change them, say what changed.

`resolve` turns a fault's `random` fields into a concrete target for a room
(seeded per fault and room, so a rerun hits the same bytes). The `apply_*`
functions change rows in place and return the cells whose *frozen* bytes now
differ from before: those are the only changes the probe may report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ...digest.layout import RowLayout, Segment
from .spec import BYTE_KINDS, RANDOM, Fault
from .plan import RoomPlan


@dataclass
class Target:
    """The concrete bytes one fault hits in one room."""

    fault: Fault
    room: int
    layers: list[int]  # buffer indices
    layer_ids: list[int]  # the same layers as global ids
    page: int  # logical page among the transferred pages
    frozen: int  # frozen slots of that page
    segment: str | None = None
    start: int | None = None  # byte range in the row, [start, end)
    end: int | None = None
    bit: int | None = None
    value: int | None = None
    keep_bytes: int | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "layers": self.layer_ids, "page": self.page, "segment": self.segment,
            "bytes": [self.start, self.end] if self.start is not None else None,
            "bit": self.bit, "value": self.value, "keep_bytes": self.keep_bytes,
        }


@dataclass
class Applied:
    """What happened when a fault met a room: sent to the parent, compared with the diff."""

    fault: int
    name: str
    kind: str
    when: str
    after_step: int
    side: str
    room: int
    applied: bool
    reason: str = ""
    target: dict[str, Any] = field(default_factory=dict)
    # cells whose frozen bytes changed, and the first stage that should see them
    effects: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rng_for(seed: int, fault: Fault, room: int) -> np.random.Generator:
    return np.random.default_rng([seed, 0x1A7EC7, fault.index, room])


def resolve(
    fault: Fault,
    plan: RoomPlan,
    layout: RowLayout,
    layer_ids: Sequence[int],
    rng: np.random.Generator,
    *,
    random_pages: Sequence[int] | None = None,
) -> Target | str:
    """A concrete target, or the reason this room cannot take the fault.

    `random_pages` narrows a random page to those the fault can still affect
    (before_send: the pages of the last write).
    """
    n_pages = plan.sent_pages
    frozen_of = [layout.frozen_slots(plan.sent_tokens, p) for p in range(n_pages)]
    impossible = _impossible(fault, layout, layer_ids)
    if impossible:
        return impossible
    if n_pages <= 0:
        return "the room transfers no page"
    if fault.layer == "all":
        layers = list(range(len(layer_ids)))
    elif fault.layer == RANDOM:
        layers = [int(rng.integers(len(layer_ids)))]
    else:
        layers = [list(layer_ids).index(fault.layer)]
    want_unfrozen = fault.offset == "unfrozen"
    if fault.page == RANDOM:
        pool = list(random_pages) if random_pages is not None else list(range(n_pages))
        pool = [p for p in pool if (frozen_of[p] < layout.slots if want_unfrozen else frozen_of[p] > 0)]
        if not pool:
            return "no transferred page this fault can reach"
        page = int(rng.choice(pool))
    else:
        page = n_pages - 1 if fault.page == "last" else int(fault.page)
        if page >= n_pages:
            return f"room transfers only {n_pages} pages (logical page {page} requested)"
    target = Target(fault, plan.room, layers, [layer_ids[i] for i in layers], page, frozen_of[page])
    if fault.kind in BYTE_KINDS:
        if _resolve_bytes(target, fault, layout, rng) is False:
            return f"page {page} has no unfrozen slot (all {layout.slots} slots are frozen)"
    if fault.kind == "bitflip":
        target.bit = int(rng.integers(8)) if fault.bit == RANDOM else int(fault.bit)
    if fault.kind == "byte_set" and fault.value != RANDOM:
        target.value = int(fault.value)
    if fault.kind == "partial_write":
        target.keep_bytes = _keep_bytes(fault, layout, target.frozen, rng)
    return target


def _impossible(fault: Fault, layout: RowLayout, layer_ids: Sequence[int]) -> str | None:
    """Why `fault` names bytes this model does not have (a layer that is not a C4 layer, a
    segment the layout lacks, bytes past a segment or a row), or None. A driver refuses
    such a spec before anything runs (`spec.check_against`); a process that meets one
    anyway records the fault as not applied with this reason instead of failing."""
    if not layer_ids:
        return "the model has no C4 layer"
    if isinstance(fault.layer, int) and fault.layer not in layer_ids:
        return f"layer {fault.layer} is not a C4 layer of this model (C4 layers {list(layer_ids)})"
    if fault.kind in BYTE_KINDS:
        named = fault.segment if fault.segment not in (None, RANDOM) else None
        segs = [s for s in layout.segments if named is None or s.name == named]
        if not segs:
            return f"{named!r} is not a segment of layout {layout.name!r} ({', '.join(s.name for s in layout.segments)})"
        span = min(layout.slots * s.slot_bytes for s in segs)
        label = f"segment {named!r}" if named else "the shortest segment"
        if isinstance(fault.offset, int) and fault.offset >= span:
            return f"offset {fault.offset} is outside {label} ({span} bytes)"
        if fault.byte_range is not None and fault.byte_range[1] > span:
            return f"range end {fault.byte_range[1]} is outside {label} ({span} bytes)"
    if isinstance(fault.keep_bytes, int) and fault.keep_bytes >= layout.row_bytes:
        return f"keep_bytes {fault.keep_bytes} is not below the row size {layout.row_bytes}"
    return None


def _resolve_bytes(target: Target, fault: Fault, layout: RowLayout, rng: np.random.Generator) -> bool:
    seg = _segment(layout, fault.segment if fault.segment != RANDOM else None, rng)
    target.segment = seg.name
    frozen_bytes = target.frozen * seg.slot_bytes
    span = layout.slots * seg.slot_bytes
    if fault.byte_range is not None:
        lo, hi = fault.byte_range
    elif fault.offset == "unfrozen":
        if frozen_bytes >= span:
            return False
        lo = int(rng.integers(frozen_bytes, span))
        hi = lo + 1
    elif fault.offset == RANDOM:
        lo = int(rng.integers(max(frozen_bytes, 1)))
        hi = lo + 1
    else:
        lo, hi = int(fault.offset), int(fault.offset) + 1
    target.start, target.end = seg.offset + lo, seg.offset + hi
    return True


def _segment(layout: RowLayout, name: str | None, rng: np.random.Generator) -> Segment:
    if name is None:
        return layout.segments[int(rng.integers(len(layout.segments)))]
    return next(s for s in layout.segments if s.name == name)


def _keep_bytes(fault: Fault, layout: RowLayout, frozen: int, rng: np.random.Generator) -> int:
    """An explicit K, or a random K that cuts into the page's frozen bytes (so it shows)."""
    if fault.keep_bytes != RANDOM:
        return int(fault.keep_bytes)
    frozen_end = max(s.offset + frozen * s.slot_bytes for s in layout.segments)
    return int(rng.integers(1, max(frozen_end, 2)))


# %% applying to rows


def apply_in_place(
    buffers: Sequence[torch.Tensor], phys: int, target: Target, rng: np.random.Generator, *, replacement: Any = None
) -> list[np.ndarray]:
    """Change row `phys` of each target layer; return the old rows (host copies).

    `replacement` (one host row per target layer) is what stale_page and
    swap_pages write; zero_page writes zeros; byte kinds edit target bytes.
    """
    kind = target.fault.kind
    old = []
    for j, li in enumerate(target.layers):
        row = buffers[li][phys]
        before = row.cpu().numpy().copy()
        old.append(before)
        if kind == "zero_page":
            row.zero_()
        elif kind in ("stale_page", "swap_pages"):
            row.copy_(torch.from_numpy(np.ascontiguousarray(replacement[j])).to(row.device))
        elif kind == "bitflip":
            edited = before.copy()
            edited[target.start : target.end] ^= np.uint8(1 << target.bit)
            row.copy_(torch.from_numpy(edited).to(row.device))
        elif kind == "byte_set":
            edited = before.copy()
            if target.value is None:  # random: a value that surely differs from the first byte
                target.value = int((int(before[target.start]) + int(rng.integers(1, 256))) % 256)
            edited[target.start : target.end] = target.value
            row.copy_(torch.from_numpy(edited).to(row.device))
        else:
            raise ValueError(f"{kind} is not applied to rows in place")
    return old


def changed_segments(layout: RowLayout, old: np.ndarray, new: np.ndarray, frozen: int) -> list[str]:
    """Segments of one row whose frozen bytes differ between two versions of it."""
    out = []
    for seg in layout.segments:
        n = frozen * seg.slot_bytes
        if n and not np.array_equal(old[seg.offset : seg.offset + n], new[seg.offset : seg.offset + n]):
            out.append(seg.name)
    return out


def partial_write_segments(layout: RowLayout, keep_bytes: int, frozen: int) -> list[str]:
    """Segments with frozen bytes at or past `keep_bytes`: those a partial write leaves stale."""
    return [s.name for s in layout.segments if frozen and s.offset + frozen * s.slot_bytes > keep_bytes]


def frozen_segments(layout: RowLayout, frozen: int) -> list[str]:
    return [s.name for s in layout.segments] if frozen else []
