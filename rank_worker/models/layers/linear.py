"""Column- and row-parallel linear layers (Megatron-style splits).

A column-parallel layer splits the output features: rank r computes a slice of the outputs from
the full input and needs no communication. A row-parallel layer splits the input features: rank
r multiplies its slice of the input by its slice of the weight and the partial sums are
all-reduced. Pairing them (column then row) costs one all-reduce per pair, which is how both the
attention block (QKV → o_proj) and the MLP (gate/up → down) are built.

Weights follow `nn.Linear`: `[out_features, in_features]`, `y = x @ W.T + b`.

Every layer takes `quant`: None keeps W in the model dtype and multiplies with `F.linear`; an
`Fp8BlockQuant` (an FP8 checkpoint, `rank_worker.models.quantization`) makes W float8_e4m3fn with a
`weight_scale_inv [cdiv(out, 128), cdiv(in, 128)]` fp32 parameter beside it, cut into shards
with W (whole blocks only: a cut inside a block is refused when the layer is built), and
multiplies with the W8A8 block GEMM. The choice is fixed here: `forward` does not branch.

Multi-LoRA hangs a `LinearLoRA` on a layer (`lora`, `rank_worker.lora.layers`): `forward` adds
the step's adapter terms right after the matmul (`_adapt`), so a row-parallel layer adds its
partial term before its all-reduce.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.models.layers.params import check_shape, make_param, reject_shard_id
from rank_worker.models.quantization import (
    FP8_DTYPE,
    Fp8BlockQuant,
    block_slice,
    check_fp8_tensor,
    check_scale_tensor,
    fp8_linear_fn,
    scale_shape,
)
from rank_worker.tp import TPInfo, all_reduce


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class _Linear(nn.Module):
    """What the parallel linears share: W (quantized or not) and the matmul bound to it."""

    # `(x, y) -> y` plus the LoRA term of each token's adapter (`rank_worker.lora.layers.
    # LinearLoRA`); None without LoRA.
    lora: Any = None

    def _adapt(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (this rank's `x @ W.T`) plus the step's adapter terms; `y` itself without LoRA."""
        return y if self.lora is None else self.lora(x, y)

    def _make_weight(
        self,
        rows: int,
        cols: int,
        quant: Fp8BlockQuant | None,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        load_weight: Any,
        load_scale: Any,
    ) -> None:
        """`weight [rows, cols]`, and for fp8 its `weight_scale_inv`; binds `self._matmul`."""
        self.quant = quant
        if quant is None:
            weight = self.weight = make_param((rows, cols), dtype=dtype, device=device,
                                              weight_loader=load_weight)  # fmt: skip
            # Bound to the parameter itself, not read through nn.Module.__getattr__ per call:
            # loads and updates write into this object in place.
            self._matmul = lambda x: F.linear(x, weight)
            return

        def load_fp8(param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
            check_fp8_tensor(full, type(self).__name__)
            load_weight(param, full, shard_id)

        def load_scale_checked(param: nn.Parameter, full: torch.Tensor, shard_id: Any = None):
            check_scale_tensor(full, type(self).__name__)
            load_scale(param, full, shard_id)

        self.weight = make_param(
            (rows, cols), dtype=FP8_DTYPE, device=device, weight_loader=load_fp8
        )  # e4m3
        self.weight_scale_inv = make_param(
            scale_shape(rows, cols), dtype=torch.float32, device=device,
            weight_loader=load_scale_checked,
        )  # fmt: skip
        fp8_linear = fp8_linear_fn(quant)
        weight, scale_inv = self.weight, self.weight_scale_inv
        self._matmul = lambda x: fp8_linear(x, weight, scale_inv)


class OutputPart(NamedTuple):
    """Where one checkpoint tensor's output rows sit in this rank's shard of a column-parallel
    layer: rows `[first_row, first_row + rows)` of the `full_rows` checkpoint tensor, at
    `[offset, offset + rows)` of the rank's local weight (and output)."""

    full_rows: int
    first_row: int
    rows: int
    offset: int


class ColumnParallelBase(_Linear):
    """A column-parallel weight packed from one or more checkpoint tensors (`parts`, keyed by
    the loader's `shard_id`; the single part of a plain layer is keyed None), each cut by output
    rows on its own and laid side by side in the local weight in key order.

    Loading, the FP8 scales' rows and the LoRA stacks all cut by `parts`, so the three agree by
    construction. Forward: no collective; the output is this rank's `[num_tokens, sum(rows)]`.
    """

    def _init_parts(
        self,
        input_size: int,
        parts: dict[Any, OutputPart],
        tp: TPInfo,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: Fp8BlockQuant | None,
    ) -> None:
        self.tp = tp
        self.input_size = input_size
        self.parts = parts
        total = sum(part.rows for part in parts.values())
        if quant is not None:
            # A plain layer's last shard may end inside a block at the end of the weight; a
            # packed part must be whole blocks (a partial last block of one part would share
            # scale rows with the next part).
            packed = len(parts) > 1
            self._scale_rows = {
                key: block_slice(
                    part.first_row, part.rows, None if packed else part.full_rows,
                    f"{type(self).__name__} {'output' if key is None else key}",
                )
                for key, part in parts.items()
            }  # fmt: skip
        self._make_weight(
            total, input_size, quant, dtype=dtype, device=device,
            load_weight=self._load_part, load_scale=self._load_scale_part,
        )  # fmt: skip
        self.bias = (
            make_param((total,), dtype=dtype, device=device, weight_loader=self._load_part)
            if bias
            else None
        )

    @property
    def shard_ids(self) -> tuple[Any, ...]:
        """The parts a checkpoint must provide for each parameter."""
        return tuple(self.parts)

    def _part(self, shard_id: Any) -> OutputPart:
        if self.shard_ids == (None,):
            reject_shard_id(shard_id, type(self).__name__)
        elif shard_id not in self.parts:
            raise ValueError(
                f"{type(self).__name__}: shard_id must be one of {self.shard_ids}, got {shard_id!r}"
            )
        return self.parts[shard_id]

    def _load_part(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        part = self._part(shard_id)
        what = type(self).__name__ if shard_id is None else f"{type(self).__name__} {shard_id}"
        check_shape(full, (part.full_rows, *param.shape[1:]), what)
        shard = full.narrow(0, part.first_row, part.rows)
        param.data.narrow(0, part.offset, part.rows).copy_(shard)

    def _load_scale_part(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any) -> None:
        part = self._part(shard_id)
        check_shape(full, scale_shape(part.full_rows, self.input_size), "weight_scale_inv")
        first, count = self._scale_rows[shard_id]
        offset = part.offset // self.quant.block
        param.data.narrow(0, offset, count).copy_(full.narrow(0, first, count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)  # [num_tokens, sum of the parts' rows]
        y = self._adapt(x, y)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(ColumnParallelBase):
    """`y = x @ W.T (+ b)` with W split along its output rows.

    Split: rank r holds rows `[r * out/size, (r+1) * out/size)` of W `[out, in]` (and of b).
    Forward: no collective; the output is this rank's slice `[num_tokens, out/size]`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPInfo,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: Fp8BlockQuant | None = None,
    ) -> None:
        super().__init__()
        self.output_size = output_size
        self.local_output_size = _divide(output_size, tp.size, "output size")
        rows = self.local_output_size
        part = OutputPart(output_size, tp.rank * rows, rows, 0)
        self._init_parts(
            input_size, {None: part}, tp, bias=bias, dtype=dtype, device=device, quant=quant
        )


class MergedColumnParallelLinear(ColumnParallelBase):
    """Several column-parallel projections of the same input fused into one matmul.

    Used for the MLP's gate and up projections. Split: each part i (`output_sizes[i]` rows) is
    split on its own, so rank r holds `[gate rows of r; up rows of r]`, and the local output is
    `[num_tokens, sum(output_sizes)/size]` with the parts side by side in order.
    Forward: no collective. `weight_loader(param, full, shard_id=i)` fills part i.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        tp: TPInfo,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: Fp8BlockQuant | None = None,
    ) -> None:
        super().__init__()
        self.output_sizes = list(output_sizes)
        parts: dict[Any, OutputPart] = {}
        offset = 0
        for i, full in enumerate(output_sizes):
            rows = _divide(full, tp.size, "merged output size")
            parts[i] = OutputPart(full, tp.rank * rows, rows, offset)
            offset += rows
        self._init_parts(input_size, parts, tp, bias=bias, dtype=dtype, device=device, quant=quant)


class QKVParallelLinear(ColumnParallelBase):
    """The fused q/k/v projection, split by attention heads.

    Split: query heads are divided evenly (rank r holds heads `[r*h/size, (r+1)*h/size)`). KV
    heads are divided evenly when `size <= num_kv_heads`; when there are more ranks than KV heads,
    each KV head is replicated on `size / num_kv_heads` consecutive ranks and rank r holds KV head
    `r * num_kv_heads // size`, which is exactly the KV head its query heads attend with in the
    unsplit model (query head j uses KV head `j // (num_heads / num_kv_heads)`).
    Local weight rows: `[q heads; k heads; v heads]` of this rank, each `head_dim` rows per head.
    Forward: no collective; output `[num_tokens, (q_local + 2*kv_local) * head_dim]`.
    `weight_loader(param, full, shard_id)` with shard_id "q", "k" or "v". With FP8, each part
    must be whole 128-row blocks; with head_dim 128, as in every Qwen3, a head is a block.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TPInfo,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: Fp8BlockQuant | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_local_heads = _divide(num_heads, tp.size, "number of attention heads")
        self.num_local_kv_heads = local_kv_heads(num_kv_heads, tp)
        # First KV head of this rank in the checkpoint's numbering.
        if tp.size >= num_kv_heads:
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        else:
            self.kv_head_start = tp.rank * self.num_local_kv_heads
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        kv_full, kv_first = num_kv_heads * head_dim, self.kv_head_start * head_dim
        parts = {
            "q": OutputPart(num_heads * head_dim, tp.rank * self.q_size, self.q_size, 0),
            "k": OutputPart(kv_full, kv_first, self.kv_size, self.q_size),
            "v": OutputPart(kv_full, kv_first, self.kv_size, self.q_size + self.kv_size),
        }
        self._init_parts(hidden_size, parts, tp, bias=bias, dtype=dtype, device=device, quant=quant)


def local_kv_heads(num_kv_heads: int, tp: TPInfo) -> int:
    """KV heads each rank keeps (and caches): an even share, or one replicated head."""
    if tp.size >= num_kv_heads:
        if tp.size % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp.size} is not a multiple of the {num_kv_heads} KV heads; "
                "KV heads could not be replicated evenly"
            )
        return 1
    return _divide(num_kv_heads, tp.size, "number of KV heads")


class RowParallelLinear(_Linear):
    """`y = x @ W.T (+ b)` with W split along its input columns.

    Split: rank r holds columns `[r * in/size, (r+1) * in/size)` of W `[out, in]`; the bias is
    replicated and added once, after the reduction. The input is this rank's slice of features
    (the output of a column-parallel layer).
    Forward: one all-reduce (sum) of the `[num_tokens, out]` partial products, unless
    `reduce_results=False`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPInfo,
        *,
        bias: bool = False,
        reduce_results: bool = True,
        dtype: torch.dtype,
        device: torch.device | str,
        quant: Fp8BlockQuant | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.local_input_size = _divide(input_size, tp.size, "input size")
        self.reduce_results = reduce_results
        if quant is not None:
            # The activation groups are 128 of this rank's input columns: whole groups only.
            self._scale_cols = block_slice(
                tp.rank * self.local_input_size, self.local_input_size, None,
                "RowParallelLinear input",
            )  # fmt: skip
        self._make_weight(
            output_size, self.local_input_size, quant, dtype=dtype, device=device,
            load_weight=self._load_columns, load_scale=self._load_scale_columns,
        )  # fmt: skip
        self.bias = (
            make_param((output_size,), dtype=dtype, device=device, weight_loader=self._load_bias)
            if bias
            else None
        )

    def _load_columns(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        reject_shard_id(shard_id, "RowParallelLinear")
        check_shape(full, (self.output_size, self.input_size), "RowParallelLinear")
        start = self.tp.rank * self.local_input_size
        param.data.copy_(full.narrow(1, start, self.local_input_size))

    def _load_scale_columns(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any) -> None:
        reject_shard_id(shard_id, "RowParallelLinear")
        check_shape(full, scale_shape(self.output_size, self.input_size), "weight_scale_inv")
        param.data.copy_(full.narrow(1, *self._scale_cols))

    def _load_bias(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        reject_shard_id(shard_id, "RowParallelLinear bias")
        check_shape(full, (self.output_size,), "RowParallelLinear bias")
        param.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)  # [num_tokens, out], a partial sum on each rank
        y = self._adapt(x, y)
        if self.reduce_results:
            y = all_reduce(y, self.tp)
        if self.bias is not None:
            y = y + self.bias
        return y
