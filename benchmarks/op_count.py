"""How many device operations a forward pass launches, per decoder layer, counted on any machine.

At small batch a GPU decode step is launch bound: every kernel costs a few microseconds of
launch and of idle gaps whatever it computes, so the number of launches per layer is the figure
that fused kernels move (GPU-PREFLIGHT item 1). It does not need a GPU to count: the model runs
the same Python on CPU, with the project's Triton kernels under the interpreter.

What counts (`OpCounter.count`), once each:
- an aten operation that does work on the device: not a bare allocation (`empty*`, which
  launches nothing), and not an op whose result aliases its input (a view, or a cast that had
  nothing to do); a copy, a real cast, a fill, an `.item()` sync and a collective all count.
  Count in the dtype the GPU serves in (bf16): casts that are no-ops in fp32 are kernels there;
- a Triton kernel launch. The interpreter's own staging inside a launch (it dispatches
  `new_empty`, `set_` and `copy_` for every tensor argument) is not counted: counting pauses
  for the duration of the launch (`benchmarks.triton_launches.triton_launch_hook`).

`OpCounter.count_non_metadata` is the looser rule the figures in issue 19 were taken with
(every dispatched op whose name is not a metadata op, allocations and casts included).
On CPU a `.to(device)` that is a host-to-device copy on a GPU is a no-op and is not counted
(the torch attention backend has two per layer).

`count_decode_step` runs one eager decode step of a small random Qwen3 and attributes the
operations to the decoder layer that issued them (module hooks); `launch/bench_hot_path.py
ops` writes the figures under `ops_per_layer` in a result file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.triton_launches import kernel_name, triton_launch_hook

_aten = torch.ops.aten
# Allocations launch no kernel.
_ALLOCATIONS = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
}
# Metadata-only ops by name: what a count of "every dispatched op but the views" leaves out
# (the rule of the figures quoted in issue 19; it counts allocations and no-op casts).
METADATA_OP_NAMES = frozenset({
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "chunk", "split",
    "split_with_sizes", "slice", "select", "t", "transpose", "permute", "expand", "as_strided",
    "alias", "detach", "narrow", "unbind", "set_",
})  # fmt: skip


def _storage(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def launched_work(func: Any, args: tuple, out: Any) -> bool:
    """Whether an aten op that just ran did work on the device.

    Not an allocation, and not an op whose result aliases its input: a view, or a cast or
    `reshape` that had nothing to do (`x.float()` on fp32 returns x). The same op that had to
    copy (a real cast, a `reshape` of a non-contiguous tensor) is work.
    """
    if func in _ALLOCATIONS or func.overloadpacket.__name__ == "set_":
        return False
    if getattr(func, "is_view", False):
        first = args[0] if args else None
        return isinstance(out, torch.Tensor) and _storage(out) != _storage(first)
    return True


class OpCounter(TorchDispatchMode):
    """Counts operations by scope: those that launch work (see the module docstring), and every
    dispatched op that is not metadata-only by name (`METADATA_OP_NAMES`).

    `scope` is a label the caller sets (e.g. from module hooks) and every operation is filed
    under the scope current at the time; None is "outside any scope".
    """

    def __init__(self) -> None:
        super().__init__()
        # (scope, op name, launched work) in dispatch order; Triton launches are "triton:<name>".
        self.ops: list[tuple[str | None, str, bool]] = []
        self.scope: str | None = None
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._paused:
            name = str(func.overloadpacket.__name__)
            self.ops.append((self.scope, name, launched_work(func, args, out)))
        return out

    def _triton(self, kernel: Any, args: tuple, kwargs: dict, launch: Any) -> Any:
        if not self._paused:
            self.ops.append((self.scope, f"triton:{kernel_name(kernel)}", True))
        self._paused += 1
        try:
            return launch()
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[OpCounter]:
        with triton_launch_hook(self._triton), self:
            yield self

    def count(self, scope: str | None = None) -> int:
        """Operations that launched work in `scope`."""
        return sum(1 for s, _, work in self.ops if s == scope and work)

    def count_non_metadata(self, scope: str | None = None) -> int:
        """Every dispatched op in `scope` not in `METADATA_OP_NAMES` (allocations and no-op
        casts included)."""
        return sum(1 for s, name, _ in self.ops if s == scope and name not in METADATA_OP_NAMES)

    def names(self, scope: str | None = None) -> Counter[str]:
        """Operations that launched work in `scope`, by name."""
        return Counter(name for s, name, work in self.ops if s == scope and work)


@contextlib.contextmanager
def layer_scopes(counter: OpCounter, layers: torch.nn.ModuleList) -> Iterator[None]:
    """File the operations of decoder layer i under scope `layer{i}`."""
    handles = []
    for i, layer in enumerate(layers):

        def enter(module, args, _name=f"layer{i}"):
            counter.scope = _name

        def leave(module, args, output):
            counter.scope = None

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# -- one decode step of a small model --------------------------------------------------------

# Qwen3-0.6B's proportions, shrunk: GQA 2:1, 2 layers. The count does not depend on the sizes.
SMALL_QWEN3 = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=256, seed=0,
)  # fmt: skip


def count_decode_step(
    model_dir: str | Path,
    *,
    attention_backend: str,
    num_seqs: int = 4,
    prompt_len: int = 24,
    block_size: int = 16,
    device: str = "cpu",
    dtype: str = "bfloat16",
    **runner_fields: Any,
) -> dict[str, Any]:
    """Prefill `num_seqs` prompts (not counted), then count one eager decode step.

    `runner_fields`: further `RunnerConfig` fields (e.g. the layer kernels' switch).
    Returns the count of the last layer (every layer but the first, which has no residual to
    add yet, launches the same), each layer's count, the last layer's operations by name, and the operations outside the layers (embedding, final norm, LM head and the
    step's input handling).
    """
    from rank_worker.runner.model_runner import ModelRunner, synthetic_plan
    from rank_worker.runner_config import RunnerConfig
    from rank_worker.tp import TPInfo

    config = RunnerConfig(
        max_model_len=prompt_len + 8,
        block_size=block_size,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=num_seqs * prompt_len,
        num_kv_blocks=num_seqs * (-(-(prompt_len + 8) // block_size)) + 1,
        attention_backend=attention_backend,
        dtype=dtype,
        enforce_eager=True,
        **runner_fields,
    )
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), device)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    blocks_per_seq = -(-(prompt_len + 1) // block_size)
    tables = [
        list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(num_seqs)
    ]
    runner.execute(synthetic_plan([(0, prompt_len, b) for b in tables]))
    decode = synthetic_plan([(prompt_len, 1, b) for b in tables])
    layers = runner.model.model.layers
    counter = OpCounter()
    with torch.inference_mode(), layer_scopes(counter, layers), counter.counting():
        runner.execute(decode)
    per_layer = [counter.count(f"layer{i}") for i in range(len(layers))]
    last = f"layer{len(layers) - 1}"
    return {
        # A layer after the first: the first has no residual to add yet (one op fewer).
        "ops_per_layer": counter.count(last),
        "non_metadata_ops_per_layer": counter.count_non_metadata(last),
        "ops_each_layer": per_layer,
        "layer_ops_by_name": dict(sorted(counter.names(last).items())),
        "ops_outside_layers": counter.count(None),
        "num_layers": len(layers),
        "attention_backend": runner.attention_backend.name,
        "dtype": dtype,
        "runner_fields": runner_fields,
        "num_seqs": num_seqs,
        "context_len": prompt_len + 1,
    }


def small_model_dir(root: str | Path | None = None) -> Path:
    """A small random Qwen3 (`SMALL_QWEN3`) written under `root` (a temporary dir if None)."""
    from tp_engine.testing import build_random_qwen3

    root = Path(root or tempfile.mkdtemp(prefix="op-count-"))
    return build_random_qwen3(root / "small-qwen3", **SMALL_QWEN3)


def interpreter_if_no_gpu() -> None:
    """Run Triton kernels in the interpreter where there is no GPU. Must run before `kernels` is
    first imported (Triton reads the variable when each kernel is decorated)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
