"""Index-K row layouts, described by data.

A layout says where the segments of one (layer, page) row sit, so the digest
can hash only the slots that are frozen and name the segment that differs.
Layouts come from YAML (``configs/layouts.yaml`` and user files); a malformed
entry is refused with an error that names the file, the layout and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import xxhash

from .. import safeyaml
from ..boundedfile import read_bounded_text

#: Bumped whenever the digest arithmetic in docs/digest.md changes.
DIGEST_VERSION = 2
#: A layouts file holds a few entries; a bigger one is a mistake (or an attack).
MAX_LAYOUTS_BYTES = 1 << 20

WORD_BYTES = 4

MAX_SEGMENT_NAME_CHARS = 256  # offline/validation.MAX_ROOM_CHARS: what `diff` reads


class LayoutError(ValueError):
    """A layout description that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Segment:
    """One run of `slots` equally sized entries inside a row."""

    name: str
    offset: int  # byte offset of slot 0 in the row
    slot_bytes: int

    @property
    def word_offset(self) -> int:
        return self.offset // WORD_BYTES

    @property
    def slot_words(self) -> int:
        return self.slot_bytes // WORD_BYTES


@dataclass(frozen=True)
class RowLayout:
    """Geometry of one index-K row: `slots` slots, stored segment after segment."""

    name: str
    slots: int
    tokens_per_slot: int
    segments: tuple[Segment, ...]
    row_bytes: int
    description: str = ""

    @property
    def page_tokens(self) -> int:
        """Tokens covered by one row (SGLang's page size, 256 for DSV4)."""
        return self.slots * self.tokens_per_slot

    @cached_property
    def segment_names(self) -> tuple[str, ...]:
        """Made once (the collector names them in every batch's digests)."""
        return tuple(s.name for s in self.segments)

    def frozen_slots(self, n_tokens: int, logical_page: int) -> int:
        """Slots of `logical_page` that hold final values for a room of `n_tokens`.

        A slot is written once, when its last token is processed; slots past
        the room's last full group are written later by decode steps.
        """
        remaining = n_tokens - logical_page * self.page_tokens
        return max(0, min(self.slots, remaining // self.tokens_per_slot))

    def describe(self) -> dict[str, Any]:
        """Canonical description, the input of the layout signature."""
        return {
            "slots": self.slots,
            "tokens_per_slot": self.tokens_per_slot,
            "row_bytes": self.row_bytes,
            "segments": [[s.name, s.offset, s.slot_bytes] for s in self.segments],
        }


def layout_signature(layout: RowLayout, layer_ids: Sequence[int]) -> int:
    """64-bit id of everything that must agree for two digests to be comparable.

    Digests with different signatures are "not comparable", never "mismatch".
    """
    blob = json.dumps(
        {"digest_version": DIGEST_VERSION, "layout": layout.describe(), "layer_ids": [int(i) for i in layer_ids]},
        sort_keys=True,
        separators=(",", ":"),
    )
    return xxhash.xxh3_64_intdigest(blob.encode())


# %% parsing


def _require_int(source: str, where: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{source}: {where} must be an integer, got {value!r}")
    if value < minimum:
        raise LayoutError(f"{source}: {where} must be >= {minimum}, got {value}")
    return value


def _require_word_multiple(source: str, where: str, value: int) -> int:
    if value % WORD_BYTES:
        raise LayoutError(
            f"{source}: {where} = {value} is not a multiple of {WORD_BYTES}: "
            "rows are digested as 32-bit words (see docs/digest.md)"
        )
    return value


def _names(keys: set) -> str:
    """Mapping keys for a message, sorted: a YAML key may be any scalar (1, null), not only a str."""
    return "[" + ", ".join(sorted(map(repr, keys))) + "]" if keys else ""


def parse_layout(name: str, spec: Any, source: str = "<layout>") -> RowLayout:
    """Build a `RowLayout` from one YAML mapping, checking every field."""
    where = f"layouts.{name}"
    if not isinstance(spec, Mapping):
        raise LayoutError(f"{source}: {where} must be a mapping, got {type(spec).__name__}")
    known = {"description", "slots", "tokens_per_slot", "segments", "row_bytes"}
    unknown = _names(set(spec) - known)
    if unknown:
        raise LayoutError(f"{source}: {where} has unknown field(s) {unknown}; known: {sorted(known)}")
    for field in ("slots", "tokens_per_slot", "segments"):
        if field not in spec:
            raise LayoutError(f"{source}: {where}.{field} is missing")
    slots = _require_int(source, f"{where}.slots", spec["slots"], minimum=1)
    tokens_per_slot = _require_int(source, f"{where}.tokens_per_slot", spec["tokens_per_slot"], minimum=1)
    raw_segments = spec["segments"]
    if not isinstance(raw_segments, list) or not raw_segments:
        raise LayoutError(f"{source}: {where}.segments must be a non-empty list")

    segments: list[Segment] = []
    cursor = 0
    for i, seg in enumerate(raw_segments):
        seg_where = f"{where}.segments[{i}]"
        if not isinstance(seg, Mapping):
            raise LayoutError(f"{source}: {seg_where} must be a mapping")
        unknown = _names(set(seg) - {"name", "slot_bytes", "offset"})
        if unknown:
            raise LayoutError(f"{source}: {seg_where} has unknown field(s) {unknown}")
        seg_name = seg.get("name")
        if not isinstance(seg_name, str) or not seg_name or len(seg_name) > MAX_SEGMENT_NAME_CHARS:
            # the room log's readers refuse longer names (offline/validation.py): every record of
            # the layout would be a bad line to `diff`
            raise LayoutError(f"{source}: {seg_where}.name must be a non-empty string of at most "
                              f"{MAX_SEGMENT_NAME_CHARS} characters")
        if seg_name in {s.name for s in segments}:
            raise LayoutError(f"{source}: {seg_where}.name {seg_name!r} is used twice")
        slot_bytes = _require_int(source, f"{seg_where}.slot_bytes", seg.get("slot_bytes"), minimum=1)
        _require_word_multiple(source, f"{seg_where}.slot_bytes", slot_bytes)
        offset = _require_int(source, f"{seg_where}.offset", seg.get("offset", cursor))
        _require_word_multiple(source, f"{seg_where}.offset", offset)
        if offset < cursor:
            raise LayoutError(f"{source}: {seg_where}.offset {offset} overlaps the previous segment (ends at {cursor})")
        segments.append(Segment(seg_name, offset, slot_bytes))
        cursor = offset + slots * slot_bytes

    row_bytes = _require_int(source, f"{where}.row_bytes", spec.get("row_bytes", cursor), minimum=1)
    if row_bytes < cursor:
        raise LayoutError(f"{source}: {where}.row_bytes {row_bytes} is smaller than its segments ({cursor} B)")
    _require_word_multiple(source, f"{where}.row_bytes", row_bytes)
    description = spec.get("description", "")
    if not isinstance(description, str):
        raise LayoutError(f"{source}: {where}.description must be a string")
    return RowLayout(name, slots, tokens_per_slot, tuple(segments), row_bytes, description)


def parse_layouts(document: Any, source: str) -> dict[str, RowLayout]:
    """Parse a whole layouts document: ``{layouts: {name: spec, ...}}``."""
    if not isinstance(document, Mapping) or not isinstance(document.get("layouts"), Mapping):
        raise LayoutError(f"{source}: top level must be a mapping with a 'layouts' mapping")
    return {str(name): parse_layout(str(name), spec, source) for name, spec in document["layouts"].items()}


def load_layouts(path: str | Path) -> dict[str, RowLayout]:
    """Read layouts from a YAML file; errors name the file."""
    path = Path(path)
    text = read_bounded_text(path, "layouts file", MAX_LAYOUTS_BYTES, LayoutError)
    return parse_layouts(safeyaml.load(text, str(path), LayoutError), str(path))


def shipped_layouts() -> dict[str, RowLayout]:
    """The layouts in the package's ``configs/layouts.yaml``: a dict of the caller's own, the
    file read and parsed once per process (start-up asked for it from the config check, each
    side and each HiCache pool, and parsed it each time)."""
    return dict(_parsed_shipped_layouts())


@cache
def _parsed_shipped_layouts() -> dict[str, RowLayout]:
    text = resources.files("dsv4_idxk_probe").joinpath("configs", "layouts.yaml").read_text()
    return parse_layouts(safeyaml.load(text, "configs/layouts.yaml", LayoutError), "configs/layouts.yaml")


def get_layout(name: str, extra: Mapping[str, RowLayout] | None = None) -> RowLayout:
    """Look a layout up by name among the shipped and any extra ones."""
    layouts = {**shipped_layouts(), **(extra or {})}
    try:
        return layouts[name]
    except KeyError:
        raise LayoutError(f"unknown layout {name!r}; known: {sorted(layouts)}") from None
