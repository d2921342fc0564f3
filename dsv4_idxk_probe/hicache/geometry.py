"""What one host pool looks like, and what must hold for its copies to be right.

The adapter fills a `PoolGeometry` from the pool object at construction; this
module never looks at the pool itself. Two questions are answered here:

* construction invariants: the copy kernels step through device rows by
  ``item_bytes`` and move 8-byte words, so a row size that disagrees with the
  device buffer, a non-contiguous buffer or an odd size copies the wrong bytes
  without any error;
* the token-path geometry guard: the token-granular kernel hard-codes one row
  geometry (`TokenRow`); on any pool whose rows differ it writes wrong rows.
"""

from __future__ import annotations

from dataclasses import dataclass

INVARIANTS = ("device_not_contiguous", "row_bytes_mismatch", "item_bytes_not_multiple_of_8", "layer_buffers_differ")


@dataclass(frozen=True)
class TokenRow:
    """The page geometry a token-granular copy kernel assumes."""

    slots: int  # token slots per page (the kernel splits an index into page and slot)
    value_bytes: int
    scale_bytes: int
    page_bytes: int  # page stride, padding included

    @property
    def scale_offset(self) -> int:
        return self.slots * self.value_bytes


@dataclass(frozen=True)
class DeviceBuffer:
    """Shape facts of one per-layer device buffer."""

    shape: tuple[int, ...]
    dtype: str
    contiguous: bool
    row_bytes: int  # bytes of one first-dimension row


@dataclass(frozen=True)
class PoolGeometry:
    """Plain facts about one host pool, as read by the adapter."""

    name: str
    layers: int
    item_bytes: int  # bytes of one host row (one page of one layer)
    page_size: int  # index slots per host row
    host_pages: int
    layout: str
    page_aligned_only: bool
    buffers: tuple[DeviceBuffer, ...]
    page_routes: frozenset  # (io_backend, layout) pairs the page path implements
    token_row: TokenRow | None  # geometry of the token path's kernel; None: no token path

    @property
    def device_rows(self) -> int:
        return self.buffers[0].shape[0] if self.buffers and self.buffers[0].shape else 0

    @property
    def token_path_eligible(self) -> bool:
        return not self.page_aligned_only and self.token_row is not None

    def page_branch(self, io_backend: str) -> str:
        """``page`` when (io_backend, layout) has a page copy, else ``unsupported``."""
        routes = self.page_routes
        if (io_backend, self.layout) in routes or (io_backend, "*") in routes:
            return "page"
        return "unsupported"


def token_row_mismatches(geom: PoolGeometry) -> list[str]:
    """Why this pool's rows are not the token kernel's row; empty when they are."""
    row = geom.token_row
    if row is None:
        return ["no token kernel"]
    reasons = []
    if geom.item_bytes != row.page_bytes:
        reasons.append(f"item_bytes {geom.item_bytes} != {row.page_bytes}")
    if geom.page_size != row.slots:
        reasons.append(f"page_size {geom.page_size} != {row.slots} slots")
    odd = sorted({b.row_bytes for b in geom.buffers if b.row_bytes != row.page_bytes})
    if odd:
        reasons.append(f"device row bytes {odd} != {row.page_bytes}")
    return reasons


def invariant_failures(geom: PoolGeometry) -> dict[str, str]:
    """Failed construction invariants, name -> detail."""
    failed: dict[str, str] = {}
    bad = [i for i, b in enumerate(geom.buffers) if not b.contiguous]
    if bad:
        failed["device_not_contiguous"] = f"device buffers of layers {bad} are not contiguous"
    sizes = sorted({b.row_bytes for b in geom.buffers if b.row_bytes != geom.item_bytes})
    if sizes:
        failed["row_bytes_mismatch"] = f"device row bytes {sizes} != item_bytes {geom.item_bytes}"
    if geom.item_bytes % 8:
        failed["item_bytes_not_multiple_of_8"] = f"item_bytes {geom.item_bytes} is not a multiple of 8"
    if len({(b.shape, b.dtype) for b in geom.buffers}) > 1:
        failed["layer_buffers_differ"] = "device buffers differ in shape or dtype across layers"
    return failed


def describe(geom: PoolGeometry) -> dict:
    """The one-line-per-pool description logged and emitted at construction."""
    first = geom.buffers[0] if geom.buffers else None
    return {
        "pool": geom.name,
        "layers": geom.layers,
        "item_bytes": geom.item_bytes,
        "page_size": geom.page_size,
        "host_pages": geom.host_pages,
        "layout": geom.layout,
        "page_aligned_only": geom.page_aligned_only,
        "device_shape": list(first.shape) if first else None,
        "device_dtype": first.dtype if first else None,
        "token_path_eligible": geom.token_path_eligible,
        "token_row_matches": geom.token_row is not None and not token_row_mismatches(geom),
    }
