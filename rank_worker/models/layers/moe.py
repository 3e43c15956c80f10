"""Qwen3-MoE's sparse block: a replicated fp32 router and the experts, split over the ranks.

Where the experts live (`ExpertPlacement`, fixed at construction):
- tensor parallel (the default): every rank holds every expert, sliced along
  `moe_intermediate_size` as the dense MLP is (gate and up rows column-parallel, down columns
  row-parallel), so each rank computes a partial sum of every routed expert's output;
- expert parallel (`expert_parallel=True`): rank r holds whole experts, a contiguous range;
  when the ranks do not divide the experts, the first `E % N` ranks hold one more.

Either way the forward is the same, and so is its one collective. After attention's
all-reduce every rank holds every token's hidden state, so every rank routes every token
itself (same input, same fp32 router: the same choice everywhere), computes its share of each
(token, expert) pair it holds — a slice of every expert, or the whole of its own experts — and
one all-reduce of `[T, hidden]` sums the shares: as many all-reduces per layer as the dense
model. Moving tokens to their experts' ranks (all-to-all dispatch and combine) would pay only
when each rank starts from different tokens (data-parallel attention); here every rank already
has all of them, so it would add two collectives to save work no rank does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.models.layers.params import (
    CheckpointPart,
    check_shape,
    make_param,
    replicated_weight_loader,
)
from rank_worker.models.quantization import (
    FP8_DTYPE,
    Fp8BlockQuant,
    block_slice,
    check_fp8_tensor,
    check_scale_tensor,
    fp8_linear_fn,
    fp8_quant_of,
    scale_shape,
)
from rank_worker.tp import TPInfo, all_reduce


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts, and which slice of each, one rank holds."""

    num_experts: int
    intermediate_size: int  # moe_intermediate_size of one expert, whole
    expert_parallel: bool
    first_expert: int  # this rank's experts are [first_expert, first_expert + num_local_experts)
    num_local_experts: int
    intermediate_start: int  # this rank's slice of each expert's intermediate features
    local_intermediate_size: int

    @classmethod
    def for_rank(
        cls, num_experts: int, intermediate_size: int, tp: TPInfo, expert_parallel: bool
    ) -> ExpertPlacement:
        if num_experts < 1:
            raise ValueError(f"a MoE layer needs at least one expert, got {num_experts}")
        if expert_parallel:
            if num_experts < tp.size:
                raise ValueError(
                    f"expert parallelism over {tp.size} ranks needs at least {tp.size} experts, "
                    f"the model has {num_experts}; run without --enable-expert-parallel"
                )
            base, extra = divmod(num_experts, tp.size)
            return cls(
                num_experts=num_experts,
                intermediate_size=intermediate_size,
                expert_parallel=True,
                first_expert=tp.rank * base + min(tp.rank, extra),
                num_local_experts=base + (tp.rank < extra),
                intermediate_start=0,
                local_intermediate_size=intermediate_size,
            )
        if intermediate_size % tp.size:
            raise ValueError(
                f"moe_intermediate_size ({intermediate_size}) is not divisible by the "
                f"tensor-parallel size ({tp.size}); use --enable-expert-parallel, which places "
                "whole experts on ranks instead of slicing every expert"
            )
        local = intermediate_size // tp.size
        return cls(
            num_experts=num_experts,
            intermediate_size=intermediate_size,
            expert_parallel=False,
            first_expert=0,
            num_local_experts=num_experts,
            intermediate_start=tp.rank * local,
            local_intermediate_size=local,
        )

    def local_id(self, expert: int) -> int | None:
        """This rank's index of checkpoint expert `expert`, or None when another rank has it."""
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def expert_map(self, device: torch.device | str) -> torch.Tensor:
        """`[num_experts]` int32: the local index of every expert, -1 for other ranks'."""
        ids = torch.full((self.num_experts,), -1, dtype=torch.int32)
        ids[self.first_expert : self.first_expert + self.num_local_experts] = torch.arange(
            self.num_local_experts, dtype=torch.int32
        )
        return ids.to(device)


