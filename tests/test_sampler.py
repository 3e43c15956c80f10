"""Rank 0's sampler against plain-torch references computed row by row.

The batch side (`SamplingBatchBuilder` turning sequences into per-step tensors, and the batched
pipeline in `tp_engine.core.sampling`) must agree, row by row, with a straightforward reference
written from the documented semantics: penalties, min_tokens bans, temperature, min-p, top-k,
top-p, each alone and combined, in batches that mix them with greedy rows. Sampling itself is
checked exactly for seeded rows (same generator, same draws) and statistically otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from kernels.gumbel_sample import gumbel_ref, row_keys_ref
from tp_engine.core.running_batch import RunningBatch
from tp_engine.core.sampling import SamplingMetadata, process_logits, sample_batch
from tp_engine.core.sampling.batch import SamplingBatch, SamplingBatchBuilder
from tp_engine.core.sampling.groups import cpu_put, plan_groups, seed_bits
from tp_engine.core.sampling.profiling import profile_sampling, sample_for_profiling
from tp_engine.core.sequence import Sequence
from tp_engine.sampling_params import SamplingParams

V = 40
EOS = 7
NEG_INF = float("-inf")


def make_seq(params: SamplingParams, prompt: list[int], output: list[int] = ()) -> Sequence:
    seq = Sequence(f"r{id(params)}", prompt, params)
    seq.token_ids += output
    return seq


class _Builder:
    """`SamplingBatchBuilder.build` over a running batch holding `seqs`, one row each, in order
    (the engine's batch holds every running sequence; here it holds just the ones sampled)."""

    def __init__(self, seed: int) -> None:
        self.builder = SamplingBatchBuilder(V, [EOS], torch.device("cpu"), seed)

    def build(self, seqs: list[Sequence]) -> SamplingBatch:
        batch = RunningBatch(len(seqs), 1, 10_000)
        # A sequence runs in one row at a time: a list that repeats one gets copies.
        seen: set[int] = set()
        running = []
        for seq in seqs:
            if id(seq) in seen:
                seq = copy.copy(seq)
                seq.noise_seed = None  # another sequence: its own noise
            running.append(seq)
            seen.add(id(seq))
        rows = np.array([batch.add(seq) for seq in running], dtype=np.int32)
        built = self.builder.build(batch, rows)
        for seq in running:  # they stop running (the test may build them into another batch)
            batch.remove(seq)
        return built


def builder(seed: int = 0) -> _Builder:
    return _Builder(seed)


# -- the reference ---------------------------------------------------------------------------


def reference_row(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The logits one row samples from, from the documented semantics, token by token."""
    p = seq.sampling_params
    x = logits.clone()
    prompt, output = seq.prompt_token_ids, seq.output_token_ids
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
            x[t] = NEG_INF
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    if p.temperature == 0.0:
        return x
    x = x / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(x, -1)
        x[probs < p.min_p * probs.max()] = NEG_INF
    if 0 < p.top_k < V:
        kth = sorted(x.tolist(), reverse=True)[p.top_k - 1]
        x[x < kth] = NEG_INF
    if p.top_p < 1.0:
        probs = torch.softmax(x, -1)
        mass = 0.0
        for rank, t in enumerate(sorted(range(V), key=lambda t: -x[t].item())):
            if rank > 0 and mass >= p.top_p:
                x[t] = NEG_INF
            mass += probs[t].item()
    return x


def assert_rows_match(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(expected)), "different tokens dropped"
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


# One row per case: each control alone, then combinations.
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
    "repetition": SamplingParams(temperature=1.0, repetition_penalty=1.7),
    "presence": SamplingParams(temperature=1.0, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=1.0, frequency_penalty=0.8),
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=8, stop_token_ids=[3, 11]),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=8, top_p=0.7),
    "all": SamplingParams(
        temperature=1.3,
        top_k=12,
        top_p=0.85,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=-0.4,
        min_tokens=7,
        stop_token_ids=[2],
    ),
    "greedy_penalised": SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0, min_tokens=9
    ),
}


def case_batch(names: list[str], seed: int = 0) -> tuple[torch.Tensor, list[Sequence]]:
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(len(names), V, generator=g)
    seqs = []
    for name in names:
        prompt = torch.randint(0, V, (6,), generator=g).tolist()
        # Outputs that repeat tokens, some of them also in the prompt.
        output = [prompt[0], prompt[0], 5, 5, 5, 19]
        # A copy per row: tests set fields (seed, logprobs) on their rows.
        seqs.append(make_seq(dataclasses.replace(CASES[name]), prompt, output))
    return logits, seqs


@pytest.mark.parametrize("name", list(CASES))
def test_each_control_alone_matches_reference(name: str) -> None:
    logits, seqs = case_batch([name])
    got = process_logits(logits, builder().build(seqs).metadata)
    assert_rows_match(got[0], reference_row(logits[0], seqs[0]))


def test_mixed_batch_matches_reference_row_by_row() -> None:
    names = list(CASES) * 2
    logits, seqs = case_batch(names, seed=3)
    got = process_logits(logits, builder().build(seqs).metadata)
    for i, seq in enumerate(seqs):
        assert_rows_match(got[i], reference_row(logits[i], seq))


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0] + [-9.0] * (V - 6)])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    seq = make_seq(params, prompt=[0, 4], output=[3, 3, 1])
    got = process_logits(logits, builder().build([seq]).metadata)[0, :6]
    # 0: prompt, positive: 2/2.  1: output once, negative: -1*2 - 0.5 - 0.25.  2: unseen.
    # 3: output twice: 3/2 - 2*0.5 - 0.25.  4: prompt, negative: -2*2.  5: unseen.
    expected = torch.tensor([1.0, -2.75, 0.5, 0.25, -4.0, 0.0])
    torch.testing.assert_close(got, expected)
    # Greedy follows the penalised logits: token 0, not the raw argmax 3.
    out = sample_batch(logits, builder().build([seq]).metadata)
    assert out.token_ids.tolist() == [0]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, V)
    logits[:, EOS] = 10.0  # EOS would win every time
    logits[:, 3] = 9.0
    seqs = [
        make_seq(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]), [1], [4]),
        make_seq(SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3]), [1], [4]),
        make_seq(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), [1]),
        make_seq(SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[3, V + 5]), [1]),
    ]
    tokens = sample_batch(logits, builder().build(seqs).metadata).token_ids.tolist()
    assert tokens[0] not in (EOS, 3)  # one output token, min_tokens 2: both banned
    assert tokens[1] == EOS  # min_tokens reached: nothing banned
    assert tokens[2] == EOS  # ignore_eos: EOS is an ordinary token, not banned
    assert tokens[3] not in (EOS, 3)  # an id past the vocabulary is ignored, not an error


def gumbel_of(seed: int, counter: int, vocab: int = V) -> torch.Tensor:
    """The noise a row with `seed` adds when sampling output position `counter`."""
    keys = row_keys_ref(torch.tensor([seed_bits(seed)]), torch.tensor([counter]))
    return gumbel_ref(keys, torch.arange(vocab).unsqueeze(0))[0]


def test_seeded_rows_draw_exactly_their_counter_based_noise() -> None:
    names = ["temperature", "top_k", "top_p", "min_p", "all", "greedy", "top_k_top_p"]
    logits, seqs = case_batch(names, seed=5)
    for i, seq in enumerate(seqs):
        seq.sampling_params.seed = 100 + i
    batch = builder().build(seqs)
    tokens = sample_batch(logits, batch.metadata).token_ids.tolist()
    for i, seq in enumerate(seqs):
        x = reference_row(logits[i], seq)
        # Output position 5 (six output tokens so far, no sample in flight in this batch).
        counter = seq.num_output_tokens - 1
        noisy = x + gumbel_of(100 + i, counter) if seq.sampling_params.temperature else x
        assert tokens[i] == int(noisy.argmax()), names[i]


def test_seeded_row_ignores_the_rest_of_the_batch() -> None:
    logits, seqs = case_batch(["all", "top_p", "temperature", "min_p"], seed=6)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    alone_seq = make_seq(params, [1, 2, 3], [7])
    alone = []
    for _ in range(6):
        out = sample_batch(logits[1:2], builder(1).build([alone_seq]).metadata).token_ids
        alone.append(out.item())
        alone_seq.token_ids.append(alone[-1])
    crowd_seq = make_seq(params, [1, 2, 3], [7])
    crowd = []
    for step in range(6):
        # Other rows, another builder seed, and a different position each step.
        batch = seqs[: step % 4] + [crowd_seq] + seqs[step % 4 :]
        rows = torch.cat([logits[: step % 4], logits[1:2], logits[step % 4 :]])
        out = sample_batch(rows, builder(step).build(batch).metadata).token_ids
        crowd.append(out[step % 4].item())
        crowd_seq.token_ids.append(crowd[-1])
    assert crowd == alone
    assert len(set(alone)) > 1  # the counter moves on from position to position


def test_unseeded_rows_get_their_own_seeds_from_the_builder_seed() -> None:
    logits, _ = case_batch(["temperature"] * 8, seed=7)
    params = SamplingParams(temperature=1.0)

    def run(seed: int) -> list[int]:
        seqs = [make_seq(dataclasses.replace(params), [1], [2]) for _ in range(8)]
        return sample_batch(logits, builder(seed).build(seqs).metadata).token_ids.tolist()

    assert run(0) == run(0)  # the same requests in the same order repeat themselves
    assert run(0) != run(1)
    # Equal logits in every row, yet rows do not share noise.
    same = logits[:1].expand(8, V).contiguous()
    seqs = [make_seq(dataclasses.replace(params), [1], [2]) for _ in range(8)]
    assert len(set(sample_batch(same, builder().build(seqs).metadata).token_ids.tolist())) > 1


def test_sampling_follows_the_truncated_distribution() -> None:
    g = torch.Generator().manual_seed(2)
    row = 2.0 * torch.randn(V, generator=g)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.8, min_p=0.02)
    seq = make_seq(params, [1])
    expected = torch.softmax(reference_row(row, seq), -1)
    n = 20_000
    batch = builder().build([seq] * n)
    tokens = sample_batch(row.expand(n, V).contiguous(), batch.metadata).token_ids
    freq = torch.bincount(tokens, minlength=V).float() / n
    # 20k draws: the standard error of each frequency is below 0.004.
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)
    assert freq[expected == 0].sum() == 0


def test_logprobs_are_raw_log_softmax_with_top_k_and_rank() -> None:
    logits, seqs = case_batch(["all", "greedy", "temperature", "top_k"], seed=8)
    for seq, k in zip(seqs, (3, 0, None, 5), strict=True):
        seq.sampling_params.logprobs = k
    batch = builder().build(seqs)
    assert batch.metadata.logprob_rows.tolist() == [0, 1, 3]
    assert batch.logprob_seqs == [seqs[0], seqs[1], seqs[3]]
    out = sample_batch(logits, batch.metadata)
    assert out.logprobs is not None
    for j, row in enumerate(batch.metadata.logprob_rows.tolist()):
        ref = torch.log_softmax(logits[row], -1)  # before penalties and temperature
        chosen = int(out.token_ids[row])
        assert out.logprobs.token_ids[j, 0] == chosen
        torch.testing.assert_close(out.logprobs.logprobs[j, 0], ref[chosen])
        assert out.logprobs.ranks[j] == 1 + int((ref > ref[chosen]).sum())
        top = ref.topk(5)
        assert out.logprobs.token_ids[j, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(out.logprobs.logprobs[j, 1:], top.values)


class _Calls(TorchFunctionMode):
    """Records the torch functions called, with the shape of their first tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...] | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        name = getattr(func, "__name__", str(func))
        self.calls.append((name, tuple(first.shape) if first is not None else None))
        return func(*args, **(kwargs or {}))

    def shapes(self, name: str) -> list[tuple[int, ...] | None]:
        return [shape for called, shape in self.calls if called == name]


def test_greedy_batch_takes_argmax_without_softmax_or_sort() -> None:
    logits, seqs = case_batch(["greedy"] * 4)
    batch = builder().build(seqs)
    with _Calls() as calls:
        tokens = sample_batch(logits, batch.metadata)
    assert tokens.token_ids.tolist() == logits.argmax(-1).tolist()
    names = {name for name, _ in calls.calls}
    assert not names & {"sort", "topk", "softmax", "exponential_"}, names


def test_each_group_takes_its_own_path() -> None:
    """Only the row with top-p and no top-k is sorted; the row with a top-k bound takes one
    topk of its own (k + 1 wide); greedy, temperature and min-p rows share one pass."""
    names = ["greedy", "temperature", "top_p", "min_p", "top_k_top_p", "greedy"]
    logits, seqs = case_batch(names)
    md = builder().build(seqs).metadata
    paths = {g.path.value: g.out_rows.tolist() for g in md.groups}
    assert paths == {"one_pass": [0, 1, 3, 5], "top_k": [4], "full_sort": [2]}
    with _Calls() as calls:
        sample_batch(logits, md)
    assert calls.shapes("sort") == [(1, V)]
    assert calls.shapes("topk") == [(1, V)]
    # Greedy rows with nothing random beside them: one argmax, no noise.
    md = builder().build(case_batch(["greedy", "top_k"])[1]).metadata
    assert {g.path.value: g.out_rows.tolist() for g in md.groups} == {"argmax": [0], "top_k": [1]}


def temperature_only(logits: torch.Tensor, temps: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """sample_batch with nothing but per-row temperatures (greedy where 0); row i has seed
    `seed + i`, at output position 0."""
    n = logits.shape[0]
    groups = plan_groups(
        cpu_put(), logits.shape[1], temps.numpy(), np.arange(n) + seed, np.zeros(n, np.int64)
    )
    return sample_batch(logits, SamplingMetadata(num_rows=n, groups=groups)).token_ids


def test_temperature_only_sampling() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7])
    a = temperature_only(logits, temps, 5)
    b = temperature_only(logits, temps, 5)
    assert a.tolist() == b.tolist()  # the seeds make sampling reproducible
    assert a[0] == logits[0].argmax() and a[2] == logits[2].argmax()
    assert temperature_only(logits, torch.zeros(4)).tolist() == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="must be"):
        sample_batch(torch.zeros(3, 4), SamplingMetadata(num_rows=2))
    assert sample_for_profiling(logits).shape == (4,)
    profile_sampling(logits, 2)  # two sampled rows, two prompt-logprob rows


