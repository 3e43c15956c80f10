"""The LoRA term of one parallel linear layer, over slot stacks sharded as the layer is.

Ownership: `LoraManager` (`rank_worker.lora.manager`) makes one `LinearLoRA` per adapted
projection and hangs it on the layer (`_Linear.lora`), whose forward calls it between its
matmul and its all-reduce (`_Linear._adapt`). The stacks are plain tensors, not parameters:
checkpoint loading, weight updates and checksums never see them.

Sharding (Megatron's, as vLLM and SGLang do it), A `[r, in]`, B `[out, r]` per HF projection:
- column-parallel (qkv_proj, gate_up_proj): A whole on every rank; B cut by output rows per
  packed part, exactly as the base weight's rows (`OutputPart`, replicated KV heads included);
- row-parallel (o_proj, down_proj): A cut by input columns as the base weight is; B whole. The
  rank's partial `B (A_r x_r)` is added to its partial product before the one all-reduce,
  which then sums both (no extra communication).

`AdapterBatch` is the step's per-token slots in one fixed `[max_tokens]` buffer that every
`LinearLoRA` reads a prefix of (CUDA-graph safe: the address never changes; the runner copies
each step's slots into it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kernels.lora import (
    lora_apply_by_slot,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from kernels.lora_grouped import lora_expand_grouped, lora_shrink_grouped, lora_token_groups
from rank_worker.models.layers.linear import ColumnParallelBase, RowParallelLinear


class OutputPart(NamedTuple):
    """Where one HF projection's output rows sit in this rank's shard of a packed layer."""

    proj: str  # the HF projection ("q_proj", ...)
    full_rows: int  # its rows in the unsplit model
    first_row: int  # the first of them this rank holds
    rows: int  # how many it holds
    offset: int  # where they start in the rank's local output


def output_parts(layer: torch.nn.Module, projs: tuple[str, ...]) -> list[OutputPart]:
    """This rank's rows of each HF projection packed in `layer` (in `projs` order): the layer's
    own parts, the cut its weight loader makes."""
    if isinstance(layer, ColumnParallelBase):
        return [
            OutputPart(proj, *part) for proj, part in zip(projs, layer.parts.values(), strict=True)
        ]
    if isinstance(layer, RowParallelLinear):
        return [OutputPart(projs[0], layer.output_size, 0, layer.output_size, 0)]
    raise TypeError(f"no LoRA for {type(layer).__name__}")


# Eager steps of at least this many tokens run the grouped (SGMV) kernels; smaller ones, and
# every decode graph, the per-token (BGMV) ones. Not tuned on a GPU yet.
GROUPED_MIN_TOKENS = 64


class AdapterBatch:
    """The step's adapter slot per token, in a buffer whose address never changes; for a large
    eager step also its tokens grouped by slot (`groups`, for the grouped kernels)."""

    def __init__(
        self, max_tokens: int, device: torch.device, num_slots: int, grouped: bool
    ) -> None:
        """`grouped`: the layers run the Triton kernels, which can take the grouped form."""
        self.token_slots = torch.full(
            (max_tokens,), -1, dtype=torch.int32, device=device
        )  # [T_max]
        self._bound = 0  # tokens of the last step bound: slots past it are all -1
        # No token of the step has an adapter: an eager forward skips every LoRA term (vLLM's
        # `no_lora_flag_cpu`), and a decode replays the graph captured without them. A host
        # fact, so deciding costs no sync.
        self.skip = False
        self.num_slots = num_slots
        self.grouped = grouped
        # (order, starts) of `kernels.lora.lora_token_groups` for this step, or None.
        self.groups: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind(self, slots: torch.Tensor, any_adapter: bool = True) -> None:
        """Take a step's `[T]` int32 slots (`StepInputs.adapter_slots`); `any_adapter` False
        when they are all -1 (the runner knows from the plan). The rest of the buffer is kept
        at -1, so the padding rows of a decode graph run the base model."""
        self.skip = not any_adapter
        num_tokens = slots.shape[0]
        if num_tokens > self.token_slots.shape[0]:
            raise ValueError(
                f"a step of {num_tokens} tokens exceeds the LoRA slot buffer "
                f"({self.token_slots.shape[0]} tokens)"
            )
        self.token_slots[:num_tokens].copy_(slots)
        if num_tokens < self._bound:
            self.token_slots[num_tokens : self._bound].fill_(-1)
        self._bound = num_tokens
        self.groups = None
        if self.grouped and any_adapter and num_tokens >= GROUPED_MIN_TOKENS:
            self.groups = lora_token_groups(self.slots(num_tokens), self.num_slots)

    def capture_mode(self, lora: bool) -> None:
        """Before capturing decode graphs, with the LoRA terms (per token: a graph replays
        whatever step comes, and groups made before it would be stale) or without them."""
        self.skip = not lora
        self.groups = None

    def slots(self, num_tokens: int) -> torch.Tensor:
        return self.token_slots[:num_tokens]  # [T] int32


class LinearLoRA:
    """The slot stacks of one layer and the term they add (see the module docstring)."""

    def __init__(
        self,
        layer: torch.nn.Module,
        projs: tuple[str, ...],
        batch: AdapterBatch,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        use_triton: bool,
        graph_safe: bool,
    ) -> None:
        self.parts = output_parts(layer, projs)
        self.row_parallel = isinstance(layer, RowParallelLinear)
        device = layer.weight.device
        if self.row_parallel:
            self.in_first = layer.tp.rank * layer.local_input_size
            in_local, self.in_full = layer.local_input_size, layer.input_size
        else:
            in_local = self.in_full = layer.input_size
            self.in_first = 0
        out_local = sum(part.rows for part in self.parts)
        self.batch = batch
        # [S, P, R, K_local] and [S, N_local, R]; zero = no adapter (see `kernels.lora`).
        self.a = torch.zeros((max_loras, len(self.parts), max_rank, in_local), dtype=dtype,
                             device=device)  # fmt: skip
        self.b = torch.zeros((max_loras, out_local, max_rank), dtype=dtype, device=device)
        bounds = [part.offset for part in self.parts] + [out_local]
        # [P+1] part bounds: on the device for the kernel, on the host for the torch path.
        self.offsets = torch.tensor(bounds, dtype=torch.int32, device=device)
        self.widest_part = max(part.rows for part in self.parts)
        self._apply = self._choose_path(use_triton, graph_safe, bounds)

    def _choose_path(
        self, use_triton: bool, graph_safe: bool, bounds: list[int]
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """`(x, y, slots)` adding the terms into y: the Triton kernels; else, where a CUDA
        graph may capture it (`graph_safe`: a GPU, or its paths run on CPU), the masked torch
        reference; else (CPU) the by-slot gather, whose cost follows the adapters' tokens."""
        if use_triton:
            return self._triton
        if not graph_safe:
            return lambda x, y, slots: lora_apply_by_slot(y, x, self.a, self.b, slots, bounds)
        return lambda x, y, slots: lora_expand_ref(
            y, lora_shrink_ref(x, self.a, slots), self.b, slots, bounds
        )

    def _triton(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> None:
        """The kernels: grouped by slot when the step has groups of these rows, else per token
        (a decode graph's padded rows are more than the step's tokens its groups cover)."""
        groups = self.batch.groups
        if groups is None or groups[0].shape[0] != x.shape[0]:
            h = lora_shrink(x, self.a, slots)  # [T, P, R] fp32
            lora_expand(y, h, self.b, slots, self.offsets, self.widest_part)
        else:
            h = lora_shrink_grouped(x, self.a, groups)
            lora_expand_grouped(y, h, self.b, groups, self.offsets, self.widest_part)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (this rank's `x @ W.T`, before any all-reduce) plus each token's LoRA term."""
        if self.batch.skip:
            return y
        self._apply(x, y, self.batch.slots(x.shape[0]))
        return y

    def shard(
        self, weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's `(a [P, R, K_local], b [N_local, R])` of one adapter, from full PEFT
        matrices by HF projection (`A [r, in]`, `B [out, r]`, scaling); a projection the
        adapter leaves out stays zero. ValueError on a shape the model cannot take."""
        a = torch.zeros(self.a.shape[1:], dtype=self.a.dtype)
        b = torch.zeros(self.b.shape[1:], dtype=self.b.dtype)
        max_rank = self.a.shape[2]
        for p, part in enumerate(self.parts):
            if part.proj not in weights:
                continue
            lora_a, lora_b, scaling = weights[part.proj]
            r = lora_a.shape[0]
            if lora_a.shape != (r, self.in_full) or lora_b.shape != (part.full_rows, r):
                raise ValueError(
                    f"{part.proj}: lora_A {tuple(lora_a.shape)} and lora_B "
                    f"{tuple(lora_b.shape)}, the model expects [{r}, {self.in_full}] and "
                    f"[{part.full_rows}, {r}]"
                )
            if r > max_rank:
                raise ValueError(f"LoRA rank {r} is greater than max_lora_rank {max_rank}.")
            a[p, :r] = lora_a[:, self.in_first : self.in_first + a.shape[2]]
            rows = lora_b[part.first_row : part.first_row + part.rows].double() * scaling
            b[part.offset : part.offset + part.rows, :r] = rows
        return a, b

    def write(self, slot: int, shard: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy one adapter's shard into `slot` (in place: graphs keep the addresses); None
        zeroes the slot."""
        if shard is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(shard[0])
            self.b[slot].copy_(shard[1])
