"""Sampling in one read of the logits: the Gumbel-max trick with counter-based noise.

`argmax_t(x_t / T + G_t)` with `G_t` i.i.d. standard Gumbel is distributed exactly as
`softmax(x / T)`, so a row is sampled in the same single pass that its greedy argmax takes,
without a softmax, a division or a noise tensor. Greedy rows (`inv_temp` 0) take the plain
argmax in the same launch.

The noise is not drawn from a generator: `G_t = -log(-log(u))` with `u` a hash of (the row's
64-bit seed, its counter, the token id) (`uniform_bits_ref`). A row's seed is its request's
and its counter the position of the output token being sampled, so a request's draws depend on
nothing else in the batch, need no per-row state, and a draw that was discarded (a preempted
row) is made again, identically, by computing it again. The hash is Chris Wellons' `lowbias32`
integer mixer (an invertible 32-bit function with near-ideal avalanche), chained over the
inputs; only 32-bit multiplies, shifts and xors, so the kernel and the plain-torch reference
compute the same bits (the reference in int64, masked to 32 bits after each multiply). The
24 high bits make `u = (bits + 0.5) / 2^24` in (0, 1), exactly representable in float32 on
both. Only the final `log`s may differ in the last bit between a GPU and the CPU, which can
change a token only where two scores tie to within that rounding.

min-p fits the same pass: `p_t < min_p * p_max` is `x_t / T < max(x / T) + log(min_p)`, so a
row with min-p (`log_min_p` > -inf) first finds its maximum (a second read of that row only),
then samples among the tokens at or above the floor.

A row is cut into slices, each read by its own program (split-V, as flash-decoding splits a
context): each slice's best score and token, then a merge that keeps the best (the lowest token
among equal scores, as one pass would). One program walking a whole 151,936-entry row is
latency-bound: on an H200 one row took 0.33 ms, 3,000 times what reading it costs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_device, check_float, check_index, num_sms

_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
# Mixed into the counter so that counter 0 and seed 0 do not make an all-zero key.
_COUNTER_SALT = 0x9E3779B9
# The kernel's copies: a @triton.jit function reads only globals made `tl.constexpr` (the
# interpreter reads any global, so only a GPU compile catches a plain int here).
_M1_C = tl.constexpr(_M1)
_M2_C = tl.constexpr(_M2)
_COUNTER_SALT_C = tl.constexpr(_COUNTER_SALT)
_BLOCK = 1024
# Row slices: about this many programs per SM, slices of at least this many tiles, at most
# MAX_SPLITS slices.
PROGRAMS_PER_SM = 8
MIN_SPLIT_TILES = 2
MAX_SPLITS = 64
_SPLITS_PAD = 64
# Rows per chunk of the reference (its int64 temporaries are ~8 bytes x V per row, each).
_REF_ROWS = 16


# -- the reference (plain torch, int64 holding uint32 values) ---------------------------------


def _mix_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32  # int64 products wrap; their low 32 bits are the uint32 product
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def row_keys_ref(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`seeds [R]` int64 (any 64 bits), `counters [R]` int64 -> `[R]` 32-bit keys (int64)."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    key = _mix_ref((counters & _MASK32) ^ _COUNTER_SALT)
    return _mix_ref(_mix_ref(key ^ lo) ^ hi)


def uniform_bits_ref(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`keys [R]` from `row_keys_ref`, `token_ids [R, N]` -> `[R, N]` 24 random bits (int64)."""
    k = keys.unsqueeze(-1)
    return _mix_ref(_mix_ref(k ^ token_ids) ^ _COUNTER_SALT) >> 8