def test_temperature_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).expand(20_000, -1).contiguous()
    # Temperature 0.5 squares and renormalises the probabilities.
    tokens = temperature_only(logits, torch.full((20_000,), 0.5), 3)
    freq = torch.bincount(tokens, minlength=3).float() / 20_000
    p = torch.tensor([0.36, 0.09, 0.01]) / 0.46
    torch.testing.assert_close(freq, p, atol=0.02, rtol=0)
    assert math.isclose(float(freq.sum()), 1.0)


def test_logprob_rank_counts_ties_ahead_like_vllm() -> None:
    from tp_engine.core.sampling.logprob_tensors import gather_logprobs

    logprobs = torch.log_softmax(torch.tensor([[2.0, 2.0, 1.0, 0.0]]), dim=-1)
    # Token 0 is tied with token 1 for first place: vLLM ranks it 2 (tokens at least as likely).
    out = gather_logprobs(logprobs, torch.tensor([0]), num_top=0)
    assert out.ranks.tolist() == [2]
    assert gather_logprobs(logprobs, torch.tensor([2]), num_top=0).ranks.tolist() == [3]


# -- top-k + top-p from the top-k slice, against the full sort ----------------------------------


def _truncation_case(num_rows: int, vocab: int, seed: int, ties: bool) -> tuple[torch.Tensor, ...]:
    """Logits (integers when `ties`: many equal values, tail groups straddling the top-k slice),
    top_k in [1, 30] and top_p in (0, 1] with some rows off."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(0, 6, (num_rows, vocab), generator=g).float()
    else:
        logits = 3.0 * torch.randn(num_rows, vocab, generator=g)
    top_k = torch.randint(1, 31, (num_rows,), generator=g)
    top_p = torch.rand(num_rows, generator=g) * 0.99 + 0.005
    top_p[::5] = 1.0  # top-p off on some rows
    return logits, top_k, top_p


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("seed", range(3))
def test_bounded_top_k_top_p_equals_the_full_sort(seed: int, ties: bool) -> None:
    from tp_engine.core.sampling.filters import apply_top_k_top_p, top_k_top_p_full_sort

    logits, top_k, top_p = _truncation_case(64, 500, seed, ties)
    with _Calls() as calls:
        fast = apply_top_k_top_p(logits, top_k, top_p, int(top_k.max()))
    assert not [s for s in calls.shapes("sort") if s and s[-1] == 500]  # no sort of the row
    full = top_k_top_p_full_sort(logits, top_k, top_p)
    assert torch.equal(torch.isinf(fast), torch.isinf(full))
    assert torch.equal(fast[~torch.isinf(fast)], logits[~torch.isinf(full)])


def test_bounded_top_k_top_p_follows_the_documented_semantics_with_ties() -> None:
    """Row by row against the reference: ties at the k-th value kept by top-k, then top-p over
    equally likely tokens in increasing id, the most likely token always kept."""
    from tp_engine.core.sampling.filters import apply_top_k_top_p

    rows = [
        # (logits, top_k, top_p): a tie group of 6 at the 2nd value, cut inside by top-p
        ([4.0, 3.0, 3.0, 1.0, 3.0, 3.0, 3.0, 0.0, 3.0], 2, 0.6),
        # the whole row one tie group: top-k keeps it all, top-p keeps its first half
        ([2.0] * 9, 3, 0.5),
        # the tie group is the most likely group and top_p is tiny: one token survives
        ([4.0, 4.0, 4.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], 1, 0.01),
        # top-p off: top-k with all its ties
        ([1.0, 5.0, 5.0, 5.0, 0.0, 5.0, 2.0, 2.0, 2.0], 2, 1.0),
        # -inf tokens (as min-p leaves them) tied at the k-th value
        ([3.0, NEG_INF, 1.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF, NEG_INF], 4, 0.9),
    ]
    logits = torch.tensor([r[0] for r in rows])
    top_k = torch.tensor([r[1] for r in rows])
    top_p = torch.tensor([r[2] for r in rows])
    got = apply_top_k_top_p(logits, top_k, top_p, max_k=4)
    for i, (row, k, p) in enumerate(rows):
        x = torch.tensor(row)
        kth = sorted(row, reverse=True)[k - 1]
        x[x < kth] = NEG_INF
        probs, mass = torch.softmax(x, -1), 0.0
        for rank, t in enumerate(sorted(range(len(row)), key=lambda t: -x[t].item())):
            if rank > 0 and p < 1.0 and mass >= p:
                x[t] = NEG_INF
            mass += probs[t].item()
        assert_rows_match(got[i], x)
    # p(4) = 0.31, each 3 = 0.11: the first three of the tie group (ids 1, 2, 4) make it.
    assert torch.isfinite(got[0]).tolist() == [True, True, True, False, True] + [False] * 4
    assert int(torch.isfinite(got[1]).sum()) == 5  # mass before the 5th is 4/9 < 0.5


def test_qwen3_defaults_sample_without_sorting_the_vocabulary() -> None:
    """temperature 0.6, top_k 20, top_p 0.95 on Qwen3's vocabulary: top-k slice only, and the
    result equals the full sort's."""
    from tp_engine.core.sampling import SamplingMetadata
    from tp_engine.core.sampling.filters import top_k_top_p_full_sort

    rows, vocab = 4, 151_936
    logits = 4.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4))
    groups = plan_groups(
        cpu_put(), vocab, np.full(rows, 0.6), np.arange(rows), np.zeros(rows, np.int64),
        top_k=np.full(rows, 20), top_p=np.full(rows, 0.95),
    )  # fmt: skip
    md = SamplingMetadata(num_rows=rows, groups=groups)
    top_k, top_p = torch.full((rows,), 20), torch.full((rows,), 0.95)
    with _Calls() as calls:
        sample_batch(logits, md)
    assert calls.shapes("sort") == [] and calls.shapes("topk") == [(rows, vocab)]
    with _Calls() as calls:
        got = process_logits(logits, md)
    assert calls.shapes("sort") == []
    full = top_k_top_p_full_sort(logits * md.groups[0].inv_temp[0], top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(full))
    assert 1 <= int(torch.isfinite(got).sum(-1).max()) <= 20


