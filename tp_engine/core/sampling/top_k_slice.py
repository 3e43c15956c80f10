"""Top-k, top-p and min-p sampling from the top-(max_k + 1) slice of each row.

Same semantics as `tp_engine.core.sampling.filters` (min-p, then top-k with ties at the k-th value
kept, then top-p over what is kept in decreasing probability, equal ones in increasing id; the
most likely token always kept), then a Gumbel-max draw with the rows' counter-based noise
(`kernels.gumbel_sample`), so that a row samples the token `argmax(kept scaled logits + G)`
exactly as the one-pass path would over the masked row.

What it reads. One `topk` of the rows (n = max_k + 1 columns); every token that can survive is
in the slice except the tokens equal to its smallest value `low` (the tail group: top-k keeps
all or none of it, min-p likewise, top-p a prefix by id). When top-k and min-p keep the tail,
its members outside the slice are counted over the row, and the group is drawn as one
candidate of weight `tail_keep * p(low)`; if it wins, its member is its `j`-th token by id
with `j` uniform, drawn from the row's noise at two positions past the vocabulary. That takes
two more passes over the path's rows (an equality and a running rank, which a binary search
then reads for the member); they run whether or not a row's tail is kept, because deciding on
the host would wait for the GPU (a kernel that skips rows without a kept tail is the next
step). Ties across the slice's edge are compared on the unscaled logits (temperature is
monotone, so it cannot reorder them; comparing scaled values could let rounding merge two
distinct logits).
"""

from __future__ import annotations

import torch

from tp_engine.core.sampling.filters import slice_nucleus

_NEG_INF = float("-inf")


def sample_top_k(
    x: torch.Tensor,
    inv_temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    log_min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    max_k: int,
) -> torch.Tensor:
    """`x [G, V]` logits (any float dtype), per-row `[G]` controls -> `[G]` int64 tokens."""
    from kernels.gumbel_sample import gumbel_ref, row_keys_ref, uniform_bits_ref  # see sampler

    vocab_size = x.shape[-1]
    n = min(max_k + 1, vocab_size)
    values, ids = x.topk(n, dim=-1)  # [G, n] descending; ties in no particular order
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)  # value desc, then id asc
    values, ids = values.gather(1, order), ids.gather(1, order)  # [G, n]
    scaled = values.float() * inv_temp.unsqueeze(1)  # [G, n]
    floor = scaled[:, :1] + log_min_p.unsqueeze(1)  # [G, 1] min-p
    kth = values.gather(1, (top_k.clamp(max=n) - 1).unsqueeze(1))  # [G, 1] k-th largest
    has_tail = n < vocab_size  # else the slice is the whole row: nothing outside it
    low = values[:, -1:]  # [G, 1]
    head = (values >= kth) & (scaled >= floor)  # [G, n]
    if has_tail:
        head &= values > low
        tail_kept = (low >= kth) & (scaled[:, -1:] >= floor)  # [G, 1]
        tail = x == low  # [G, V] the tail group
        # 1-based rank of each tail member by id, nondecreasing along the row.
        rank = torch.cumsum(tail, dim=-1, dtype=torch.int32)  # [G, V]
        tail_count = rank[:, -1:].long()  # [G, 1]
    else:
        tail_kept = torch.zeros_like(low, dtype=torch.bool)
        tail_count = torch.zeros_like(low, dtype=torch.int64)

    keep_head, tail_keep = head, tail_count * tail_kept
    if top_p is not None:
        keep_head, tail_keep = slice_nucleus(scaled, head, tail_kept, tail_count, top_p)

    keys = row_keys_ref(seeds, counters)  # [G]
    score = torch.where(keep_head, scaled + gumbel_ref(keys, ids), _NEG_INF)  # [G, n]
    if not has_tail:
        return ids.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)
    # The tail group as one candidate: log-weight log(tail_keep) + its scaled logit.
    beyond = torch.full_like(ids[:, :2], vocab_size) + torch.arange(2, device=ids.device)
    group_noise = gumbel_ref(keys, beyond[:, :1])  # [G, 1]
    group = torch.where(
        tail_keep > 0,
        scaled[:, -1:] + torch.log(tail_keep.clamp(min=1).float()) + group_noise,
        _NEG_INF,
    )  # [G, 1]
    best = torch.cat([score, group], dim=1).argmax(dim=-1, keepdim=True)  # [G, 1]
    head_token = ids.gather(1, best.clamp(max=n - 1))
    # Member j (0-based, uniform below tail_keep) of the tail group by increasing id.
    u = uniform_bits_ref(keys, beyond[:, 1:]).float() * (2.0**-24)  # [G, 1] in [0, 1)
    j = (u * tail_keep.float()).long().clamp(max=(tail_keep - 1).clamp(min=0))
    # The first position where the running rank reaches j + 1 is that member (a binary search
    # of the rank, not a pass over it).
    tail_token = torch.searchsorted(rank, (j + 1).to(torch.int32))  # [G, 1]
    return torch.where(best == n, tail_token, head_token).squeeze(1)
