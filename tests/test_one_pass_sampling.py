"""One-pass sampling: the Gumbel-max draw with counter-based noise (`kernels.gumbel_sample`)
and the grouped paths of `tp_engine.core.sampling.sampler`.

- Distributions, by chi-square at a fixed seed on a small vocabulary: each path's frequencies
  against the softmax of what `process_logits` says the row samples from (temperature, min-p,
  top-k, top-p, and top-k with a tie group straddling the slice's edge).
- Exactness: every path takes `argmax(kept scaled logits + G(seed, counter, token))`, the same
  token whichever path or batch a row is in.
- The kernel against its reference: under the Triton interpreter on CPU, and on a GPU
  (`gpu`), where the noise bits are the same and the tokens equal.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # before the first `import kernels`
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.gumbel_sample import (
    MAX_SPLITS,
    choose_num_splits,
    gumbel_ref,
    gumbel_sample,
    gumbel_sample_ref,
    row_keys_ref,
    uniform_bits_ref,
)
from tp_engine.core.sampling import SamplingMetadata, process_logits, sample_batch
from tp_engine.core.sampling.groups import cpu_put, plan_groups
from tp_engine.core.sampling.sampler import sampling_kernels


def chisquare(observed, expected=None) -> tuple[float, float]:
    """Pearson's chi-square statistic and p-value (the chi-square survival function is the
    regularised upper incomplete gamma function)."""
    observed = torch.as_tensor(observed, dtype=torch.float64)
    if expected is None:
        expected = torch.full_like(observed, float(observed.mean()))
    expected = torch.as_tensor(expected, dtype=torch.float64)
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    return stat, p_value


V = 12
N = 40_000  # draws per distribution test: one row repeated with distinct seeds


def metadata(num_rows: int, vocab: int = V, device: str = "cpu", **params) -> SamplingMetadata:
    """Every row with the same parameters, seeds 0..num_rows-1, at output position 3."""
    arrays = {k: np.full(num_rows, v) for k, v in params.items()}
    temperature = arrays.pop("temperature")
    groups = plan_groups(
        cpu_put(device), vocab, temperature, np.arange(num_rows, dtype=np.int64),
        np.full(num_rows, 3, dtype=np.int64), **arrays,
    )  # fmt: skip
    return SamplingMetadata(num_rows=num_rows, groups=groups)


ROW = torch.tensor([2.0, 1.5, 1.5, 0.7, 0.3, 0.0, -0.4, -1.0, -1.2, -2.0, 1.1, 0.9])

CASES = {
    "temperature": dict(temperature=0.8),
    "min_p": dict(temperature=1.0, min_p=0.15),
    "top_k": dict(temperature=1.3, top_k=4),
    "top_p": dict(temperature=0.9, top_p=0.7),
    "top_k_top_p_min_p": dict(temperature=1.1, top_k=6, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_follow_the_distribution(name: str) -> None:
    md = metadata(N, **CASES[name])
    logits = ROW.expand(N, V).contiguous()
    expected = torch.softmax(process_logits(logits[:1], metadata(1, **CASES[name]))[0], -1)
    tokens = sample_batch(logits, md).token_ids
    counts = torch.bincount(tokens, minlength=V)
    kept = expected > 0
    assert int(counts[~kept].sum()) == 0, "a truncated token was drawn"
    assert int(kept.sum()) > 1  # not a degenerate case
    _, p_value = chisquare(counts[kept].numpy(), (N * expected[kept]).double().numpy())
    # Fixed seeds make this deterministic; a wrong distribution (e.g. temperature ignored, or
    # softmax(x / T) squared) gives p-values far below 1e-6 at 40k draws.
    assert p_value > 1e-3, (name, p_value, counts.tolist(), expected.tolist())


def test_a_tie_group_across_the_slice_edge_is_sampled_by_its_mass() -> None:
    """top_k 2 with five tokens tied at the 2nd value: top-k keeps all six, top-p keeps the
    best and the first four tied ones by id (masses 0.35, then 0.13 each: the fourth starts at
    0.74 < 0.75); the tied ones outside the 3-wide slice come in too."""
    row = torch.tensor([3.0, 1.0, 2.0, 2.0, -1.0, 2.0, 2.0, 0.0, 2.0, -2.0, 0.5, 0.1])
    params = dict(temperature=1.0, top_k=2, top_p=0.75)
    expected = torch.softmax(process_logits(row[None], metadata(1, **params))[0], -1)
    assert torch.isfinite(torch.log(expected)).nonzero().flatten().tolist() == [0, 2, 3, 5, 6]
    tokens = sample_batch(row.expand(N, V).contiguous(), metadata(N, **params)).token_ids
    counts = torch.bincount(tokens, minlength=V)
    kept = expected > 0
    assert int(counts[~kept].sum()) == 0
    _, p_value = chisquare(counts[kept].numpy(), (N * expected[kept]).double().numpy())
    assert p_value > 1e-3, (p_value, counts.tolist(), expected.tolist())


def test_a_wrong_distribution_fails_the_same_check() -> None:
    """The check above can fail: draws at temperature 0.8 against the temperature-1 target."""
    tokens = sample_batch(ROW.expand(N, V).contiguous(), metadata(N, temperature=0.8)).token_ids
    counts = torch.bincount(tokens, minlength=V).numpy()
    _, p_value = chisquare(counts, (N * torch.softmax(ROW, -1)).double().numpy())
    assert p_value < 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_every_path_takes_the_argmax_of_kept_logits_plus_the_row_noise(name: str) -> None:
    g = torch.Generator().manual_seed(11)
    logits = 2.0 * torch.randn(64, 50, generator=g)  # distinct values: no tie group
    md = metadata(64, vocab=50, **CASES[name])
    kept = process_logits(logits, md)
    keys = row_keys_ref(torch.arange(64), torch.full((64,), 3))
    noise = gumbel_ref(keys, torch.arange(50).expand(64, 50))
    assert sample_batch(logits, md).token_ids.tolist() == (kept + noise).argmax(-1).tolist()


def test_noise_bits_are_uniform_and_depend_on_seed_counter_and_token() -> None:
    keys = row_keys_ref(torch.tensor([0, 0, 1, -1]), torch.tensor([0, 1, 0, 0]))
    assert len(set(keys.tolist())) == 4
    bits = uniform_bits_ref(keys[:1], torch.arange(200_000).unsqueeze(0))[0]
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**24
    counts = torch.bincount(bits >> 20, minlength=16).numpy()  # 16 equal bins
    assert chisquare(counts)[1] > 1e-3
    # Neighbouring tokens are not correlated (the hash mixes the token id fully).
    u = bits.double() / 2**24
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01


# -- the kernel against its reference ----------------------------------------------------------


def kernel_case(num_rows: int, vocab: int, device: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(num_rows + 2, vocab, generator=g)).to(dtype).to(device)
    logits[0, :7] = float("-inf")  # banned tokens
    rows = torch.randperm(num_rows + 2, generator=g)[:num_rows].to(device)
    inv_temp = torch.rand(num_rows, generator=g) * 2
    inv_temp[::4] = 0.0  # greedy rows
    log_min_p = torch.full((num_rows,), float("-inf"))
    log_min_p[1::3] = float(np.log(0.05))
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=g) * 2
    counters = torch.randint(0, 10_000, (num_rows,), generator=g)
    return logits, rows, *(t.to(device) for t in (inv_temp, log_min_p, seeds, counters))


@pytest.mark.parametrize("vocab", [1, 37, 1024, 3001])
def test_kernel_equals_reference_under_the_interpreter(vocab: int) -> None:
    if torch.cuda.is_available():
        pytest.skip("the gpu test below covers the kernel on a GPU")
    args = kernel_case(9, vocab, "cpu")
    assert gumbel_sample(*args).tolist() == gumbel_sample_ref(*args).tolist()


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
def test_split_rows_sample_the_same_token(num_splits: int) -> None:
    """A row cut into slices (5: more slices than 1024-token tiles, so some are empty) samples
    exactly what one pass samples, min-p rows included; without min-p the first read is
    skipped."""
    if torch.cuda.is_available():
        pytest.skip("the gpu tests cover the kernel on a GPU")
    args = kernel_case(12, 3001, "cpu", seed=num_splits)
    want = gumbel_sample_ref(*args)
    assert gumbel_sample(*args, num_splits=num_splits).tolist() == want.tolist()
    no_min_p = (*args[:3], torch.full_like(args[3], float("-inf")), *args[4:])
    got = gumbel_sample(*no_min_p, any_min_p=False, num_splits=num_splits)
    assert got.tolist() == gumbel_sample_ref(*no_min_p).tolist()


def test_equal_maxima_in_two_slices_give_the_lowest_token() -> None:
    if torch.cuda.is_available():
        pytest.skip("the gpu tests cover the kernel on a GPU")
    logits = torch.zeros(2, 3000)
    logits[:, [2500, 700, 1900]] = 5.0  # three slices of 1024 hold an equal maximum each
    rows, greedy = torch.arange(2), torch.zeros(2)
    off, seeds, counters = (
        torch.full((2,), float("-inf")),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
    )
    got = gumbel_sample(logits, rows, greedy, off, seeds, counters, num_splits=3)
    assert got.tolist() == [700, 700] == logits.argmax(-1).tolist()


def test_min_p_floor_is_the_whole_rows() -> None:
    """min-p over a split row: the floor comes from the row's maximum, not each slice's. One
    token in the first slice stands 1 nat above the rest and min-p 0.5 keeps only it; a floor
    from each slice's own maximum would let the other slices' best tokens win on noise."""
    if torch.cuda.is_available():
        pytest.skip("the gpu tests cover the kernel on a GPU")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 3000, generator=g).clamp(max=3.0)
    logits[:, 100] = 4.0
    rows, inv_temp = torch.arange(16), torch.ones(16)
    log_min_p = torch.full((16,), float(np.log(0.5)))
    seeds = torch.randint(0, 2**62, (16,), generator=g)
    counters = torch.arange(16)
    args = (logits, rows, inv_temp, log_min_p, seeds, counters)
    assert gumbel_sample(*args, num_splits=3).tolist() == [100] * 16
    assert gumbel_sample_ref(*args).tolist() == [100] * 16


def test_split_count_fills_the_device_and_keeps_slices_long() -> None:
    assert choose_num_splits(1, 151_936, 132) == MAX_SPLITS  # one row: as many as allowed
    assert choose_num_splits(256, 151_936, 132) == 5  # 8 programs per SM
    assert choose_num_splits(4096, 151_936, 132) == 1
    assert choose_num_splits(1, 3000, 132) == 2  # at least 2 tiles of 1024 a slice


def test_sampler_with_the_kernel_equals_the_reference_path() -> None:
    if torch.cuda.is_available():
        pytest.skip("on a GPU the sampler always runs the kernel")
    logits = 2.0 * torch.randn(16, 300, generator=torch.Generator().manual_seed(3))
    md = metadata(16, vocab=300, temperature=0.7, min_p=0.01)
    with sampling_kernels():
        by_kernel = sample_batch(logits, md).token_ids
    assert by_kernel.tolist() == sample_batch(logits, md).token_ids.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 1000, 151_936])
def test_kernel_equals_reference_on_gpu(vocab: int, dtype: torch.dtype) -> None:
    args = kernel_case(64, vocab, "cuda", dtype)
    got = gumbel_sample(*args).cpu()
    expected = gumbel_sample_ref(*(a.cpu() for a in args))
    # The noise bits are identical; only the GPU's log may differ from the CPU's in the last
    # bit, which can change a token only where two scores tie to ~1e-7: none of 64 rows here.
    assert got.tolist() == expected.tolist()


@pytest.mark.gpu
def test_noise_alone_decides_on_gpu_as_on_cpu() -> None:
    """Temperature so high that the logits hardly matter: the token is the argmax of the
    noise, so equal tokens mean equal noise bits over the whole vocabulary."""
    logits, rows, inv_temp, log_min_p, seeds, counters = kernel_case(32, 151_936, "cuda")
    inv_temp = torch.full_like(inv_temp, 1e-6)
    args = (logits, rows, inv_temp, log_min_p.fill_(float("-inf")), seeds, counters)
    assert (
        gumbel_sample(*args).cpu().tolist() == gumbel_sample_ref(*(a.cpu() for a in args)).tolist()
    )


@pytest.mark.gpu
def test_sampler_on_gpu_equals_cpu_for_every_path() -> None:
    logits = 2.0 * torch.randn(48, 5000, generator=torch.Generator().manual_seed(5))
    for params in CASES.values():
        cpu = sample_batch(logits, metadata(48, vocab=5000, **params)).token_ids
        gpu = sample_batch(logits.cuda(), metadata(48, vocab=5000, device="cuda", **params))
        assert gpu.token_ids.cpu().tolist() == cpu.tolist(), params
