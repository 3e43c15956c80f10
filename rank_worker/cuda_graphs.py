"""CUDA graphs for decode steps: capture once at start-up, replay for every decode-only batch.

A decode step launches hundreds of small kernels whose launch overhead dominates at small batch
sizes; a graph replays them all with one launch. A graph replays fixed shapes and fixed device
addresses, so:

- graphs are captured for a ladder of batch sizes (`capture_sizes`: 1, 2, 4, 8, then every
  multiple of 8 up to max_num_seqs, and max_num_seqs itself) and a batch of b sequences runs in
  the smallest captured size >= b;
- the inputs live in static buffers (`StaticDecodeBuffers`) that every replay overwrites:
  input_ids, positions, slot_mapping, seq_lens and a block table as wide as the longest
  sequence can need (`ceil(max_model_len / block_size)`). `query_start_loc` is always
  `0..size` (one token per sequence) and is written once;
- the `size - b` padding rows (filled by `StaticDecodeBuffers.load`) write nowhere (slot -1:
  store_kv skips it) and read a valid dummy context (seq_len 1 against block 0), so they
  compute finite garbage that is sliced off; they never touch a block a real sequence owns;
- the attention metadata is still an argument of the model's forward: the graph is captured
  with metadata over views of the static buffers, whose host fields hold upper bounds
  (`max_model_len`), see `AttentionBackend`.

With LoRA, each size has two graphs (vLLM's `cudagraph_specialize_lora`): one with the LoRA
kernels, which read the per-token slots from their fixed buffer, and one without them for
steps where no sequence has an adapter, so that enabling LoRA costs base traffic nothing.

What runs eagerly instead: a batch with any prefill row, a batch larger than the largest
captured size, and everything when graphs are off (`disabled_reason`): on CPU, with
`enforce_eager`, with a backend that syncs with the host (torch), or when the ranks talk over
gloo, which stages each all-reduce through host memory (a graph cannot capture that; NCCL
collectives it can).

Ownership: a step's inputs arrive already on the device (`input_prep`: one host-to-device copy
per step, placeholder ids resolved) and are copied device-to-device into the static buffers,
padding rows filled on the device; the graphs, their memory pool and their output tensors
belong to one `DecodeGraphRunner`, which belongs to one ModelRunner and its KV cache (a graph
holds the cache's addresses).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.input_prep import StepInputs
from rank_worker.tp import TPInfo
from shm_ipc.step_plan import StepPlan

logger = logging.getLogger(__name__)

# Sizes below the first multiple of 8 (batches of a few interactive requests are common).
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8
# The block every padding row reads: any allocated block will do, and block 0 always exists.
_DUMMY_BLOCK = 0
# The slot every padding row stores its K/V to: negative means nowhere (store_kv skips it).
_PAD_SLOT = -1


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to and including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in _SMALL_SIZES if s <= max_num_seqs}
    sizes.update(range(_SIZE_STEP, max_num_seqs + 1, _SIZE_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def graph_size_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows (sizes sorted), or None."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(plan: StepPlan) -> bool:
    """Every sequence computes exactly one token (the layout the graphs were captured with)."""
    return plan.num_seqs > 0 and bool(np.all(np.diff(plan.query_start_loc) == 1))


def disabled_reason(
    device: torch.device, enforce_eager: bool, backend: AttentionBackend, tp: TPInfo
) -> str | None:
    """Why this rank runs decode steps eagerly, or None when it captures graphs."""
    if device.type != "cuda":
        return f"the model runs on {device}"
    if enforce_eager:
        return "enforce_eager is set"
    if not backend.supports_cuda_graphs:
        return f"the {backend.name!r} attention backend syncs with the host"
    if not tp.is_single:
        import torch.distributed as dist

        if dist.get_backend() != "nccl":
            return (
                f"collectives run over {dist.get_backend()}, which stages tensors through host "
                "memory; only NCCL collectives can be captured"
            )
    return None


class StaticDecodeBuffers:
    """Device buffers for the largest captured batch; batch `size` uses the first `size` rows.

    Columns of `block_table` past a plan's own width keep earlier plans' (valid) block ids;
    seq_lens bounds every read, so they are never read.
    """

    def __init__(
        self, max_size: int, max_model_len: int, block_size: int, device: torch.device
    ) -> None:
        self.max_size = max_size
        self.max_model_len = max_model_len
        width = math.ceil(max_model_len / block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_size, **i64)  # [N]
        self.positions = torch.zeros(max_size, **i64)  # [N]
        self.slot_mapping = torch.full((max_size,), _PAD_SLOT, **i64)  # [N]
        self.seq_lens = torch.ones(max_size, **i32)  # [N]
        self.block_table = torch.full((max_size, width), _DUMMY_BLOCK, **i32)  # [N, W]
        self.query_start_loc = torch.arange(max_size + 1, **i32)  # [N+1], never changes

    @property
    def width(self) -> int:
        return int(self.block_table.shape[1])

    def load(self, inputs: StepInputs, size: int) -> None:
        """Copy a decode-only step's prepared inputs into the first `size` rows, padded.

        Device-to-device copies from the step's one host-to-device copy (`input_prep`), with
        its placeholder ids already resolved; padding rows are filled on the device. Stream
        order puts these writes after the previous replay's reads and before the next replay.
        """
        meta = inputs.meta
        b, w = meta.num_seqs, meta.block_table.shape[1]
        if b == 0 or meta.num_tokens != b:
            raise ValueError(f"step {inputs.step_id}: not a decode-only batch")
        if b > size or size > self.max_size:
            raise ValueError(
                f"step {inputs.step_id}: {b} sequences do not fit a batch of {size} "
                f"(static buffers hold {self.max_size})"
            )
        if w > self.width:
            raise ValueError(
                f"step {inputs.step_id}: block table of width {w} exceeds the static width "
                f"{self.width}"
            )
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[:b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_table[:b, :w].copy_(meta.block_table)
        if b < size:
            self.input_ids[b:size].fill_(0)  # any valid token id
            self.positions[b:size].fill_(0)  # a valid rotary row
            self.slot_mapping[b:size].fill_(_PAD_SLOT)  # store nothing
            self.seq_lens[b:size].fill_(1)  # attend to one key...
            self.block_table[b:size, :w].fill_(_DUMMY_BLOCK)  # ...of the dummy block

    def forward_args(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`(input_ids, positions, metadata)` over the first `size` rows.

        The host fields are bounds, not values: the graph captured with them is replayed for
        sequences of every length up to max_model_len.
        """
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_host=np.arange(size + 1, dtype=np.int32),
            seq_lens_host=np.full(size, self.max_model_len, dtype=np.int32),
        )
        return self.input_ids[:size], self.positions[:size], meta


