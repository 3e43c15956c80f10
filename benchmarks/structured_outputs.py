"""The per-step cost of structured outputs on rank 0: filling the token bitmask of the rows that
have a constraint, and applying it to their logits, at a 151,936-token vocabulary (Qwen3's).

    python benchmarks/structured_outputs.py --rows 1 64 256 --out result.json

No Qwen3 tokenizer is at hand (nothing downloads), so the vocabulary is synthetic: 151,643
byte-level tokens (the 256 bytes, then English-like sub-words with and without a leading space,
numbers and punctuation runs, as a BPE vocabulary has) plus Qwen3's special tokens, padded to
151,936 as the checkpoints are. xgrammar's mask cost depends on how many tokens a grammar state
cannot decide in advance, which a vocabulary of this shape reproduces; figures on a real one
will differ somewhat.

Each constrained row runs its own matcher of one JSON schema (an object with strings, an
integer, an enum, a boolean and an array), advanced every step by a token its mask allows
(drawn at random, so the rows sit in different states, inside strings and between keys, as a
real batch does; a matcher that completes starts again). Timed per step, over the batch:

    fill          GrammarState.fill for every constrained row, one after another (even steps)
    fill_batched  the rows through the engine's batched fill, `fill_bitmasks`, which spreads
                  them over xgrammar's threads (odd steps)
    apply         tp_engine.core.sampling.grammar_mask.apply_token_bitmask on [B, V] fp32 logits,
                  B = 256 rows of which `rows` are constrained; with `--device cuda` this
                  includes the bitmask's copy to the GPU, and ends with a synchronisation
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tp_engine.common.transfers import to_device_async
from tp_engine.core.sampling import GrammarMask
from tp_engine.core.sampling.grammar_mask import apply_token_bitmask
from tp_engine.features.structured.grammar import GrammarState, fill_bitmasks

VOCAB_SIZE = 151_936
NUM_REGULAR_TOKENS = 151_643
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "city", "age", "role", "active", "tags"],
}
BATCH = 256


def synthetic_vocab(seed: int = 0) -> list[str]:
    """Byte-level BPE-like tokens (GPT-2's byte-to-unicode alphabet, 'Ġ' a leading space)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    rng = random.Random(seed)
    onsets = [*"bcdfghjklmnprstvwyz", "ch", "sh", "th", "st", "tr", "pl", "gr", "br", ""]
    vowels = [*"aeiou", "ea", "ou", "io", "ai", "ee", "oo"]
    codas = [*"nrstlmdkg", "ng", "nd", "st", "ck", "", "", ""]
    vocab: dict[str, None] = dict.fromkeys(alphabet)
    punct = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    while len(vocab) < NUM_REGULAR_TOKENS:
        kind = rng.random()
        if kind < 0.80:
            word = "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.choice((1, 1, 2, 2, 3, 4)))
            )
            if rng.random() < 0.15:
                word = word.capitalize()
            token = ("Ġ" if rng.random() < 0.6 else "") + word
        elif kind < 0.90:
            token = ("Ġ" if rng.random() < 0.3 else "") + str(
                rng.randrange(10 ** rng.randint(1, 3))
            )
        else:
            token = "".join(rng.choice(punct) for _ in range(rng.randint(2, 3)))
            token = ("Ġ" if rng.random() < 0.3 else "") + token
        vocab[token] = None
    return [*vocab, *SPECIALS]


def compiled_schema() -> tuple[object, int]:
    import xgrammar as xgr

    vocab = synthetic_vocab()
    eos = vocab.index("<|im_end|>")
    info = xgr.TokenizerInfo(
        vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB_SIZE, stop_token_ids=[eos]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=4)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    print(f"compiled the schema in {time.perf_counter() - start:.3f} s", flush=True)
    return compiled, eos


def allowed_tokens(bitmask_row: torch.Tensor) -> torch.Tensor:
    bits = torch.arange(32, dtype=torch.int32)
    return torch.nonzero(((bitmask_row.unsqueeze(-1) >> bits) & 1).flatten()).flatten()


def time_rows(
    compiled: object, eos: int, rows: int, steps: int, seed: int, device: torch.device
) -> dict:
    rng = torch.Generator().manual_seed(seed)
    states = [GrammarState(compiled) for _ in range(rows)]
    words = (VOCAB_SIZE + 31) // 32
    bitmask = torch.empty((BATCH, words), dtype=torch.int32)
    logits = torch.randn(BATCH, VOCAB_SIZE, generator=rng).to(device)
    batch_rows = list(range(0, BATCH, BATCH // rows))[:rows]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    fill, fill_batched, apply = [], [], []
    for step in range(steps):
        # One fill per step, the two ways in turn: a second fill of the same states would find
        # the matchers' per-state work already done.
        start = time.perf_counter()
        if step % 2 == 0:
            for state, row in zip(states, batch_rows, strict=True):
                state.fill(bitmask, row)
            fill.append(time.perf_counter() - start)
        else:
            fill_bitmasks(states, bitmask, batch_rows)
            fill_batched.append(time.perf_counter() - start)
        work = logits.clone()
        _synchronize(device)
        start = time.perf_counter()
        on_device = to_device_async(bitmask, device)
        apply_token_bitmask(work, GrammarMask(on_device, tuple(batch_rows)))
        _synchronize(device)
        apply.append(time.perf_counter() - start)
        for i, state in enumerate(states):  # advance each row by one allowed token
            choices = allowed_tokens(bitmask[batch_rows[i]])
            token = int(choices[torch.randint(len(choices), (1,), generator=rng)])
            outputs[i].append(token)
            assert state.advance(outputs[i], 0)
            if state.matcher.is_terminated():
                states[i], outputs[i] = GrammarState(compiled), []
    return {
        "device": str(device),
        "constrained_rows": rows,
        "batch_rows": BATCH,
        "steps": steps,
        **{
            f"{name}_us_median": statistics.median(times) * 1e6
            for name, times in (("fill", fill), ("fill_batched", fill_batched), ("apply", apply))
        },
        **{
            f"{name}_us_p90": statistics.quantiles(times, n=10)[-1] * 1e6
            for name, times in (("fill", fill), ("fill_batched", fill_batched), ("apply", apply))
        },
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--device", default="cpu", help="where the logits are (cpu, cuda)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    compiled, eos = compiled_schema()
    results = []
    for rows in args.rows:
        result = time_rows(compiled, eos, rows, args.steps, seed=rows, device=device)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.write_text(json.dumps({"vocab_size": VOCAB_SIZE, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
