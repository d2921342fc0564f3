"""The CPU-only patches the SGLang rig applies inside SGLang's servers.

Each one replaces something that needs a GPU, and nothing else; docs/rig.md
lists them with the reason no real part can run here. They are applied when
their module is first imported (wrapt post-import hooks), in the servers
only, by the rig's plugin (`plugin.load`).

1. ``model_loader.loader._initialize_model``: the DeepSeek-V4 architecture
   is built as `standin_model.StandInDeepseekV4` (the real model's kernels
   and weights cannot run here).
2. ``DeepseekV4AttnBackend.init_forward_metadata``: a no-op (it launches
   Triton kernels, and the stand-in reads no attention metadata).
3. ``dsa_index_k_cache.SetKAndS.triton``: the index-K store kernel, as the
   same byte placement in torch (no Triton driver on CPU): slot ``s`` of page
   ``p`` gets its 128 payload bytes at ``s * 128`` and its float32 scale at
   ``64 * 128 + s * 4``.
4. NIXL's ``nixl_agent`` memory kinds: SGLang labels every buffer "VRAM";
   UCX without CUDA refuses that, so "VRAM" is relabelled "DRAM" (the buffers
   are host memory here).
5. ``disaggregation.prefill``'s direct ``torch.cuda.Event()`` /
   ``torch.cuda.current_stream()`` (overlap loop, early prefix send): a CPU
   event that is always complete (CPU forwards are synchronous); its
   ``torch.empty(..., pin_memory=True)`` (Mooncake's host page indices) is
   left unpinned (pinning needs a CUDA driver).
6. ``mem_cache.pool_host.common._cuda_host_register``: HiCache pins its host
   pools with cudaHostRegister; without CUDA there is nothing to pin, so the
   host pool stays plain (pageable) host memory.
7. ``mem_cache.memory_pool_host.transfer_kv_direct``: the "direct" io
   backend's row copy is an sgl_kernel op with no CPU build; the stand-in
   copies the same rows with ``index_select`` / ``index_copy_``, layer by
   layer. Only this op: the pools' own branch choice (page rows or the
   token-granular ``transfer_cache_dsv4_mla``) stays SGLang's.
8. ``mem_cache.memory_pool_host``'s ``torch.zeros(..., pin_memory=True)``:
   the DeepSeek-V4 host pools' ``get_dummy_flat_data_page`` (the page a
   storage-tier read fills, ``HiCacheFile._read_page``) asks for pinned
   memory; without a CUDA driver it is left unpinned (the same bytes).
9. ``mem_cache.memory_pool_host.transfer_kv_all_layer_direct_lf_pf`` and
   ``transfer_kv_per_layer_direct_pf_lf``: the "direct" io backend's row copies
   for the ``page_first_direct`` host layout (the layout SGLang switches to for
   a Mooncake storage tier), sgl_kernel ops with no CPU build, as the same row
   copies in torch. Only these ops: the pools' branch choice stays SGLang's.
"""

from __future__ import annotations

import types

import torch
import wrapt

ARCHITECTURE = "DeepseekV4ForCausalLM"


# %% 1. the model


def _initialize_model(wrapped, instance, args, kwargs):
    def _pick(model_config, *_a, **_k):
        return model_config

    model_config = _pick(*args, **kwargs)
    architectures = list(getattr(model_config.hf_config, "architectures", None) or [])
    if ARCHITECTURE not in architectures:
        return wrapped(*args, **kwargs)
    from sglang.srt.configs.shared_experts import SharedExpertsConfig

    from .standin_model import StandInDeepseekV4

    model = StandInDeepseekV4(model_config.hf_config)
    model.shared_experts_config = SharedExpertsConfig()
    return model


# %% 2. attention metadata


def _no_metadata(wrapped, instance, args, kwargs):
    return None


# %% 3. the index-K store


def _set_k_and_s(wrapped, instance, args, kwargs):
    def _pick(pool, buf, loc, index_k, index_k_scale):
        return pool, buf, loc, index_k, index_k_scale

    pool, buf, loc, index_k, index_k_scale = _pick(*args, **kwargs)
    if buf.is_cuda:
        return wrapped(*args, **kwargs)
    slots = int(pool.index_page_size)
    payload = index_k.shape[1]
    loc = loc.to(torch.int64)
    pages, slot = loc // slots, loc % slots
    k_cols = slot[:, None] * payload + torch.arange(payload)[None, :]
    s_cols = slots * payload + slot[:, None] * 4 + torch.arange(4)[None, :]
    buf[pages[:, None], k_cols] = index_k.contiguous().view(torch.uint8)
    buf[pages[:, None], s_cols] = index_k_scale.contiguous().view(torch.float32).view(torch.uint8).reshape(-1, 4)
    return None


# %% 4. NIXL memory kinds


def _dram(wrapped, instance, args, kwargs, position):
    if kwargs.get("mem_type") == "VRAM":
        kwargs = dict(kwargs, mem_type="DRAM")
    elif len(args) > position and args[position] == "VRAM":
        args = args[:position] + ("DRAM",) + args[position + 1 :]
    return wrapped(*args, **kwargs)


def _patch_nixl(_package) -> None:
    import sys

    module = sys.modules["nixl._api"]  # nixl's package swaps in its CUDA-major backend here
    for name, position in (("register_memory", 1), ("get_reg_descs", 1), ("get_xfer_descs", 1), ("prep_xfer_dlist", 2)):
        wrapt.wrap_function_wrapper(
            module, f"nixl_agent.{name}",
            lambda w, i, a, k, _p=position: _dram(w, i, a, k, _p),
        )


