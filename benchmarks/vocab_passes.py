"""How many times one decode step's sampling reads and writes vocabulary-sized tensors, counted on
any machine through a torch dispatch mode.

Sampling is memory bound: at 256 rows x 151,936 float32 logits a pass over them is ~155 MB,
~50 us on an H100, and the rest of the step's sampling is small. So the figure that matters is
bytes moved in tensors with a vocabulary-sized dimension, in units of the logits' own size
("passes"). Counted (`VocabBytes`), for every aten op that does work (`op_count.launched_work`:
no views, allocations or no-op casts):

- read: every tensor argument with a dimension of size V, whole (an indexed write such as
  `index_put_` of a few entries counts its whole destination: an upper bound);
- written: every tensor result with a dimension of size V;
- a Triton kernel launch reads each tensor argument with a dimension of size V, whole (an upper
  bound for kernels that skip rows) and writes its vocabulary-sized results, which the sampling
  kernels have none of; the interpreter's own staging inside a launch is not counted.

`count_step` samples one step of `B` rows from `[B, V]` float32 logits through the engine's own
path (`SamplingBatchBuilder` over a `RunningBatch`, then `sample_batch`), for each of the
`SCENARIOS`; `python -m benchmarks.vocab_passes [--kernels]` prints and writes the table
(`--kernels`: the path a GPU takes, with the Triton sampling kernel under the interpreter; without
it, on CPU, the kernel's plain-torch reference, which materialises its noise).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.op_count import launched_work
from benchmarks.triton_launches import kernel_name, triton_launch_hook

QWEN3_VOCAB = 151_936


class VocabBytes(TorchDispatchMode):
    """Bytes read and written in tensors with a dimension of size `vocab_size` (see the module
    docstring), with the op that moved them, in dispatch order."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # (op name, bytes read, bytes written) for every op that moved vocabulary-sized bytes.
        self.ops: list[tuple[str, int, int]] = []
        self._paused = 0

    def _vocab_bytes(self, values: Any) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in tree_leaves(values)
            if isinstance(t, torch.Tensor) and self.vocab_size in t.shape
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._paused and launched_work(func, args, out):
            read = self._vocab_bytes((args, kwargs))
            written = self._vocab_bytes(out)
            if read or written:
                self.ops.append((str(func.overloadpacket.__name__), read, written))
        return out

    def _triton(self, kernel: Any, args: tuple, kwargs: dict, launch: Any) -> Any:
        if not self._paused:
            read = self._vocab_bytes((args, kwargs))
            if read:
                self.ops.append((f"triton:{kernel_name(kernel)}", read, 0))
        self._paused += 1
        try:
            return launch()
        finally:
            self._paused -= 1

    def __enter__(self):
        self._hook = triton_launch_hook(self._triton)
        self._hook.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hook.__exit__(*exc)

    @property
    def read(self) -> int:
        return sum(r for _, r, _ in self.ops)

    @property
    def written(self) -> int:
        return sum(w for _, _, w in self.ops)


# name -> (the batch's sampling parameters as SamplingParams keyword dicts, cycled over rows)
SCENARIOS: dict[str, list[dict[str, Any]]] = {
    "greedy": [dict(temperature=0.0)],
    "temperature": [dict(temperature=0.7)],
    "greedy+temperature": [dict(temperature=0.0), dict(temperature=0.7)],
    "temperature, seeded": [dict(temperature=0.7, seed=5)],
    "qwen3 defaults (T 0.6, top_k 20, top_p 0.95)": [dict(temperature=0.6, top_k=20, top_p=0.95)],
    "top_k 50": [dict(temperature=1.0, top_k=50)],
    "min_p 0.1": [dict(temperature=1.0, min_p=0.1)],
    "top_p 0.9 (no top_k)": [dict(temperature=1.0, top_p=0.9)],
    "temperature, 1 row logit_bias": [
        dict(temperature=0.7, logit_bias={11: 5.0}),
        *[dict(temperature=0.7)] * 7,
    ],
    "temperature, 1 row logprobs": [
        dict(temperature=0.7, logprobs=5),
        *[dict(temperature=0.7)] * 7,
    ],
    "temperature, 1 row penalties": [
        dict(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5),
        *[dict(temperature=0.7)] * 7,
    ],
}


def _kernel_path(kernels: bool) -> Any:
    if not kernels:
        return contextlib.nullcontext()
    from tp_engine.core.sampling.sampler import sampling_kernels

    return sampling_kernels()


def count_step(
    params: list[dict[str, Any]],
    num_rows: int = 8,
    vocab_size: int = QWEN3_VOCAB,
    kernels: bool = False,
) -> dict[str, Any]:
    """Build one step's sampling of `num_rows` decoding rows (params cycled) and count it;
    `kernels`: on CPU too, the path a GPU takes (the Triton kernel, under the interpreter)."""
    import numpy as np

    from tp_engine.core.running_batch import RunningBatch
    from tp_engine.core.sampling import sample_batch
    from tp_engine.core.sampling.batch import SamplingBatchBuilder
    from tp_engine.core.sequence import Sequence
    from tp_engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    logits = 4.0 * torch.randn(num_rows, vocab_size, generator=g)  # [B, V] fp32
    batch = RunningBatch(num_rows, 1, 10_000)
    builder = SamplingBatchBuilder(vocab_size, [0], torch.device("cpu"), 0)
    rows = []
    for i in range(num_rows):
        seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams(**params[i % len(params)]))
        seq.token_ids += [4, 5]  # two output tokens already (penalties have something to see)
        rows.append(batch.add(seq))
    built = builder.build(batch, np.asarray(rows, dtype=np.intp))
    with _kernel_path(kernels):
        sample_batch(logits, built.metadata)  # first-call work (lazy imports) out of the count
        counter = VocabBytes(vocab_size)
        with torch.inference_mode(), counter:
            sample_batch(logits, built.metadata)
    logits_bytes = logits.numel() * logits.element_size()
    return {
        "read_bytes": counter.read,
        "written_bytes": counter.written,
        "logits_bytes": logits_bytes,
        "reads": round(counter.read / logits_bytes, 3),
        "writes": round(counter.written / logits_bytes, 3),
        "ops": [
            f"{name} r{read / logits_bytes:.3g} w{written / logits_bytes:.3g}"
            for name, read, written in counter.ops
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    parser.add_argument("--label", default="after")
    parser.add_argument("--output-json", type=Path)
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="count the GPU's path: the sampling kernel (under the Triton interpreter on CPU)",
    )
    args = parser.parse_args(argv)
    if args.kernels and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported
    results = {
        name: count_step(p, args.rows, args.vocab, args.kernels) for name, p in SCENARIOS.items()
    }
    print(f"{args.label}: vocabulary-sized bytes per decode step, {args.rows} x {args.vocab} fp32")
    print(f"kernels={args.kernels} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
    print("(passes = bytes / the logits' size)")
    for name, r in results.items():
        print(f"  {name:48s} read {r['reads']:7.3f}  written {r['writes']:7.3f}")
        for op in r["ops"]:
            print(f"      {op}")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "label": args.label,
            "command": "python -m benchmarks.vocab_passes " + " ".join(argv or sys.argv[1:]),
            "kernels": args.kernels,
            "rows": args.rows,
            "vocab": args.vocab,
            "results": results,
        }
        args.output_json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
