"""Which copy branch a host-pool call takes, from sizes and flags alone.

This mirrors the order of checks in the pool's copy methods, so counting the
branch needs no look at index values (no host-device sync): missing or empty
indices, a host/device size mismatch (the pool raises), a count that is not a
multiple of the page size (token-granular: refused when the pool is
page-aligned-only, else the token kernel), and otherwise the page path, which
exists only for some (io_backend, layout) pairs.
"""

from __future__ import annotations

from typing import Iterable

from ..vocabulary import HICACHE_BRANCHES, HICACHE_DIRECTIONS
from .geometry import PoolGeometry

DIRECTIONS = HICACHE_DIRECTIONS
BRANCHES = HICACHE_BRANCHES
#: io_backend label of the token-only backup call, which takes no io backend.
NO_IO_BACKEND = "none"
#: Branches that move bytes (the others return or raise).
MOVING = frozenset({"page", "token_dsv4_mla"})


def token_branch(geom: PoolGeometry) -> str:
    return "token_rejected" if geom.page_aligned_only else "token_dsv4_mla"


def classify(
    geom: PoolGeometry,
    host_numel: int | None,
    device_numel: int | None,
    io_backend: str | None,
    page_branches: dict[str, str] | None = None,
) -> str:
    """Branch of a backup or per-layer load; ``io_backend=None`` for the token-only call.

    `page_branches` caches `geom.page_branch` per io backend (the copy path's fast lane)."""
    if host_numel is None or device_numel is None:
        return "empty"
    if host_numel != device_numel:
        return "size_mismatch"
    if host_numel == 0:
        return "empty"
    if io_backend is None or host_numel % geom.page_size or device_numel % geom.page_size:
        return token_branch(geom)
    cached = page_branches.get(io_backend) if page_branches else None
    return cached or geom.page_branch(io_backend)


def label_sets(geom: PoolGeometry, io_backends: Iterable[str]) -> list[tuple[str, str, str]]:
    """Every (direction, io_backend, branch) this pool can produce."""
    out = []
    fixed = ("empty", "size_mismatch", token_branch(geom))
    for direction in DIRECTIONS:
        for io_backend in io_backends:
            for branch in (*fixed, geom.page_branch(io_backend)):
                out.append((direction, io_backend, branch))
    out.extend(("d2h", NO_IO_BACKEND, branch) for branch in fixed)
    return out


def moved(geom: PoolGeometry, branch: str, numel: int, layers: int) -> tuple[int, int]:
    """(page rows, token rows) moved: both per layer, so a backup of n pages over
    L layers and the L per-layer loads of the same pages add the same amounts."""
    if branch == "page":
        return numel // geom.page_size * layers, numel * layers
    if branch == "token_dsv4_mla":
        return 0, numel * layers
    return 0, 0
