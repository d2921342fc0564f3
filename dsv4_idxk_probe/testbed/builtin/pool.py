"""Index-K buffers for one side of the rig, shaped exactly like SGLang's.

SGLang's `DeepSeekV4IndexerPool` allocates one zero-filled ``uint8 [pages,
row_bytes]`` tensor per C4 layer. The rig uses that class when SGLang is
importable and the layout is one it has (through
``dsv4_idxk_probe.testbed.sglang.indexer_pool``, the only code that knows SGLang), and an
identical allocation otherwise; `source_used` says which one a run got.
"""

from __future__ import annotations

import torch

from ...digest.layout import RowLayout

META_SLOTS = 8  # one uint64 row per room, like SGLang's bootstrap_room[idx, 0:8]


def build_buffers(layout: RowLayout, n_layers: int, n_pages: int, device: str, source: str = "auto") -> tuple[list[torch.Tensor], str]:
    """Return (buffers, "sglang" | "builtin"); `source="sglang"` fails rather than fall back."""
    if source in ("auto", "sglang"):
        try:
            from ..sglang import indexer_pool

            if indexer_pool.supports(layout.name):
                bufs = indexer_pool.build_indexer_buffers(layout.name, n_layers, n_pages, device)
                _check(bufs, layout, n_layers, n_pages)
                return bufs, "sglang"
            if source == "sglang":
                raise ValueError(f"SGLang's pool has no {layout.name!r} layout; use pool_source auto or builtin")
        except ImportError:
            if source == "sglang":
                raise
    bufs = [torch.zeros((n_pages, layout.row_bytes), dtype=torch.uint8, device=device) for _ in range(n_layers)]
    return bufs, "builtin"


def select_device(kind: str, index: int) -> str:
    """"cpu", or "cuda:N" made this process's current device (streams, events and the
    digest kernel then all run where the buffers live)."""
    if kind != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA device")
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"CUDA device {index} does not exist ({torch.cuda.device_count()} visible)")
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def build_meta(rows: int, device: str) -> torch.Tensor:
    """The metadata rows that travel with each room's last write (int64: NIXL needs a plain dtype)."""
    return torch.zeros((rows, META_SLOTS), dtype=torch.int64, device=device)


def _check(bufs: list[torch.Tensor], layout: RowLayout, n_layers: int, n_pages: int) -> None:
    """The pool must give what the rig and the digest expect; anything else is a version drift."""
    if len(bufs) != n_layers:
        raise ValueError(f"SGLang pool gave {len(bufs)} buffers for {n_layers} layers")
    for b in bufs:
        if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != layout.row_bytes or b.shape[0] < n_pages:
            raise ValueError(
                f"SGLang pool buffer is {b.dtype} {tuple(b.shape)}; layout {layout.name!r} needs uint8 [>={n_pages}, {layout.row_bytes}]"
            )