def test_a_spent_thinking_budget_forces_the_end_of_thinking() -> None:
    # Tokens 3 and 4 stand for <think> and </think>; the budget is 2 thinking tokens.
    budget = dict(thinking_token_budget=2, think_start_token_id=3, think_end_token_id=4)
    logits = torch.zeros(4, V)
    logits[:, 9] = 10.0  # the model would never end its thinking
    seqs = [
        make_seq(SamplingParams(temperature=0.0, **budget), [1], [3, 9, 9]),  # spent: forced
        make_seq(SamplingParams(temperature=0.0, **budget), [1], [3, 9]),  # one left
        make_seq(SamplingParams(temperature=0.0, **budget), [1], [3, 9, 4, 9]),  # ended itself
        make_seq(SamplingParams(temperature=1.0, logprobs=1, **budget), [1], [3, 9, 9]),
    ]
    batch = builder().build(seqs)
    out = sample_batch(logits, batch.metadata)
    assert out.token_ids.tolist() == [4, 9, 9, 4]
    # The logprob reported is the forced token's own (raw) one.
    assert out.logprobs is not None and out.logprobs.token_ids[0, 0] == 4
    torch.testing.assert_close(out.logprobs.logprobs[0, 0], torch.log_softmax(logits[3], -1)[4])


