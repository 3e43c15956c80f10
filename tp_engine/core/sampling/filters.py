"""Truncation of the sampling distribution: min-p, top-k and top-p (nucleus).

They never move the argmax, so greedy rows skip them. Each takes the temperature-scaled logits
of the rows that use it and returns them with the dropped tokens at -inf. Order (as vLLM):
min-p on the full distribution, then top-k, then top-p on what top-k kept, renormalised.

Semantics, exactly (the tests' row-by-row references follow the same words):
- min-p: drop tokens whose probability is below `min_p * max probability` (compared as
  scaled logits: below `max + log(min_p)`);
- top-k: keep the tokens whose logit is at least the k-th largest (ties at the k-th value are
  kept, so a row can keep a few more than k);
- top-p: with tokens in decreasing probability, keep a token while the probability mass of the
  tokens before it is below top_p; the most likely token is always kept. Equally likely tokens
  come in increasing token id (which of them a boundary cuts is otherwise unspecified).

Cost. Top-p needs the kept tokens in decreasing order, but not the whole vocabulary's: when
every row has a top-k bound (`max_k`, known on the host, below V; Qwen3's defaults are top_k 20,
top_p 0.95), the top-`max_k + 1` slice of each row holds every token that can survive, except
ties at the slice's smallest value, which are counted over the row instead of sorted
(`_top_k_top_p_bounded`). A full sort of `[S, V]` (~445 MiB with its indices at S = 256,
V = 151,936) is left for batches where some row has top-p and no top-k, the rows whose nucleus
can reach anywhere in the vocabulary. Both paths compute the same quantities; their sums may
differ in the last bit (fewer terms, another order), which can only matter for a token whose
preceding mass equals top_p to the last bit. No path reads the device from the host.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """`logits [M, V]` (scaled), `log_min_p [M]` (-inf: off) -> logits with improbable tokens
    at -inf. `p_t < min_p * p_max` is `x_t < max(x) + log(min_p)`: no softmax needed."""
    floor = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)  # [M, 1]
    return logits.masked_fill(logits < floor, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    max_k: int | None = None,
) -> torch.Tensor:
    """`logits [S, V]`, `top_k [S]` (V = off), `top_p [S]` (1 = off) or None for no top-p;
    `max_k`: `top_k.max()` when the caller knows it (reading it from a GPU waits for the GPU)."""
    vocab_size = logits.shape[-1]
    if max_k is None:
        max_k = int(top_k.max())
    if top_p is None:
        # Top-k alone needs only each row's k-th value: one topk of the largest k in the batch
        # instead of a sort over the whole vocabulary.
        if max_k >= vocab_size:
            values = logits.sort(dim=-1, descending=True).values
        else:
            values = logits.topk(max_k, dim=-1).values  # [S, max_k], descending
        kth = values.gather(1, (top_k.clamp(max=values.shape[1]) - 1).unsqueeze(1))  # [S, 1]
        return logits.masked_fill(logits < kth, _NEG_INF)
    if max_k < vocab_size:
        return _top_k_top_p_bounded(logits, top_k, top_p, max_k)
    return top_k_top_p_full_sort(logits, top_k, top_p)


def top_k_top_p_full_sort(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p over each row sorted whole (the path for rows without a top-k bound,
    and the reference of the bounded path)."""
    vocab_size = logits.shape[-1]
    # Stable: equally likely tokens in increasing id, the order the module docstring promises.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [S, V] each
    kth = sorted_logits.gather(1, (top_k.clamp(max=vocab_size) - 1).unsqueeze(1))  # [S, 1]
    drop = sorted_logits < kth  # [S, V] top-k
    probs = torch.softmax(sorted_logits.masked_fill(drop, _NEG_INF), dim=-1)  # [S, V]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [S, V]
    # Rows with top-p off skip the test: rounding can push mass_before past 1.0 in a long tail.
    nucleus = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop |= nucleus
    drop[:, 0] = False  # the most likely token always survives
    drop_in_vocab_order = torch.empty_like(drop).scatter_(1, order, drop)  # [S, V]
    return logits.masked_fill(drop_in_vocab_order, _NEG_INF)