def gumbel_ref(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`[R, N]` float32 standard Gumbel noise of `token_ids` in the rows keyed `keys`."""
    u = (uniform_bits_ref(keys, token_ids).to(torch.float32) + 0.5) * (2.0**-24)
    return -torch.log(-torch.log(u))


def gumbel_sample_ref(
    logits: torch.Tensor,
    rows: torch.Tensor,
    inv_temp: torch.Tensor,
    log_min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """`gumbel_sample` in plain torch: the tokens of `logits[rows]` (`[G]` int64). It builds
    the noise as int64 tensors, so it goes `_REF_ROWS` rows at a time to bound its memory."""
    if rows.shape[0] > _REF_ROWS:
        parts = [
            gumbel_sample_ref(
                logits,
                *(t[i : i + _REF_ROWS] for t in (rows, inv_temp, log_min_p, seeds, counters)),
            )
            for i in range(0, rows.shape[0], _REF_ROWS)
        ]
        return torch.cat(parts)
    x = logits.index_select(0, rows).float()  # [G, V]
    scaled = x * inv_temp.unsqueeze(1)
    floor = scaled.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)  # [G, 1]
    token_ids = torch.arange(x.shape[1], device=x.device).expand_as(x)
    noise = gumbel_ref(row_keys_ref(seeds, counters), token_ids)  # [G, V]
    score = torch.where(scaled >= floor, scaled + noise, float("-inf"))
    score = torch.where((inv_temp > 0).unsqueeze(1), score, x)  # greedy rows: the argmax
    return score.argmax(dim=-1)


# -- the kernel ----------------------------------------------------------------------------------


@triton.jit
def _mix(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], _M1_C, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], _M2_C, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_key(seeds_ptr, counters_ptr, g):
    """Row `g`'s 32-bit key from its 64-bit seed and its counter (`row_keys_ref`)."""
    seed = tl.load(seeds_ptr + g)
    counter = tl.load(counters_ptr + g)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix((counter & 0xFFFFFFFF).to(tl.uint32) ^ tl.full([], _COUNTER_SALT_C, tl.uint32))
    return _mix(_mix(key ^ lo) ^ hi)


# The number of rows changes every step, the split count with it: no specialisation on either.
@triton.jit(do_not_specialize=["vocab_size", "stride_row", "chunk"])
def _split_max_kernel(
    part_max_ptr,  # [G, num_splits] fp32 out: each slice's largest scaled logit
    logits_ptr,  # [*, V] float logits; row r at rows[r] * stride_row, last dim contiguous
    rows_ptr,  # [G] int64: which rows of logits to sample
    inv_temp_ptr,  # [G] fp32: 1 / temperature, 0 for a greedy row
    vocab_size,
    stride_row,
    chunk,  # tokens per slice, a multiple of BLOCK
    BLOCK: tl.constexpr,
):
    # Grid (G, num_splits): the first read of min-p, the row's maximum, one slice per program.
    g = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + tl.load(rows_ptr + g) * stride_row
    inv_temp = tl.load(inv_temp_ptr + g)
    cols = tl.arange(0, BLOCK)
    start = split * chunk
    end = tl.minimum(start + chunk, vocab_size)
    top = tl.full([BLOCK], -float("inf"), tl.float32)
    for tile in range(start, end, BLOCK):
        c = tile + cols
        ok = c < end
        x = tl.load(base + c, mask=ok, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.where(ok, x * inv_temp, -float("inf")))
    tl.store(part_max_ptr + g * tl.num_programs(1) + split, tl.max(top, 0))


@triton.jit(do_not_specialize=["vocab_size", "stride_row", "chunk"])
def _split_sample_kernel(
    out_ptr,  # [G] int64: the sampled token of each row (written when num_splits == 1)
    part_score_ptr,  # [G, num_splits] fp32 out: each slice's best score (num_splits > 1)
    part_id_ptr,  # [G, num_splits] int64 out: the token that scored it (num_splits > 1)
    part_max_ptr,  # [G, num_splits] fp32 from _split_max_kernel (MIN_P; else unused)
    logits_ptr,  # [*, V] float logits; row r at rows[r] * stride_row, last dim contiguous
    rows_ptr,  # [G] int64: which rows of logits to sample
    inv_temp_ptr,  # [G] fp32: 1 / temperature, 0 for a greedy row
    log_min_p_ptr,  # [G] fp32: log(min_p), -inf where min-p is off
    seeds_ptr,  # [G] int64: each row's seed (64 bits)
    counters_ptr,  # [G] int64: each row's counter (output position)
    vocab_size,
    stride_row,
    chunk,  # tokens per slice, a multiple of BLOCK
    MIN_P: tl.constexpr,  # some row has min-p: part_max holds the slices' maxima
    SPLITS_PAD: tl.constexpr,  # MAX_SPLITS as a power of two
    BLOCK: tl.constexpr,
):
    # Grid (G, num_splits): the best Gumbel score of one slice of one row.
    g = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    base = logits_ptr + tl.load(rows_ptr + g) * stride_row
    inv_temp = tl.load(inv_temp_ptr + g)
    key = _row_key(seeds_ptr, counters_ptr, g)
    salt = tl.full([], _COUNTER_SALT_C, tl.uint32)
    greedy = inv_temp == 0.0
    cols = tl.arange(0, BLOCK)

    floor = -float("inf")
    if MIN_P:
        log_min_p = tl.load(log_min_p_ptr + g)
        if (log_min_p > -float("inf")) & (inv_temp > 0.0):
            # min-p: the floor is relative to the row's largest scaled logit, over all slices.
            s = tl.arange(0, SPLITS_PAD)
            maxima = tl.load(
                part_max_ptr + g * num_splits + s, mask=s < num_splits, other=-float("inf")
            )
            floor = tl.max(maxima, 0) + log_min_p

    start = split * chunk
    end = tl.minimum(start + chunk, vocab_size)
    best = tl.full([], -float("inf"), tl.float32)
    best_id = tl.full([], 0, tl.int64)
    for tile in range(start, end, BLOCK):
        c = tile + cols
        ok = c < end
        x = tl.load(base + c, mask=ok, other=0.0).to(tl.float32)
        bits = _mix(_mix(key ^ c.to(tl.uint32)) ^ salt) >> 8
        u = ((bits.to(tl.float32)) + 0.5) * (1.0 / 16777216.0)
        noise = -tl.log(-tl.log(u))
        scaled = x * inv_temp
        score = tl.where(scaled >= floor, scaled + noise, -float("inf"))
        score = tl.where(greedy, x, score)
        score = tl.where(ok, score, -float("inf"))
        tile_best = tl.max(score, 0)
        tile_id = tl.argmax(score, 0)
        # Strictly greater: the first of equal maxima wins, as torch.argmax's.
        take = tile_best > best
        best_id = tl.where(take, (tile + tile_id).to(tl.int64), best_id)
        best = tl.where(take, tile_best, best)
    if num_splits == 1:  # a runtime branch: both cases are one binary
        tl.store(out_ptr + g, best_id)
    else:
        tl.store(part_score_ptr + g * num_splits + split, best)
        tl.store(part_id_ptr + g * num_splits + split, best_id)


@triton.jit(do_not_specialize=["num_splits"])
def _split_merge_kernel(
    out_ptr,  # [G] int64
    part_score_ptr,  # [G, num_splits] fp32
    part_id_ptr,  # [G, num_splits] int64
    num_splits,
    SPLITS_PAD: tl.constexpr,
):
    # Grid (G,): the best slice of each row; the first of equal maxima (the lowest token) wins.
    g = tl.program_id(0)
    s = tl.arange(0, SPLITS_PAD)
    scores = tl.load(part_score_ptr + g * num_splits + s, mask=s < num_splits, other=-float("inf"))
    best = tl.argmax(scores, 0, tie_break_left=True)
    tl.store(out_ptr + g, tl.load(part_id_ptr + g * num_splits + best))


def choose_num_splits(num_rows: int, vocab_size: int, sm_count: int) -> int:
    """Slices per row so that about `PROGRAMS_PER_SM` programs run on each SM: one program
    walking a 151,936-entry row alone is latency-bound (an H200 took 0.33 ms for one row and
    0.55 ms for 256, where reading them takes 0.1 and 32 µs). Never under `MIN_SPLIT_TILES`
    tiles a slice."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * sm_count, max(num_rows, 1))
    by_length = triton.cdiv(max(vocab_size, 1), MIN_SPLIT_TILES * _BLOCK)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def gumbel_sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    inv_temp: torch.Tensor,
    log_min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    *,
    any_min_p: bool = True,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One token per row of `logits[rows]` (`[*, V]` float, last dim contiguous): the argmax
    where `inv_temp` is 0, else a sample of `softmax(x * inv_temp)` restricted by min-p
    (`log_min_p`, -inf for off), drawn with the noise of (`seeds`, `counters`). Returns `[G]`
    int64; reads each sampled row once (twice with min-p) and writes nothing of size V.

    Each row is cut into `num_splits` slices (None: `choose_num_splits`), sampled by separate
    programs and merged; the result is the same token whatever the split. `any_min_p=False`
    (the caller knows no row has min-p) skips the first read."""
    check_device(_split_sample_kernel, logits, rows, inv_temp, log_min_p, seeds, counters)
    check_float("logits", logits)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, V] with a contiguous last dim, got {logits.shape}")
    check_index("rows", rows, 1)
    num = rows.shape[0]
    for name, t, dtype in (
        ("inv_temp", inv_temp, torch.float32),
        ("log_min_p", log_min_p, torch.float32),
        ("seeds", seeds, torch.int64),
        ("counters", counters, torch.int64),
    ):
        if t.dtype != dtype or t.shape != (num,) or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [{num}] {dtype}, got {t.dtype} {t.shape}"
            )
    out = torch.empty(num, dtype=torch.int64, device=logits.device)
    if not num:
        return out
    vocab = logits.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(num, vocab, num_sms(logits.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    chunk = triton.cdiv(triton.cdiv(vocab, num_splits), _BLOCK) * _BLOCK
    rows = rows.to(torch.int64)
    common = dict(device=logits.device)
    part_max = torch.empty((num, num_splits), dtype=torch.float32, **common)
    if any_min_p:
        _split_max_kernel[(num, num_splits)](
            part_max, logits, rows, inv_temp, vocab, logits.stride(0), chunk, BLOCK=_BLOCK
        )
    if num_splits > 1:
        part_score = torch.empty((num, num_splits), dtype=torch.float32, **common)
        part_id = torch.empty((num, num_splits), dtype=torch.int64, **common)
    else:  # unused, but of the dtypes the kernel specialises on
        part_score, part_id = part_max, out
    _split_sample_kernel[(num, num_splits)](
        out, part_score, part_id, part_max, logits, rows, inv_temp, log_min_p, seeds, counters,
        vocab, logits.stride(0), chunk,
        MIN_P=any_min_p, SPLITS_PAD=_SPLITS_PAD, BLOCK=_BLOCK,
    )  # fmt: skip
    if num_splits > 1:
        _split_merge_kernel[(num,)](out, part_score, part_id, num_splits, SPLITS_PAD=_SPLITS_PAD)
    return out