# -- logits processors: logit_bias, allowed_token_ids, bad_words -------------------------------


def test_logit_bias_plus_100_is_taken_and_minus_100_never() -> None:
    logits = 3.0 * torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    top = logits.argmax(-1).tolist()
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logit_bias={11: 100.0}), [1]),
        make_seq(SamplingParams(temperature=0.0, logit_bias={str(top[1]): -100}), [1]),
        make_seq(SamplingParams(temperature=1.0, logit_bias={top[2]: -100.0, 5: 0.5}), [1]),
        make_seq(SamplingParams(temperature=0.0), [1]),
    ]
    md = builder().build(seqs).metadata
    got = process_logits(logits, md)
    torch.testing.assert_close(got[0, 11], logits[0, 11] + 100)
    torch.testing.assert_close(got[2, 5], logits[2, 5] + 0.5)
    assert torch.equal(got[3], logits[3])  # a row that asks for nothing is untouched
    tokens = sample_batch(logits, md).token_ids.tolist()
    assert tokens[0] == 11 and tokens[1] != top[1] and tokens[3] == top[3]
    draws = sample_batch(
        logits[2:3].expand(2000, V).contiguous(), builder().build([seqs[2]] * 2000).metadata
    )
    assert top[2] not in draws.token_ids.tolist()