def _top_k_top_p_bounded(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int
) -> torch.Tensor:
    """Top-k then top-p when every row's k is at most `max_k` < V, from the top-`max_k + 1`
    slice of each row, with no sort of the vocabulary and no host sync.

    Let `low` be the slice's smallest value. Every token above `low` is in the slice (the head,
    at most max_k tokens), and top-k drops every token below it (the k-th largest is at least
    `low`), so only the tokens equal to `low` (the tail group, of any size, partly outside the
    slice) need the rest of the row: they are equally likely, so counting them and ranking them
    by id gives their masses without sorting them.
    """
    vocab_size = logits.shape[-1]
    n = min(max_k + 1, vocab_size)
    values, ids = logits.topk(n, dim=-1)  # [S, n] descending; ties in no particular order
    # The head in the full sort's order: decreasing value, ties by increasing id.
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, ids = values.gather(1, order), ids.gather(1, order)  # [S, n]
    kth = values.gather(1, (top_k.clamp(max=n) - 1).unsqueeze(1))  # [S, 1] k-th largest
    low = values[:, -1:]  # [S, 1]
    head = (values > low) & (values >= kth)  # [S, n] slice entries above low that top-k keeps
    tail = logits == low  # [S, V] the tail group
    rank = torch.cumsum(tail, dim=-1, dtype=torch.int32)  # [S, V] 1-based rank within the tail
    tail_count = rank[:, -1:]  # [S, 1]
    tail_kept = low >= kth  # [S, 1] top-k keeps the tail group only when low is the k-th value

    keep_head, tail_keep = slice_nucleus(values, head, tail_kept, tail_count, top_p)
    # Tail token of rank r (by id) has mass head_mass + r * p_tail before it: keep the first
    # `tail_keep` of them.
    tail_keep = tail_keep.to(torch.int32)  # [S, 1], at most tail_count
    keep = tail & (rank <= tail_keep)  # [S, V]
    keep.scatter_(1, ids, keep.gather(1, ids) | keep_head)
    return logits.masked_fill(~keep, _NEG_INF)


def slice_nucleus(
    scaled: torch.Tensor,
    head: torch.Tensor,
    tail_kept: torch.Tensor,
    tail_count: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over a top-k slice: `scaled` `[S, n]` in decreasing order (the row's maximum first,
    the tail group's value `low` last), `head` the entries above `low` that top-k keeps,
    `tail_kept` whether top-k keeps the tail group (of `tail_count` equal tokens, partly outside
    the slice). Returns which head entries stay, and how many tail members (the first by id):
    at least one when the tail is the most likely group."""
    e_head = torch.exp(scaled - scaled[:, :1]).masked_fill(~head, 0.0)  # [G, n]
    e_tail = torch.exp(scaled[:, -1:] - scaled[:, :1]).masked_fill(~tail_kept, 0.0)  # [G, 1]
    total = e_head.sum(dim=-1, keepdim=True) + tail_count * e_tail
    p_head, p_tail = e_head / total, e_tail / total
    mass_before = torch.cumsum(p_head, dim=-1) - p_head
    head_mass = p_head.sum(dim=-1, keepdim=True)
    top_p = top_p.unsqueeze(1)
    nucleus_on = top_p < 1.0
    keep_head = head & (~nucleus_on | (mass_before < top_p))
    keep_head[:, 0] |= head[:, 0]  # the most likely token always survives
    by_mass = torch.ceil((top_p - head_mass) / p_tail.clamp(min=torch.finfo(p_tail.dtype).tiny))
    tail_keep = torch.where(nucleus_on, by_mass.clamp(min=0), tail_count.to(by_mass.dtype))
    # The tail is the most likely group when no head entry is: at least one member survives.
    tail_keep = torch.where(head[:, :1], tail_keep, tail_keep.clamp(min=1))
    tail_keep = torch.minimum(tail_keep, tail_count.to(tail_keep.dtype)).masked_fill(~tail_kept, 0)
    return keep_head, tail_keep.long()
