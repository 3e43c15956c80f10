"""Which attention backend a rank runs: the `attention_backend` engine argument, checked here.

    name        runs on                         needs
    torch       CPU or CUDA                     nothing (the reference; host loops, no graphs)
    triton      CUDA, or CPU under the Triton   the project's kernels in `kernels/`
                interpreter (TRITON_INTERPRET=1; for tests only: it is very slow)
    flash_attn  CUDA                            the flash-attn 2 package, fp16/bf16 weights and a
                                                block size that is a multiple of 256 (its paged
                                                KV cache accepts no other page size)
    auto        flash_attn where all of its needs are met, else triton on CUDA, else torch

The layers' non-matmul ops (norms, q/k norm + rotary, SiLU·mul) follow the same rule with
`select_layer_kernels`: "triton" (the fused kernels) or "torch", and "auto" takes triton exactly
where the attention backend runs the project's kernels; so on CPU `attention_backend="triton"`
under the interpreter runs the whole fused path, which is how it is tested and counted there.

Every rank resolves the name for its own device and dtype, so the choice is made where those
facts are known. An explicit choice that cannot run raises `ValueError` saying why, instead of
silently falling back: someone who asked for a backend is measuring or debugging that backend.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from rank_worker.attention.backend import AttentionBackend

# name -> (module, class) of each backend; imported only when chosen, so that the torch path
# never imports Triton or flash-attn.
_BACKENDS = {
    "torch": ("rank_worker.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("rank_worker.attention.triton_backend", "TritonAttentionBackend"),
    "flash_attn": ("rank_worker.attention.flash_attn_backend", "FlashAttnBackend"),
}
BACKEND_NAMES = ("auto", *_BACKENDS)
LAYER_KERNEL_NAMES = ("auto", "torch", "triton")
# flash-attn 2 documents `page_block_size must be a multiple of 256` for a paged KV cache
# (`flash_attn_with_kvcache` and `flash_attn_varlen_func` with `block_table`).
FLASH_ATTN_BLOCK_MULTIPLE = 256
_FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flash_attn_importable() -> bool:
    """Whether the flash-attn 2 package imports (its CUDA extension included)."""
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError):  # OSError: an extension built against another torch/CUDA
        return False
    return True


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (the variable must be set before the
    kernels are imported; Triton reads it when a kernel is decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def unusable_reason(
    name: str,
    *,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype | None = None,
) -> str | None:
    """Why backend `name` cannot run with these facts, or None when it can. `kv_cache_dtype`:
    the cache's dtype when it differs from `dtype` (an fp8 cache)."""
    if name == "torch":
        return None
    if name == "triton":
        if not triton_importable():
            return "the triton package is not installed"
        if device.type != "cuda" and not triton_interpreting():
            return (
                f"Triton kernels need a CUDA device, and this rank runs on {device}; set "
                "TRITON_INTERPRET=1 to run them in the (slow) interpreter, or use 'torch'"
            )
        return None
    if name == "flash_attn":
        # The cheap checks first: "auto" asks on every GPU rank, and importing flash-attn
        # loads its CUDA extension.
        if device.type != "cuda":
            return f"flash-attn needs a CUDA device, and this rank runs on {device}"
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            return (
                f"flash-attn's paged KV cache needs a block size that is a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}, got block_size={block_size}"
            )
        if dtype not in _FLASH_ATTN_DTYPES:
            return f"flash-attn computes in float16 or bfloat16 only, got {dtype}"
        if kv_cache_dtype not in (None, dtype):
            return f"flash-attn 2's paged KV cache holds the model dtype, not {kv_cache_dtype}"
        if not flash_attn_importable():
            return "the flash_attn package is not installed (pip install flash-attn)"
        return None
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")


def select_backend(
    requested: str,
    *,
    device: torch.device | str,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype | None = None,
) -> str:
    """Resolve `requested` (one of BACKEND_NAMES) to the backend this rank runs."""
    if requested not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {requested!r}")
    device = torch.device(device)
    facts = dict(device=device, block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    if requested == "auto":
        if unusable_reason("flash_attn", **facts) is None:
            return "flash_attn"
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    reason = unusable_reason(requested, **facts)
    if reason is not None:
        raise ValueError(f"attention_backend={requested!r} cannot run here: {reason}")
    return requested


def get_backend(name: str = "torch") -> AttentionBackend:
    """A new backend called `name` ("torch", "triton" or "flash_attn").

    Does not check that it can run here: `select_backend` does, with the device and dtype in
    hand, and resolves "auto".
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {tuple(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def select_layer_kernels(
    requested: str, *, device: torch.device | str, attention_backend: str
) -> str:
    """Resolve `requested` (one of LAYER_KERNEL_NAMES) to "triton" or "torch" for this rank;
    `attention_backend` is the backend this rank resolved to."""
    if requested not in LAYER_KERNEL_NAMES:
        raise ValueError(f"layer_kernels must be one of {LAYER_KERNEL_NAMES}, got {requested!r}")
    if requested == "auto":
        return "triton" if attention_backend in ("triton", "flash_attn") else "torch"
    if requested == "triton":
        reason = unusable_reason(
            "triton", device=torch.device(device), block_size=1, dtype=torch.float32
        )
        if reason is not None:
            raise ValueError(f"layer_kernels='triton' cannot run here: {reason}")
    return requested
