"""CPU stand-ins for the CUDA copy ops that SGLang's DeepSeek-V4 host pool calls.

On a CPU build of SGLang 0.5.23 the ``transfer_kv_*`` names are undefined in
``sglang.srt.mem_cache.memory_pool_host`` (they are imported from sgl_kernel on
CUDA/HIP only), and ``transfer_cache_dsv4_mla`` is a JIT CUDA kernel. The
tests inject these functions into that one module namespace (the pool looks
the names up at call time) so real pool objects run their real branches.

They copy with the kernels' addressing, written out from sgl-kernel's
transfer.cu and the DSV4 kvcacheio header:

* pointer-table ops (``*_mla``): row ``r`` of layer ``l`` is at
  ``table[l] + r * item_size``; page-first buffers put it at
  ``base + r * layout_dim + l * item_size``; negative ids are skipped;
* direct ops: ``dst[d:d+n].copy_(src[s:s+n])`` on real tensors, so shape and
  dtype errors surface as they do on the GPU;
* ``transfer_cache_dsv4_mla``: the token kernel, with its hard-coded C4
  latent row: token ``t`` is page ``t >> 6``, slot ``t & 63``; its 576-byte
  value is at ``page * 37440 + slot * 576`` and its 8-byte scale at
  ``page * 37440 + 36864 + slot * 8``, in every layer of the pointer tables.
  On a pool whose rows are not that row it writes the wrong bytes, exactly
  as the GPU kernel would.

Raw-pointer copies go through `Memory`, which knows the registered tensors:
an access outside the tensor that owns the base pointer is recorded in
``Memory.out_of_bounds`` and not executed (the GPU would corrupt or fault).
"""

from __future__ import annotations

import ctypes

import torch

C4_SLOTS = 64
C4_VALUE = 576
C4_SCALE = 8
C4_PAGE = 37440
C4_SCALE_AT = C4_SLOTS * C4_VALUE

OP_NAMES = (
    "transfer_kv_all_layer_mla",
    "transfer_kv_per_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_direct",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_cache_dsv4_mla",
)


class Memory:
    """Registered CPU tensors, by base address, with bounds-checked copies."""

    def __init__(self):
        self.regions: dict[int, tuple[int, str]] = {}
        self.out_of_bounds: list[tuple[str, int, int]] = []
        self.copies = 0
        self.keep: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor, name: str) -> None:
        self.regions[tensor.data_ptr()] = (tensor.numel() * tensor.element_size(), name)
        self.keep.append(tensor)

    def add_pool(self, pool) -> None:
        for i, buf in enumerate(pool.device_buffers):
            self.add(buf, f"{pool.pool_name}.device[{i}]")
        host = pool.kv_buffer if isinstance(pool.kv_buffer, list) else [pool.kv_buffer]
        for i, buf in enumerate(host):
            self.add(buf, f"{pool.pool_name}.host[{i}]")

    def _inside(self, base: int, offset: int, n: int) -> bool:
        region = self.regions.get(base)
        if region is None:
            raise AssertionError(f"copy through an unregistered base pointer {base:#x}")
        ok = offset >= 0 and offset + n <= region[0]
        if not ok:
            self.out_of_bounds.append((region[1], offset, n))
        return ok

    def copy(self, dst_base: int, dst_off: int, src_base: int, src_off: int, n: int) -> None:
        if self._inside(dst_base, dst_off, n) & self._inside(src_base, src_off, n):
            ctypes.memmove(dst_base + dst_off, src_base + src_off, n)
            self.copies += 1


def _ids(indices: torch.Tensor) -> list[int]:
    return indices.reshape(-1).tolist()


def _pairs(src_indices, dst_indices):
    return [(s, d) for s, d in zip(_ids(src_indices), _ids(dst_indices)) if s >= 0 and d >= 0]


def make_standins(mem: Memory) -> dict:
    """name -> CPU function with the CUDA op's keyword interface."""

    def transfer_kv_all_layer_mla(*, src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
        src, dst = src_layers.tolist(), dst_layers.tolist()
        for layer in range(num_layers):
            for s, d in _pairs(src_indices, dst_indices):
                mem.copy(dst[layer], d * item_size, src[layer], s * item_size, item_size)

    def transfer_kv_per_layer_mla(*, src, dst, src_indices, dst_indices, item_size):
        for s, d in _pairs(src_indices, dst_indices):
            mem.copy(dst.data_ptr(), d * item_size, src.data_ptr(), s * item_size, item_size)

    def transfer_kv_all_layer_mla_lf_pf(*, src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers):
        src = src_layers.tolist()
        for layer in range(num_layers):
            for s, d in _pairs(src_indices, dst_indices):
                mem.copy(dst.data_ptr(), d * dst_layout_dim + layer * item_size, src[layer], s * item_size, item_size)

    def transfer_kv_per_layer_mla_pf_lf(*, src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim):
        for s, d in _pairs(src_indices, dst_indices):
            mem.copy(dst.data_ptr(), d * item_size, src.data_ptr(), s * src_layout_dim + layer_id * item_size, item_size)

    def transfer_kv_direct(*, src_layers, dst_layers, src_indices, dst_indices, page_size):
        pairs = list(zip(_ids(src_indices), _ids(dst_indices)))
        for src, dst in zip(src_layers, dst_layers):
            for s, d in pairs[::page_size]:
                dst[d : d + page_size].copy_(src[s : s + page_size])
        mem.copies += len(pairs)

    def transfer_kv_all_layer_direct_lf_pf(*, src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
        pairs = list(zip(_ids(src_indices), _ids(dst_indices)))
        for layer, src in enumerate(src_ptrs):
            for s, d in pairs[::page_size]:
                part = dst_ptrs[0][d : d + page_size, layer]
                part.copy_(src[s : s + page_size].reshape(part.shape))
        mem.copies += len(pairs)

    def transfer_kv_per_layer_direct_pf_lf(*, src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
        for s, d in list(zip(_ids(src_indices), _ids(dst_indices)))[::page_size]:
            part = dst_ptrs[0][d : d + page_size]
            part.copy_(src_ptrs[0][s : s + page_size, layer_id].reshape(part.shape))
            mem.copies += 1

    def transfer_cache_dsv4_mla(src_ptrs, dst_ptrs, src_indices, dst_indices, block_size=1024):
        src, dst = src_ptrs.tolist(), dst_ptrs.tolist()
        for layer in range(len(src)):
            for s, d in _pairs(src_indices, dst_indices):
                sp, so, dp, do = s >> 6, s & 63, d >> 6, d & 63
                mem.copy(dst[layer], dp * C4_PAGE + do * C4_VALUE, src[layer], sp * C4_PAGE + so * C4_VALUE, C4_VALUE)
                mem.copy(
                    dst[layer], dp * C4_PAGE + C4_SCALE_AT + do * C4_SCALE,
                    src[layer], sp * C4_PAGE + C4_SCALE_AT + so * C4_SCALE, C4_SCALE,
                )  # fmt: skip

    return {name: fn for name, fn in locals().items() if name in OP_NAMES}