def test_allowed_token_ids_mask_only_the_rows_that_ask() -> None:
    logits = 3.0 * torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    allowed = [2, 9, 30]
    seqs = [
        make_seq(SamplingParams(temperature=0.0), [1]),
        make_seq(SamplingParams(temperature=1.0, allowed_token_ids=allowed), [1]),
        make_seq(SamplingParams(temperature=0.0, allowed_token_ids=[30, 30]), [1]),
    ]
    md = builder().build(seqs).metadata
    with _Calls() as calls:
        got = process_logits(logits, md)
    # One [2, V] mask for the two rows that ask, none for the third row.
    assert calls.shapes("masked_fill") == [(2, V)] and got.shape == (3, V)
    assert torch.equal(got[0], logits[0])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == allowed
    torch.testing.assert_close(got[1, allowed], logits[1, allowed] / 1.0)
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [30]
    # Flat logits: every allowed token is drawn, nothing else.
    tokens = sample_batch(torch.zeros(500, V), builder().build([seqs[1]] * 500).metadata)
    assert set(tokens.token_ids.tolist()) == set(allowed)


def test_bad_words_ban_the_last_token_after_the_rest_was_generated() -> None:
    logits = torch.zeros(4, V)
    # Sequences: [5, 6] (two tokens), [8] (one token, always banned), [5, 6, 9].
    words = [[5, 6], [8], [5, 6, 9]]
    seqs = [
        make_seq(SamplingParams(temperature=0.0, bad_words_token_ids=words), [1], [3, 5]),
        make_seq(SamplingParams(temperature=0.0, bad_words_token_ids=words), [1], [5, 6]),
        make_seq(SamplingParams(temperature=0.0, bad_words_token_ids=words), [5], []),
        make_seq(SamplingParams(temperature=0.0), [1], [5]),
    ]
    got = process_logits(logits, builder().build(seqs).metadata)
    banned = [torch.isinf(row).nonzero().flatten().tolist() for row in got]
    # Output ends with 5: 6 banned; ends with 5, 6: 9 banned; the prompt's 5 does not count
    # (vLLM's rule looks at output tokens); the last row asked for nothing.
    assert banned == [[6, 8], [8, 9], [8], []]