class DecodeGraphRunner:
    """Runs decode-only batches through captured graphs (see the module docstring).

    `run` works before `capture` too (and on CPU): it then runs the model eagerly on the same
    padded static buffers, which is how the padding is tested without a GPU.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[Any],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        set_lora: Callable[[bool], None] | None = None,
    ) -> None:
        """`set_lora(on)`: with LoRA, turns the model's LoRA terms on or off for a capture
        (`rank_worker.lora.layers.AdapterBatch.capture_mode`); None without LoRA."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = StaticDecodeBuffers(self.sizes[-1], max_model_len, block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden], in the graph pool
        # With LoRA: the graphs without the LoRA terms, for steps with no adapter.
        self.set_lora = set_lora
        self.base_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.base_outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.num_base_replays = 0  # of them, replays of a graph without LoRA

    def can_run(self, plan: StepPlan) -> bool:
        # Any context fits: the static block table is as wide as max_model_len needs.
        return is_decode_only(plan) and graph_size_for(plan.num_seqs, self.sizes) is not None

    def _forward(self, size: int) -> torch.Tensor:
        input_ids, positions, meta = self.buffers.forward_args(size)
        return self.model(input_ids, positions, meta, self.kv_caches)  # [size, hidden]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, all in one memory pool.

        Largest first: the pool grows to the largest batch's activations once and the smaller
        graphs reuse that memory. Sharing is safe because replays never overlap and each
        output is consumed before the next replay. Each size runs once eagerly before its
        capture, so that Triton compiles (and NCCL sets up) outside the capture, where both
        would fail. The buffers hold padding rows (slot -1) throughout: nothing is stored.
        """
        pool = torch.cuda.graph_pool_handle()
        if self.set_lora is not None:
            self.set_lora(True)
        self._capture_set(self.graphs, self.outputs, pool)
        if self.set_lora is not None:
            self.set_lora(False)
            self._capture_set(self.base_graphs, self.base_outputs, pool)
        logger.info(
            "captured CUDA graphs for decode batch sizes %s%s",
            self.sizes,
            " (with and without LoRA)" if self.set_lora is not None else "",
        )

    def _capture_set(
        self, graphs: dict[int, torch.cuda.CUDAGraph], outputs: dict[int, torch.Tensor], pool: Any
    ) -> None:
        """One graph per size, largest first (see `capture`), into `graphs` and `outputs`."""
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = self._forward(size)
            graphs[size] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Drop the graphs (and with the last of them their memory pool), their outputs and the
        static buffers; `run` cannot be called again."""
        for graph in (*self.graphs.values(), *self.base_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.base_graphs.clear()
        self.base_outputs.clear()
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]

    @torch.inference_mode()
    def run(self, inputs: StepInputs, base_only: bool = False) -> torch.Tensor:
        """Hidden states `[b, hidden]` of a decode-only step that `can_run`, from its prepared
        inputs (`input_prep.prepare_inputs`). `base_only`: no sequence has a LoRA adapter, so
        the graph without LoRA serves (where there is one)."""
        b = inputs.meta.num_seqs
        size = graph_size_for(b, self.sizes)
        if size is None:
            raise ValueError(f"step {inputs.step_id}: no captured graph fits {b} sequences")
        self.buffers.load(inputs, size)
        base = base_only and size in self.base_graphs
        graph = (self.base_graphs if base else self.graphs).get(size)
        if graph is None:
            return self._forward(size)[:b]
        graph.replay()
        self.num_replays += 1
        self.num_base_replays += base
        return (self.base_outputs if base else self.outputs)[size][:b]
