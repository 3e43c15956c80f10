"""nano-vllm's offline throughput workload, reproduced call for call.

nano-vllm's `bench.py` draws, after `random.seed(0)`, every prompt first (its length, then its
token ids) and then every output length, all with `random.randint` (both ends included). Keeping
the same order of calls keeps the same numbers: the default 256 sequences ask for 133,966 output
tokens, the figure its README reports throughput over.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Output tokens of nano-vllm's default workload; a drifted generator would compare apples to pears.
NANO_VLLM_OUTPUT_TOKENS = 133_966


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids and the exact number of tokens each must generate (ignore_eos)."""

    prompt_token_ids: list[list[int]]
    output_lens: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.output_lens)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompt_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(
    num_seqs: int = 256,
    min_input_len: int = 100,
    max_input_len: int = 1024,
    min_output_len: int = 100,
    max_output_len: int = 1024,
    max_token_id: int = 10_000,
    vocab_size: int | None = None,
    seed: int = 0,
) -> Workload:
    """nano-vllm's workload (defaults) or another shape drawn the same way.

    `vocab_size` smaller than `max_token_id + 1` (the tiny demo tokenizer) folds ids into the
    vocabulary with a modulo after drawing, so the lengths stay those of the unfolded workload.
    """
    if not 1 <= min_input_len <= max_input_len:
        raise ValueError(
            f"need 1 <= min_input_len <= max_input_len, got {min_input_len}, {max_input_len}"
        )
    if not 1 <= min_output_len <= max_output_len:
        raise ValueError(
            f"need 1 <= min_output_len <= max_output_len, got {min_output_len}, {max_output_len}"
        )
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, max_token_id) for _ in range(rng.randint(min_input_len, max_input_len))]
        for _ in range(num_seqs)
    ]
    output_lens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    if vocab_size is not None and vocab_size <= max_token_id:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return Workload(prompts, output_lens)


def repetition_workload(
    num_seqs: int = 64,
    passage_len: int = 64,
    copies: int = 3,
    output_len: int = 128,
    max_token_id: int = 10_000,
    vocab_size: int | None = None,
    seed: int = 0,
) -> Workload:
    """Prompts that repeat themselves, for speculative decoding: each is a random passage of
    `passage_len` tokens `copies` times over (a document quoted back, code being edited), so an
    output that continues the pattern is found by n-gram lookup. Every sequence generates
    `output_len` tokens (ignore_eos)."""
    if passage_len < 1 or copies < 1 or output_len < 1:
        raise ValueError("passage_len, copies and output_len must be >= 1")
    rng = random.Random(seed)
    limit = max_token_id if vocab_size is None else min(max_token_id, vocab_size - 1)
    prompts = []
    for _ in range(num_seqs):
        passage = [rng.randint(0, limit) for _ in range(passage_len)]
        prompts.append(passage * copies)
    return Workload(prompts, [output_len] * num_seqs)