# %% 5. CUDA events in the prefill module


class _DoneEvent:
    """A CPU stand-in for torch.cuda.Event: CPU forwards are synchronous, so always complete."""

    def record(self, *_a, **_k):
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, *_a, **_k) -> None:
        return None


def _cpu_torch() -> types.SimpleNamespace:
    cuda = types.SimpleNamespace(Event=lambda *a, **k: _DoneEvent(), current_stream=lambda *a, **k: None)
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})
    proxy.cuda = cuda
    proxy.empty = _unpinned_empty  # Mooncake's host page indices ask for pinned memory (CUDA only)
    return proxy


def _unpinned_empty(*args, pin_memory: bool = False, **kwargs):
    """torch.empty without pinning: pinned memory needs a CUDA driver; plain host memory is the same bytes."""
    return torch.empty(*args, **kwargs)


def _patch_prefill(module) -> None:
    if not torch.cuda.is_available():
        module.torch = _cpu_torch()


# %% 6. HiCache host-pool pinning


def _no_pinning(wrapped, instance, args, kwargs):
    if torch.cuda.is_available():
        return wrapped(*args, **kwargs)
    return None


# %% 7. HiCache's direct row copy


def _row_ids(indices):
    """Row numbers as the torch copies below index with them."""
    return indices.to(torch.int64).cpu()


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1):
    """dst_layers[i][dst_indices] = src_layers[i][src_indices], rows along the first dimension."""
    src_rows, dst_rows = _row_ids(src_indices), _row_ids(dst_indices)
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, dst_rows.to(dst.device), src.index_select(0, src_rows.to(src.device)).to(dst.device))


def _byte_rows(tensor):
    """`tensor` as uint8 [rows, bytes per row]: the same memory, whatever its dtype (a view,
    or an error: a copy would take the writes)."""
    return tensor.view(torch.uint8).view(tensor.shape[0], -1)


def _byte_pages(host):
    """A page_first_direct host pool [rows, layers, ...] as uint8 [rows, layers, bytes] (a view)."""
    return host.view(torch.uint8).view(host.shape[0], host.shape[1], -1)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size=1):
    """A backup into a page_first_direct host pool: row dst_indices[i] of every layer gets the
    bytes of row src_indices[i] of that layer's device buffer."""
    src_rows, dst_rows = _row_ids(src_indices), _row_ids(dst_indices)
    host = _byte_pages(dst_ptrs[0])
    for layer, src in enumerate(src_ptrs):
        host[dst_rows, layer] = _byte_rows(src).index_select(0, src_rows.to(src.device)).to(host.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size=1):
    """One layer's load from a page_first_direct host pool: row dst_indices[i] of the device
    buffer gets the bytes of host row src_indices[i] of that layer."""
    src_rows, dst_rows = _row_ids(src_indices), _row_ids(dst_indices)
    dst = _byte_rows(dst_ptrs[0])
    dst.index_copy_(0, dst_rows.to(dst.device), _byte_pages(src_ptrs[0])[src_rows, layer_id].to(dst.device))


def _patch_host_pools(module) -> None:
    if not torch.cuda.is_available() and not hasattr(module, "transfer_kv_direct"):
        module.transfer_kv_direct = transfer_kv_direct
    if not torch.cuda.is_available() and not hasattr(module, "transfer_kv_all_layer_direct_lf_pf"):
        module.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf  # 9.
        module.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
    if not torch.cuda.is_available():
        module.torch = _unpinned_zeros_torch()  # 8.: the storage tier's read page


# %% 8. the storage tier's read page


def _unpinned_zeros(*args, pin_memory: bool = False, **kwargs):
    """torch.zeros without pinning: pinned memory needs a CUDA driver; plain host memory is the same bytes."""
    return torch.zeros(*args, **kwargs)


def _unpinned_zeros_torch() -> types.ModuleType:
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})
    proxy.zeros = _unpinned_zeros
    proxy.__getattr__ = lambda name: getattr(torch, name)  # torch's lazily imported submodules
    return proxy


# %% registration

_applied = False


def apply() -> None:
    """Register every patch for when its module is imported (once per process)."""
    global _applied
    if _applied:
        return
    _applied = True
    wrapt.register_post_import_hook(
        lambda m: wrapt.wrap_function_wrapper(m, "_initialize_model", _initialize_model),
        "sglang.srt.model_loader.loader",
    )
    wrapt.register_post_import_hook(
        lambda m: wrapt.wrap_function_wrapper(m, "DeepseekV4AttnBackend.init_forward_metadata", _no_metadata),
        "sglang.srt.layers.attention.deepseek_v4_backend",
    )
    wrapt.register_post_import_hook(
        lambda m: wrapt.wrap_function_wrapper(m, "SetKAndS.triton", _set_k_and_s),
        "sglang.kernels.ops.kvcache.dsa_index_k_cache",
    )
    wrapt.register_post_import_hook(_patch_nixl, "nixl")
    wrapt.register_post_import_hook(_patch_prefill, "sglang.srt.disaggregation.prefill")
    wrapt.register_post_import_hook(
        lambda m: wrapt.wrap_function_wrapper(m, "_cuda_host_register", _no_pinning),
        "sglang.srt.mem_cache.pool_host.common",
    )
    wrapt.register_post_import_hook(_patch_host_pools, "sglang.srt.mem_cache.memory_pool_host")