class TopKRouter(nn.Module):
    """Qwen3-MoE's router (`mlp.gate`): `softmax(x @ W.T)` over the experts, the `top_k`
    largest, renormalised to sum to 1 when `norm_topk_prob`.

    Split: none; the `[num_experts, hidden]` weight is replicated, and kept and applied in
    fp32 whatever the model dtype: which experts a token reaches is decided by comparing
    scores, and bf16 scores tie or swap far more often. Forward: no collective. Returns
    `(topk_weights [T, top_k] fp32, topk_ids [T, top_k] int64)`, ids in descending score order.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = make_param(
            (num_experts, hidden_size),
            dtype=torch.float32,
            device=device,
            weight_loader=replicated_weight_loader,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, E] fp32
        probs = torch.softmax(logits, dim=-1)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, top_k] each
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """The experts of one sparse layer on this rank (`mlp.experts`), see `ExpertPlacement`.

    Split: `w13_weight [E_local, 2 * I_local, hidden]` holds, per local expert, its gate rows
    then its up rows (this rank's slice of each under tensor parallelism, all of them under
    expert parallelism); `w2_weight [E_local, hidden, I_local]` the matching columns of down.
    Forward: one all-reduce (sum) of the `[T, hidden]` output, unless `reduce_results=False`.

    `fused=True` runs `kernels.fused_moe` (tokens grouped by expert, two grouped GEMMs with
    SiLU·mul fused into the first; free of host syncs, so decode steps can be graphed); False
    is the plain-torch reference and the CPU path: one expert at a time, reading on the host
    which experts were hit, as transformers does. While a CUDA graph is being captured (torch
    layer kernels on a GPU) that read is impossible, and the torch path runs every local
    expert over every token instead, with weight 0 where a token does not use it: the same
    sums, at the cost of reading every expert each step.

    FP8 experts (`quant`, Qwen3-MoE FP8 checkpoints): w13 and w2 are float8_e4m3fn with their
    128×128 block scales `w13_weight_scale_inv [E_local, 2 * I_local/128, hidden/128]` and
    `w2_weight_scale_inv [E_local, hidden/128, I_local/128]`, cut with them; hidden and
    I_local must be whole blocks (refused when built otherwise: tensor parallelism that cuts
    an expert inside a block; expert parallelism keeps experts whole). Both paths then
    quantize the activations per token and 128-group (`kernels.fp8_gemm`).
    """

    def __init__(
        self,
        placement: ExpertPlacement,
        hidden_size: int,
        tp: TPInfo,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused: bool = False,
        reduce_results: bool = True,
        quant: Fp8BlockQuant | None = None,
    ) -> None:
        super().__init__()
        self.placement = placement
        self.hidden_size = hidden_size
        self.tp = tp
        self.fused = fused
        self.reduce_results = reduce_results
        self.quant = quant
        n_local, i_local = placement.num_local_experts, placement.local_intermediate_size
        w_dtype = dtype if quant is None else FP8_DTYPE
        self.w13_weight = make_param(
            (n_local, 2 * i_local, hidden_size), dtype=w_dtype, device=device,
            weight_loader=self._load_w13,
        )  # fmt: skip
        self.w2_weight = make_param(
            (n_local, hidden_size, i_local), dtype=w_dtype, device=device,
            weight_loader=self._load_w2,
        )  # fmt: skip
        self._linear = F.linear if quant is None else fp8_linear_fn(quant)
        if quant is not None:
            what = "moe_intermediate_size " + (
                "(expert parallel)" if placement.expert_parallel else f"over {tp.size} ranks"
            )
            self._scale_rows = block_slice(
                placement.intermediate_start, i_local, None, what, quant.block
            )
            block_slice(0, hidden_size, None, "hidden_size of the experts", quant.block)
            self.w13_weight_scale_inv = make_param(
                (n_local, *scale_shape(2 * i_local, hidden_size)), dtype=torch.float32,
                device=device, weight_loader=self._load_w13_scale,
            )  # fmt: skip
            self.w2_weight_scale_inv = make_param(
                (n_local, *scale_shape(hidden_size, i_local)), dtype=torch.float32,
                device=device, weight_loader=self._load_w2_scale,
            )  # fmt: skip
        # [num_experts] int32 checkpoint expert -> local index or -1.
        self.register_buffer("expert_map", placement.expert_map(device), persistent=False)
        if fused:
            from kernels.fused_moe import fused_moe

            self._kernel = fused_moe

    def checkpoint_parts(self) -> dict[str, CheckpointPart]:
        """The checkpoint's tensors of these experts, as published: one per expert and
        projection (`{e}.gate_proj.weight` ...), relative to this module. Every expert's
        tensors must be present; another rank's are only checked (`CheckpointPart`)."""
        hidden, inter = self.hidden_size, self.placement.intermediate_size
        suffixes = ["weight"] if self.quant is None else ["weight", "weight_scale_inv"]
        parts: dict[str, CheckpointPart] = {}
        for expert in range(self.placement.num_experts):
            local = self.placement.local_id(expert)
            for proj, param, shape in (
                ("gate", "w13", (inter, hidden)),
                ("up", "w13", (inter, hidden)),
                ("down", "w2", (hidden, inter)),
            ):
                for suffix in suffixes:
                    if suffix == "weight_scale_inv":
                        shape = scale_shape(*shape)
                    parts[f"{expert}.{proj}_proj.{suffix}"] = (
                        CheckpointPart(f"{param}_{suffix}", (expert, local, proj))
                        if local is not None
                        else CheckpointPart(None, shape=shape)
                    )
        return parts

    def _load_w13(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        expert, local, proj = shard_id
        if self.quant is not None:
            check_fp8_tensor(full, f"expert {expert} {proj}_proj")
        p = self.placement
        check_shape(full, (p.intermediate_size, self.hidden_size), f"expert {expert} {proj}_proj")
        rows = full.narrow(0, p.intermediate_start, p.local_intermediate_size)
        offset = 0 if proj == "gate" else p.local_intermediate_size
        param.data[local].narrow(0, offset, p.local_intermediate_size).copy_(rows)

    def _load_w2(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        expert, local, _ = shard_id
        if self.quant is not None:
            check_fp8_tensor(full, f"expert {expert} down_proj")
        p = self.placement
        check_shape(full, (self.hidden_size, p.intermediate_size), f"expert {expert} down_proj")
        param.data[local].copy_(full.narrow(1, p.intermediate_start, p.local_intermediate_size))

    def _load_w13_scale(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any) -> None:
        expert, local, proj = shard_id
        what = f"expert {expert} {proj}_proj weight_scale_inv"
        check_scale_tensor(full, what)
        check_shape(full, scale_shape(self.placement.intermediate_size, self.hidden_size), what)
        first, count = self._scale_rows
        offset = 0 if proj == "gate" else count
        param.data[local].narrow(0, offset, count).copy_(full.narrow(0, first, count))

    def _load_w2_scale(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any) -> None:
        expert, local, _ = shard_id
        what = f"expert {expert} down_proj weight_scale_inv"
        check_scale_tensor(full, what)
        check_shape(full, scale_shape(self.hidden_size, self.placement.intermediate_size), what)
        param.data[local].copy_(full.narrow(1, *self._scale_rows))

    def _expert_weights(self, expert: int) -> tuple[tuple[torch.Tensor, ...], ...]:
        """`_linear`'s weight arguments for gate/up and for down of local expert `expert`."""
        if self.quant is None:
            return (self.w13_weight[expert],), (self.w2_weight[expert],)
        return (
            (self.w13_weight[expert], self.w13_weight_scale_inv[expert]),
            (self.w2_weight[expert], self.w2_weight_scale_inv[expert]),
        )

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x `[T, hidden]`, the router's `topk_weights` fp32 and `topk_ids` `[T, top_k]` ->
        `[T, hidden]`, all-reduced."""
        local_ids = self.expert_map[topk_ids]  # [T, top_k] int32, -1: another rank's expert
        if self.fused:
            scales = {}
            if self.quant is not None:
                scales = dict(
                    w13_scale=self.w13_weight_scale_inv, w2_scale=self.w2_weight_scale_inv
                )
            out = self._kernel(
                x, self.w13_weight, self.w2_weight, topk_weights, local_ids,
                all_local=not self.placement.expert_parallel, **scales,
            )  # fmt: skip
        else:
            out = self._forward_torch(x, topk_weights, local_ids)
        if self.reduce_results:
            out = all_reduce(out, self.tp)
        return out  # [T, hidden]

    def _forward_torch(
        self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
    ) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._forward_every_expert(x, topk_weights, local_ids)
        inter = self.placement.local_intermediate_size
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, hidden]
        # Experts in ascending order, each over its tokens, as transformers sums them.
        for expert in local_ids.unique().tolist():
            if expert < 0:
                continue
            token, slot = (local_ids == expert).nonzero(as_tuple=True)
            w13, w2 = self._expert_weights(expert)
            gate, up = self._linear(x[token], *w13).split(inter, dim=-1)
            y = self._linear(F.silu(gate) * up, *w2)  # [n, hidden]
            out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype).float())
        return out.to(x.dtype)

    def _forward_every_expert(
        self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor
    ) -> torch.Tensor:
        """The torch path without host syncs (see the class docstring). A token's output gains
        exactly 0 from an expert it does not use, so the sums equal `_forward_torch`'s."""
        num_local = self.placement.num_local_experts
        inter = self.placement.local_intermediate_size
        column = torch.where(local_ids < 0, num_local, local_ids).long()  # [T, top_k]
        per_expert = torch.zeros(
            (x.shape[0], num_local + 1), dtype=torch.float32, device=x.device
        ).scatter_add_(1, column, topk_weights)[:, :num_local]  # [T, E_local] routing weights
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, hidden]
        for expert in range(num_local):
            w13, w2 = self._expert_weights(expert)
            gate, up = self._linear(x, *w13).split(inter, dim=-1)
            y = self._linear(F.silu(gate) * up, *w2)  # [T, hidden]
            out += (y * per_expert[:, expert, None]).to(x.dtype).float()
        return out.to(x.dtype)


class Qwen3MoeSparseBlock(nn.Module):
    """A sparse layer's MLP (`mlp`): `gate` routes, `experts` compute; one all-reduce."""

    def __init__(
        self,
        hf_config: Any,
        tp: TPInfo,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        fused: bool = False,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
        num_experts = int(hf_config.num_experts)
        self.gate = TopKRouter(
            num_experts,
            hf_config.hidden_size,
            int(hf_config.num_experts_per_tok),
            bool(getattr(hf_config, "norm_topk_prob", False)),
            device=device,
        )
        placement = ExpertPlacement.for_rank(
            num_experts, int(hf_config.moe_intermediate_size), tp, expert_parallel
        )
        self.experts = FusedMoE(
            placement, hf_config.hidden_size, tp, dtype=dtype, device=device, fused=fused,
            quant=fp8_quant_of(hf_config, fused),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [T, top_k] fp32, int64
        return self.experts(x, topk_weights, topk_ids)  # [T, hidden], all-reduced
