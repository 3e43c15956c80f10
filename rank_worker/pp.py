"""Pipeline-parallel facts: which stage this rank is, which layers the stage holds, and the
hand-offs between stages.

World ranks are laid out as vLLM lays them out, stage-major:

    world rank = pp_rank * tp_size + tp_rank            e.g. TP 2 x PP 2:
                                                        stage 0: ranks 0 1   (embedding, layers [0, a))
                                                        stage 1: ranks 2 3   (layers [a, L), norm, LM head)

Each stage is a tensor-parallel group of its own (`PipelineInfo.tp`, a `TPInfo` whose rank and
size are the stage's and whose `group` is the stage's process group), so every layer's
collectives stay inside its stage. The world group (`PipelineInfo.world`) still carries what
every rank takes part in: the bootstrap, the KV-block agreement, control calls and the sampled
tokens of asynchronous scheduling.

One forward pass over a plan that every rank received whole:

    stage 0           embed → its layers → send (hidden, residual) to the same TP rank of stage 1
    stage s (middle)  receive (hidden, residual) → its layers → send them on
    last stage        receive → its layers → final norm → LM head (vocab shards gathered to the
                      stage's TP rank 0) → that rank sends the logits to world rank 0
    world rank 0      receives the logits and samples

Hand-offs are point-to-point (`send_tensor` / `recv_tensor`) between the same TP rank of
adjacent stages: every TP rank holds the whole `[T, hidden]` after its layer's all-reduce, so
each sends its own copy (vLLM instead sends a 1/TP slice per rank and all-gathers on arrival:
less traffic across nodes, one more collective; not needed to be correct). Shapes are known on
both sides from the plan (`T` tokens, the model's hidden size and dtype; the logits' rows and
the vocabulary), so nothing but the tensors crosses.

Layer split: `layer_partition` — vLLM's `get_pp_indices` rule (an even split, the remainder one
layer each to the stages just before the last, which holds the LM head), or an explicit list of
layers per stage (`$TP_ENGINE_PP_LAYER_PARTITION="a,b"`, like vLLM's `VLLM_PP_LAYER_PARTITION`,
or the engine's `pp_layer_partition`), read once on rank 0 and shipped to every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rank_worker.tp import TPInfo, new_group, recv_tensor, send_tensor

__all__ = [
    "ENV_LAYER_PARTITION",
    "PipelineInfo",
    "PipelineStage",
    "StageHandoff",
    "layer_partition",
    "partition_from_env",
]

ENV_LAYER_PARTITION = "TP_ENGINE_PP_LAYER_PARTITION"

logger = logging.getLogger(__name__)


def partition_from_env() -> tuple[int, ...] | None:
    """`$TP_ENGINE_PP_LAYER_PARTITION` ("a,b,..."), or None when unset; ValueError when it is not
    a comma-separated list of integers."""
    value = os.environ.get(ENV_LAYER_PARTITION)
    if value is None or not value.strip():
        return None
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"{ENV_LAYER_PARTITION}={value!r} is not a comma-separated list of layer counts"
        ) from None


def layer_partition(
    num_layers: int, pp_size: int, explicit: tuple[int, ...] | list[int] | None = None
) -> list[tuple[int, int]]:
    """Each stage's layers as `[start, end)`, in stage order.

    `explicit`: layers per stage (one count per stage, each >= 1, summing to `num_layers`).
    None: vLLM's rule, `num_layers // pp_size` each, the remainder one more layer each to the
    stages before the last (the last holds the final norm and the LM head): 3 layers over 2
    stages are (0, 2), (2, 3). ValueError naming `pipeline_parallel_size` when a stage would
    get no layer or the explicit list does not fit.
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if explicit is not None:
        counts = [int(n) for n in explicit]
        if len(counts) != pp_size or any(n < 1 for n in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"layer partition {counts} does not fit pipeline_parallel_size={pp_size} over "
                f"{num_layers} layers: give {pp_size} counts, each >= 1, summing to {num_layers}"
            )
    else:
        if num_layers < pp_size:
            raise ValueError(
                f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers: "
                "every stage needs at least one"
            )
        base, extra = divmod(num_layers, pp_size)
        counts = [base] * pp_size
        for i in range(extra):
            counts[pp_size - 2 - i] += 1
    starts = [sum(counts[:i]) for i in range(pp_size)]
    return [(start, start + n) for start, n in zip(starts, counts, strict=True)]


