"""The sampling pipeline: gathered logits `[B, V]` + `SamplingMetadata` -> one token per row.

Order, as in vLLM's v1 sampler:

1. raw logprobs (log_softmax of the untouched logits) for the rows that asked for logprobs;
2. the logits processors' edits (allowed_token_ids, bad_words, min_tokens, logit_bias,
   penalties, structured-output masks, a forced token; `tp_engine.core.sampling.processors`), on a
   float32 copy of the rows they change (`edited_rows`) and nothing else: each can move the
   argmax, so greedy rows get them too;
3. each group of rows (`tp_engine.core.sampling.groups`) along its own path: greedy rows take the
   argmax; temperature and min-p rows one Gumbel-max pass (`kernels.gumbel_sample`: the kernel
   on a GPU, its plain-torch reference on CPU); rows with top-k the top-k slice
   (`tp_engine.core.sampling.top_k_slice`); rows with top-p and no top-k a sort of the row.

Every random path samples `argmax_t(x_t / T + G_t)` over the tokens its truncation keeps, with
`G_t` the Gumbel noise of (the row's seed, its counter, t): a seeded request's tokens depend on
its seed and output positions only, not on its batch, the scheduling mode, the tensor-parallel
size (which only changes logits by rounding) or the path its neighbours take.

`process_logits` materialises what each row samples from (dropped tokens at -inf, scaled by
temperature), through `filters`; the sampler never builds it, the tests compare with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tp_engine.core.sampling.filters import apply_min_p, apply_top_k_top_p, top_k_top_p_full_sort
from tp_engine.core.sampling.logprob_tensors import gather_logprobs
from tp_engine.core.sampling.tensors import SampleGroup, SamplePath, SamplerOutput, SamplingMetadata
from tp_engine.core.sampling.top_k_slice import sample_top_k
from tp_engine.sampling_params import GREEDY_EPSILON

__all__ = ["GREEDY_EPSILON", "process_logits", "sample_batch", "sampling_kernels"]

# Run the Triton kernel on CPU tensors too (under the interpreter): the op counts and the
# tests of the kernel path on machines without a GPU.
_force_kernels = False


@contextlib.contextmanager
def sampling_kernels() -> Iterator[None]:
    """Within the block, CPU logits are sampled with the Triton kernel (TRITON_INTERPRET=1
    must have been set before `kernels` was imported), as CUDA logits always are."""
    global _force_kernels
    previous, _force_kernels = _force_kernels, True
    try:
        yield
    finally:
        _force_kernels = previous


def sample_batch(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """One token per row of `logits [B, V]`."""
    if logits.ndim != 2 or logits.shape[0] != md.num_rows:
        raise ValueError(
            f"sample_batch: logits {tuple(logits.shape)} must be [B, V] with B = {md.num_rows}"
        )
    raw_logprobs = None
    if md.logprob_rows is not None:
        raw_logprobs = torch.log_softmax(logits[md.logprob_rows].float(), dim=-1)  # [L, V]
    edited = edited_logits(logits, md)  # [E, V] fp32 or None

    if len(md.groups) == 1 and md.groups[0].whole and not md.groups[0].edited:
        tokens = _sample_group(logits, md.groups[0])  # the common step: one group, all rows
    else:
        tokens = torch.empty(md.num_rows, dtype=torch.int64, device=logits.device)
        for group in md.groups:
            source = edited if group.edited else logits
            assert source is not None
            tokens.index_copy_(0, group.out_rows, _sample_group(source, group))
    logprobs = None
    if raw_logprobs is not None:
        assert md.logprob_rows is not None
        logprobs = gather_logprobs(raw_logprobs, tokens[md.logprob_rows], md.max_num_logprobs)
    return SamplerOutput(token_ids=tokens, logprobs=logprobs)


def edited_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor | None:
    """Step 2: the edited rows as float32 `[E, V]`, edits applied; None without edits."""
    if md.edited_rows is None:
        return None
    edited = logits.index_select(0, md.edited_rows).float()  # a copy even when fp32 already
    for edit in md.logits_edits:
        edit.apply(edited)
    return edited


def _rows(source: torch.Tensor, group: SampleGroup) -> torch.Tensor:
    """The group's rows of `source` ([G, V]; a view when they are all of it)."""
    return source if group.whole else source.index_select(0, group.src_rows)


def _one_pass(source: torch.Tensor, group: SampleGroup, rows: torch.Tensor | None = None):
    # Deferred: `kernels` imports Triton, which processes that import this package for its
    # types (the API server's) need not load.
    from kernels.gumbel_sample import gumbel_sample, gumbel_sample_ref

    rows = group.src_rows if rows is None else rows
    args = (source, rows, group.inv_temp, group.log_min_p, group.seeds, group.counters)
    if source.is_cuda or _force_kernels:
        return gumbel_sample(*args, any_min_p=group.any_min_p)
    return gumbel_sample_ref(*args)


def _sample_group(source: torch.Tensor, g: SampleGroup) -> torch.Tensor:
    if g.path is SamplePath.ARGMAX:
        return _rows(source, g).argmax(dim=-1)
    if g.path is SamplePath.ONE_PASS:
        return _one_pass(source, g)
    assert g.top_k is not None and g.top_p is not None
    if g.path is SamplePath.TOP_K:
        assert g.max_top_k is not None
        top_p = g.top_p if g.any_top_p else None
        return sample_top_k(
            _rows(source, g), g.inv_temp, g.top_k, top_p, g.log_min_p, g.seeds, g.counters,
            g.max_top_k,
        )  # fmt: skip
    # FULL_SORT: the kept tokens' scaled logits, then the same pass with nothing left to scale.
    scaled = _truncated(_rows(source, g), g)
    ones = torch.ones_like(g.inv_temp)
    flat = SampleGroup(
        SamplePath.ONE_PASS, False, g.out_rows, g.src_rows, True, ones,
        torch.full_like(g.log_min_p, float("-inf")), g.seeds, g.counters,
    )  # fmt: skip
    return _one_pass(scaled, flat, torch.arange(scaled.shape[0], device=scaled.device))


def _truncated(x: torch.Tensor, g: SampleGroup) -> torch.Tensor:
    """`x [G, V]` -> float32 scaled by 1 / T, min-p, top-k and top-p applied (-inf dropped)."""
    x = x.float() * g.inv_temp.unsqueeze(1)
    if g.any_min_p:
        x = apply_min_p(x, g.log_min_p)
    if g.top_k is not None:
        assert g.top_p is not None
        if g.path is SamplePath.FULL_SORT:
            x = top_k_top_p_full_sort(x, g.top_k, g.top_p)
        else:
            x = apply_top_k_top_p(x, g.top_k, g.top_p if g.any_top_p else None, g.max_top_k)
    return x


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """What each row samples from, as float32 `[B, V]`: edited, scaled by temperature and
    truncated (dropped tokens at -inf); greedy rows edited but neither scaled nor truncated.
    For tests and inspection: the sampler draws from the same without building it."""
    out = logits.float().clone()
    edited = edited_logits(logits, md)
    if edited is not None:
        assert md.edited_rows is not None
        out[md.edited_rows] = edited
    for g in md.groups:
        if g.path is SamplePath.ARGMAX:
            continue
        rows = out[g.out_rows]
        greedy = (g.inv_temp == 0).unsqueeze(1)
        out[g.out_rows] = torch.where(greedy, rows, _truncated(rows, g))
    return out
