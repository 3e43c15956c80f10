"""Checks and launch facts shared by the kernel wrappers (no kernels here).

Every host wrapper validates its tensors before launch, because a Triton kernel given a wrong
stride or dtype does not fail: it reads the wrong memory. None of these checks reads device
memory, so the wrappers stay free of host-device syncs and can be captured in a CUDA graph.

Checked once per layout, not once per call. An eager step calls each wrapper once per layer
with tensors laid out alike (28 layers: the same shapes, strides, dtypes and devices, other
pointers), and the checks and launch decisions (grid, constexprs, strides) are functions of that
layout alone. So a wrapper keys what it decided on the `layout` of its arguments (plus the plain
values its checks read) in a `LaunchMemo`: the first call with a layout runs every check and
decides; a call with a layout already checked only allocates its output and launches.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Generic, TypeVar

import torch
import triton

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# An fp8 KV cache (`--kv-cache-dtype fp8`): e4m3, as vLLM's "fp8" on NVIDIA GPUs.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = float(torch.finfo(FP8_KV_DTYPE).max)
_INDEX_DTYPES = (torch.int32, torch.int64)


Layout = tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]


def layout(t: torch.Tensor) -> Layout:
    """Everything about `t` that a wrapper's checks read: two tensors with one layout pass or
    fail the same checks (contiguity, for one, follows from the shape and strides)."""
    return (t.shape, t.stride(), t.dtype, t.device)


Decided = TypeVar("Decided")


class LaunchMemo(Generic[Decided]):
    """A wrapper's checked launch decisions, by the layout of the arguments they were checked
    for (`layout`, and whatever plain values the checks read). Decisions only, never tensors:
    an entry outlives the step whose call made it.

    Bounded: the token count is part of most keys and changes from step to step, so the memo
    is emptied when it fills (a step's first call of each wrapper then checks again, which is
    the cost of one call as before).
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._entries: dict[Hashable, Decided] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Decided | None:
        return self._entries.get(key)

    def put(self, key: Hashable, decided: Decided) -> Decided:
        if len(self._entries) >= self.capacity:
            self._entries.clear()
        self._entries[key] = decided
        return decided


def interpreting(kernel: object) -> bool:
    """Whether `kernel` (a `@triton.jit` function) runs under the Triton interpreter.

    Triton decides this once, when the decorator runs (`TRITON_INTERPRET=1` at import time), so
    the kernel object itself is the reliable witness, not the environment now.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """All tensors on one device, and a device this kernel can run on."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {device} and {t.device}")
    if device.type != "cuda" and not interpreting(kernel):
        raise ValueError(
            f"Triton kernels need CUDA tensors, got {device}; to run them on CPU set "
            "TRITON_INTERPRET=1 before `kernels` is imported (the tests do this)"
        )


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, ndim: int, *, row_stride: bool = False) -> None:
    """An int32/int64 index tensor of `ndim` dims that the kernel can address.

    By default it must be contiguous: the kernel indexes it flat. `row_stride=True` is for a
    2-D tensor whose row stride the kernel takes as an argument (a block table): only its last
    dimension must be dense, so a view of some columns of a wider table (what
    `BlockTables.gather` returns on a GPU) is accepted as it is, without a copy.
    """
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if not row_stride:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        return
    if ndim != 2:
        raise ValueError(f"{name}: only a 2-D index tensor has a row stride, got {ndim} dims")
    # A dense last dim (a single column is dense whatever its stride) and rows that do not
    # overlap: what `base + row * stride(0) + col` addresses.
    if (t.shape[1] > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        raise ValueError(
            f"{name} must have a dense last dim and non-overlapping rows, got shape "
            f"{tuple(t.shape)} with strides {t.stride()}"
        )


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """The innermost dim is dense: vectorised loads need it, other strides are passed in."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    """An output buffer the caller passed: `like`'s shape, dtype and device, last dim dense."""
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} {out.device} must match "
            f"{tuple(like.shape)} {like.dtype} {like.device}"
        )
    check_last_dim_contiguous("out", out)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """`[num_blocks, block_size, num_kv_heads, head_dim]`, K and V alike, contiguous."""
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} differs from k_cache "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.dtype != FP8_KV_DTYPE:
        check_float("k_cache", k_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def check_kv_scales(
    k_cache: torch.Tensor, query_dtype: torch.dtype, kv_scales: torch.Tensor | None
) -> torch.Tensor:
    """The `kv_scales` pointer a kernel gets: a `[2]` fp32 `(k_scale, v_scale)` tensor on the
    cache's device for an fp8 cache (required), and for any other cache, which must then have
    the query's dtype, the cache itself (the kernel never reads it; a stand-in pointer)."""
    if k_cache.dtype != FP8_KV_DTYPE:
        if query_dtype != k_cache.dtype:
            raise ValueError(f"query is {query_dtype} but the cache is {k_cache.dtype}")
        return k_cache
    if kv_scales is None:
        raise ValueError("an fp8 KV cache needs kv_scales, a [2] float32 (k_scale, v_scale)")
    if (
        kv_scales.dtype != torch.float32
        or tuple(kv_scales.shape) != (2,)
        or not kv_scales.is_contiguous()
        or kv_scales.device != k_cache.device
    ):
        raise ValueError(
            f"kv_scales must be a contiguous [2] float32 tensor on {k_cache.device}, got "
            f"{kv_scales.dtype} {tuple(kv_scales.shape)} on {kv_scales.device}"
        )
    return kv_scales


def quantized(x: torch.Tensor, kv_scales: torch.Tensor | None, which: int, dtype: torch.dtype):
    """`x` as stored in a cache of `dtype`: for fp8, `x / scale` saturated to e4m3's range
    (`which` 0: K's scale, 1: V's); otherwise `x` cast to `dtype`."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    assert kv_scales is not None
    return (x.float() / kv_scales[which]).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def dequantized(cached: torch.Tensor, kv_scales: torch.Tensor | None, which: int) -> torch.Tensor:
    """fp32 values of cache entries (`quantized`'s inverse up to e4m3 rounding)."""
    if cached.dtype != FP8_KV_DTYPE:
        return cached.float()
    assert kv_scales is not None
    return cached.float() * kv_scales[which]


def dot_options(dtype: torch.dtype, interpret: bool) -> dict[str, object]:
    """Constexprs that pick how `tl.dot` runs for inputs of `dtype`.

    - fp32 inputs: "ieee" precision. Triton's default for fp32 is TF32 (10-bit mantissa), which
      would make fp32 attention no more exact than bf16 and break fp32 bit-closeness to the
      torch reference the project's equality tests rely on.
    - bf16 under the interpreter: the operands are upcast to fp32 first. Triton 3.x's
      interpreter keeps bf16 as raw uint16 and `tl.dot` multiplies those integers, which is
      garbage; on a GPU bf16 goes to the tensor cores as is.
    """
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST_DOT": dtype == torch.bfloat16 and interpret,
    }


@functools.lru_cache(maxsize=8)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device`; a nominal 8 elsewhere (the interpreter), which keeps
    the split heuristics exercised by CPU tests without making them slow."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else 0)
    return 8


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