@dataclass(frozen=True)
class PipelineStage:
    """One stage's share of the model: decoder layers `[start, end)` of `num_layers`; the first
    stage embeds, the last ends in the final norm and the head."""

    index: int
    num_stages: int
    start: int
    end: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """The whole model on one stage (no pipeline parallelism)."""
        return cls(0, 1, 0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


class StageHandoff(NamedTuple):
    """What one stage passes the next: the last layer's block output and the residual stream,
    each `[T, hidden]` in the model dtype (the next layer's fused add+norm sums them)."""

    hidden: torch.Tensor
    residual: torch.Tensor


@dataclass(frozen=True)
class PipelineInfo:
    """This rank's place in the pipeline (see the module docstring).

    `world`: the rank among all ranks (the default group); `tp`: its rank within its stage's
    tensor-parallel group, what every layer receives; `stage`: the layers its stage holds.
    """

    world: TPInfo
    tp: TPInfo
    stage: PipelineStage

    @classmethod
    def build(
        cls,
        world: TPInfo,
        pp_size: int,
        num_layers: int,
        partition: tuple[int, ...] | list[int] | None = None,
    ) -> PipelineInfo:
        """This rank's stage in a world of `world.size = tp_size * pp_size` ranks. With more
        than one stage and TP > 1, every rank makes every stage's group (a world collective;
        every rank calls this once, in the same place of its start-up)."""
        if pp_size == 1:
            return cls(world, world, PipelineStage.whole(num_layers))
        if world.size % pp_size:
            raise ValueError(
                f"{world.size} ranks do not divide into pipeline_parallel_size={pp_size} stages"
            )
        tp_size = world.size // pp_size
        pp_rank, tp_rank = divmod(world.rank, tp_size)
        group = None
        if tp_size > 1:
            for s in range(pp_size):
                made = new_group(list(range(s * tp_size, (s + 1) * tp_size)))
                if s == pp_rank:
                    group = made
        tp = TPInfo(tp_rank, tp_size, world.local_rank, world.local_size, world.device, group=group)
        start, end = layer_partition(num_layers, pp_size, partition)[pp_rank]
        logger.info(
            "rank %d: pipeline stage %d of %d (TP rank %d of %d), layers [%d, %d) of %d",
            world.rank, pp_rank, pp_size, tp_rank, tp_size, start, end, num_layers,
        )  # fmt: skip
        return cls(world, tp, PipelineStage(pp_rank, pp_size, start, end, num_layers))

    @property
    def is_single(self) -> bool:
        """One stage: no hand-offs, and the logits are gathered straight to world rank 0."""
        return self.stage.num_stages == 1

    @property
    def prev_rank(self) -> int:
        """The world rank this rank receives its hand-off from (same TP rank, stage - 1)."""
        return self.world.rank - self.tp.size

    @property
    def next_rank(self) -> int:
        """The world rank this rank sends its hand-off to (same TP rank, stage + 1)."""
        return self.world.rank + self.tp.size

    @property
    def output_rank(self) -> int:
        """The world rank that holds the gathered logits: TP rank 0 of the last stage."""
        return (self.stage.num_stages - 1) * self.tp.size

    def receive(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> StageHandoff | None:
        """The previous stage's hand-off for a step of `num_tokens` tokens; None on stage 0."""
        if self.stage.is_first:
            return None
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        recv_tensor(hidden, self.prev_rank)
        recv_tensor(residual, self.prev_rank)
        return StageHandoff(hidden, residual)

    def send(self, handoff: StageHandoff) -> None:
        """Pass this stage's output on (every stage but the last)."""
        send_tensor(handoff.hidden, self.next_rank)
        send_tensor(handoff.residual, self.next_rank)

    def deliver_logits(
        self, logits: torch.Tensor | None, num_rows: int, width: int, device: torch.device
    ) -> torch.Tensor | None:
        """Bring the last stage's `[num_rows, width]` fp32 rows (on its TP rank 0, else None)
        to world rank 0; returns them there and None on every other rank. No transfer for a
        step without logits rows (every rank knows it from the plan)."""
        if self.is_single:
            return logits
        rank = self.world.rank
        if num_rows == 0:
            return (
                torch.empty((0, width), dtype=torch.float32, device=device) if rank == 0 else None
            )
        if rank == self.output_rank:
            assert logits is not None
            send_tensor(logits, 0)
            return None
        if rank == 0:
            rows = torch.empty((num_rows, width), dtype=torch.float32, device=device)
            return recv_tensor(rows, self.output_rank)
        return None