def test_bias_applies_before_penalties_and_masks_win() -> None:
    logits = torch.zeros(1, V)
    logits[0, 4] = 2.0
    params = SamplingParams(
        temperature=0.0,
        logit_bias={4: 2.0, 6: 50.0},
        repetition_penalty=2.0,
        allowed_token_ids=[4, 5],
    )
    got = process_logits(logits, builder().build([make_seq(params, [4])]).metadata)
    # (2 + 2) / 2 = 2 (vLLM's order: bias, then the penalty); 6's bias cannot undo its mask.
    assert got[0, 4].item() == 2.0 and got[0, 5].item() == 0.0
    assert torch.isinf(got[0, 6]) and int(torch.isfinite(got[0]).sum()) == 2


def test_no_row_asking_means_no_edit() -> None:
    _, seqs = case_batch(["greedy", "temperature", "top_k"])
    assert builder().build(seqs).metadata.logits_edits == ()


def test_processors_follow_rows_that_change_hands() -> None:
    b = SamplingBatchBuilder(V, [EOS], torch.device("cpu"), 0)
    batch = RunningBatch(2, 1, 10_000)
    biased = make_seq(SamplingParams(temperature=0.0, logit_bias={3: 100.0}), [1])
    plain = make_seq(SamplingParams(temperature=0.0), [1])
    logits = torch.zeros(1, V)
    row = batch.add(biased)
    rows = np.array([row])
    assert sample_batch(logits, b.build(batch, rows).metadata).token_ids.tolist() == [3]
    batch.remove(biased)
    assert batch.add(plain) == row  # the same row, another sequence: no bias left behind
    assert b.build(batch, rows).metadata.logits_edits == ()
    # A row whose sequence stopped since the step was scheduled gets no edit either.
    batch.remove(plain)
    batch.add(biased)
    assert b.build(batch, rows, np.array([False])).metadata.logits_edits == ()


def test_penalty_counts_follow_each_sequence_across_steps() -> None:
    """The device-side token counts are filled once per row and then only take each step's new
    tokens: over many steps, with rows handed to new sequences (slot reuse) and more penalised
    rows than slots at first (growth), every step's logits equal the reference built from the
    whole token lists."""
    b = SamplingBatchBuilder(V, [EOS], torch.device("cpu"), 0)
    batch = RunningBatch(8, 1, 10_000)
    b.follow(batch)
    g = torch.Generator().manual_seed(11)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.2),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.3),
    ]
    live: list[Sequence] = []
    for step in range(12):
        if step % 4 == 0:  # one sequence leaves, two arrive: rows and slots change hands
            if live:
                batch.remove(live.pop(0))
            for k in range(2):
                prompt = torch.randint(0, V, (5,), generator=g).tolist()
                seq = make_seq(dataclasses.replace(params[(step + k) % 3]), prompt)
                batch.add(seq)
                live.append(seq)
        rows = np.array([seq.row for seq in live], dtype=np.int32)
        logits = 3.0 * torch.randn(len(live), V, generator=g)
        got = process_logits(logits, b.build(batch, rows).metadata)
        for i, seq in enumerate(live):
            assert_rows_match(got[i], reference_row(logits[i], seq))
            # Tokens that repeat, so that counts above one matter.
            seq.token_ids.append(int(torch.randint(0, 6, (1,), generator=g)))


def test_the_memory_profile_holds_every_rows_penalty_counts_while_it_samples() -> None:
    """The warm-up's sampling peak must include what TokenCounts keeps between steps (int32
    counts and a bool prompt mask per penalised row): the peak of live vocabulary-sized bytes
    during `profile_sampling` exceeds the same sampling without them by exactly that."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class LivePeak(TorchDispatchMode):
        def __init__(self, vocab: int) -> None:
            super().__init__()
            self.vocab, self.live, self.peak = vocab, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                    continue  # in place, or a view: no new memory
                if self.vocab in t.shape:
                    size = t.numel() * t.element_size()
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, size)
            return out

        def _free(self, size: int) -> None:
            self.live -= size

    rows, vocab = 6, 1000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    sample_for_profiling(logits)  # first-call caches, outside the count
    with LivePeak(vocab) as with_counts:
        profile_sampling(logits, rows)
    with LivePeak(vocab) as without:
        sample_for_profiling(logits)
    assert with_counts.peak - without.peak == rows * vocab * (4 + 1)
