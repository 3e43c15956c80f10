"""CUDA graphs for uniform steps: capture once at start-up, replay for every batch in which each
sequence computes the same number q of tokens (a decode, q = 1; a speculative verify step in
which every sequence verifies k drafts, q = 1 + k).

A decode or verify step launches hundreds of small kernels whose launch overhead dominates at
small batch sizes; a graph replays them all with one launch. A graph replays fixed shapes and
fixed device addresses, so:

- graphs are keyed by (q, batch size): for each query length q (`query_lens`: (1,), or (1, 1 + k)
  with k speculative tokens) a ladder of batch sizes (`capture_sizes`: 1, 2, 4, 8, then every
  multiple of 8 up to the most sequences a step of q tokens each can have, `ladders`), and a
  batch of b sequences runs in the smallest captured size >= b of its q;
- the inputs live in static buffers (`StaticDecodeBuffers`) that every replay overwrites, sized
  for the largest token count: input_ids, positions, slot_mapping (one per token), seq_lens and
  a block table as wide as the longest sequence can need (`ceil(max_model_len / block_size)`)
  (one row per sequence). Sequence i of a padded batch owns tokens `[i*q, (i+1)*q)`, so
  `query_start_loc` is `arange(0, size*q + 1, q)`, one tensor per q, written once;
- the padding sequences (filled by `StaticDecodeBuffers.load`) write nowhere (slot -1:
  store_kv skips it) and read a valid dummy context: seq_len q (each of their q queries sees at
  least one key, so nothing divides by zero) in block 0, every table column that q positions
  can reach set to block 0 (more than one when q > block_size). They compute finite garbage that
  is sliced off and never touch a block a real sequence owns;
- the attention metadata is still an argument of the model's forward: the graph is captured
  with metadata over views of the static buffers, whose host fields hold bounds
  (`max_query_len` = q, `max_seq_len` = `max_model_len`), see `AttentionBackend`. A q of
  `max_model_len` or more is never captured: its bound would make the batch look like fresh
  prompts (`AttentionMetadata.fresh_prefill`), which a backend may attend from their own K/V.

`run` returns the hidden states of the step's T = b*q tokens `[T, hidden]`, the rows the eager
forward returns, so the logits rows are picked the same way. When the model keeps the target's
states for an EAGLE-3 head (`Qwen3Model.capture_layers`), they are graph outputs too, and after
`run` `model.model.captured` holds them sliced to the step's T tokens, as an eager forward
leaves it. Like the hidden states, they are the graph's output memory: valid until the next
`run`.

With LoRA, each (q, size) has two graphs (vLLM's `cudagraph_specialize_lora`): one with the
LoRA kernels, which read the per-token slots from their fixed buffer (-1, the base model, past
the step's tokens: the padding), and one without them for steps where no sequence has an
adapter, so that enabling LoRA costs base traffic nothing.

What these graphs do not take: a batch whose sequences compute different numbers of tokens (a
prefill, a mixed step, a verify step whose sequences have different numbers of drafts), a q
not captured, a batch larger than its q's largest size; the mixed-step graphs take those up to
their largest token bucket (`rank_worker.runner.mixed_graphs`), and the rest runs eagerly, as
everything does when graphs are off
(`disabled_reason`): on CPU, with `enforce_eager`, with a backend that syncs with the host
(torch), or when the ranks talk over gloo, which stages each all-reduce through host memory (a
graph cannot capture that; NCCL collectives it can).

Tests (`TP_ENGINE_DECODE_GRAPHS=padded`, read by `ModelRunner.capture_graphs` at start-up and
after every wake from sleep): on a CPU device, where the graphs are off only because the device
is a CPU, the runner is built anyway and never captures, so `run` runs the model eagerly on the
padded static buffers (the mixed-step runner's too). Engine-level CPU tests then execute the
graphs' data path (padding, slicing, the captured states) in every rank, which are processes
no test can reach into.
Unset, nothing changes; any other value is an error.

Ownership: a step's inputs arrive already on the device (`input_prep`: one host-to-device copy
per step, placeholder ids resolved) and are copied device-to-device into the static buffers,
padding filled on the device; the graphs, their memory pool and their output tensors belong to
one `DecodeGraphRunner`, which belongs to one ModelRunner and its KV cache (a graph holds the
cache's addresses).
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.inputs.graph_sizes import capture_sizes, graph_size_for
from rank_worker.inputs.input_prep import StepInputs
from rank_worker.pp import PipelineInfo
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo
from shm_ipc.step_plan import StepPlan

logger = logging.getLogger(__name__)

# The block every padding sequence reads: any allocated block will do, and block 0 always exists.
_DUMMY_BLOCK = 0
# The slot every padding token stores its K/V to: negative means nowhere (store_kv skips it).
_PAD_SLOT = -1
# The test knob (see the module docstring) and the one value it takes.
ENV_VAR = "TP_ENGINE_DECODE_GRAPHS"
PADDED = "padded"

# One graph's outputs: the hidden states `[T, hidden]`, then (EAGLE-3) the captured embeddings
# `[T, hidden]` and states `[T, n * hidden]`.
Outputs = tuple[torch.Tensor, ...]


def ladders(
    query_lens: Iterable[int], max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> dict[int, list[int]]:
    """q -> the batch sizes captured for sequences of q tokens each: at most max_num_seqs
    sequences and max_num_batched_tokens tokens. No ladder for a q where not one sequence
    fits, or where q reaches max_model_len (see the module docstring)."""
    out = {}
    for q in sorted(set(query_lens)):
        if q < 1:
            raise ValueError(f"query lengths must be >= 1, got {q}")
        most = min(max_num_seqs, max_num_batched_tokens // q)
        if most >= 1 and q < max_model_len:
            out[q] = capture_sizes(most)
    return out


def verify_query_lens(num_speculative_tokens: int) -> tuple[int, ...]:
    """The q's to capture: decodes, and verify steps of k drafts per sequence when k > 0."""
    return (1,) if num_speculative_tokens == 0 else (1, 1 + num_speculative_tokens)


def uniform_query_len(query_start_loc: np.ndarray) -> int | None:
    """q when each sequence of a `[B+1]` query_start_loc computes exactly q >= 1 tokens, else
    None (and None for no sequence)."""
    lens = np.diff(query_start_loc)
    if lens.size == 0 or lens[0] < 1 or not bool(np.all(lens == lens[0])):
        return None
    return int(lens[0])


def is_decode_only(plan: StepPlan) -> bool:
    """Every sequence computes exactly one token."""
    return uniform_query_len(plan.query_start_loc) == 1


def disabled_reason(
    device: torch.device,
    enforce_eager: bool,
    backend: AttentionBackend,
    tp: TPInfo,
    pipe: PipelineInfo | None = None,
) -> str | None:
    """Why this rank runs every step eagerly, or None when it captures graphs. `pipe`: its
    pipeline stage; with more than one stage every step runs eagerly (not yet captured: a
    graph would hold the stage's sends and receives)."""
    if device.type != "cuda":
        return f"the model runs on {device}"
    if enforce_eager:
        return "enforce_eager is set"
    if pipe is not None and not pipe.is_single:
        return (
            f"pipeline_parallel_size={pipe.stage.num_stages}: CUDA graphs are not supported "
            "with pipeline parallelism yet"
        )
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


def padded_without_capture(reason: str | None, device: torch.device, config: RunnerConfig) -> bool:
    """Whether a runner that captures nothing is wanted anyway: `TP_ENGINE_DECODE_GRAPHS=padded`
    where graphs are off (`reason`, from `disabled_reason`) only because the device is a CPU,
    not with enforce_eager, nor under pipeline parallelism (the graphs' path has no hand-offs)."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return False
    if value != PADDED:
        raise ValueError(f"${ENV_VAR} must be {PADDED!r} or unset, got {value!r}")
    if config.pipeline_parallel_size > 1:
        return False
    return reason is not None and device.type != "cuda" and not config.enforce_eager


# What the log line of a rank without graphs adds when the padded path runs all the same.
PADDED_NOTE = f" (${ENV_VAR}={PADDED}: steps run eagerly on the graphs' padded buffers)"


def graph_runner_for(
    model: torch.nn.Module,
    kv_caches: list[Any],
    config: RunnerConfig,
    device: torch.device,
    set_lora: Callable[[bool], None] | None,
) -> DecodeGraphRunner:
    """The runner `ModelRunner.capture_graphs` builds: decodes, and with k speculative tokens
    verify steps of 1 + k tokens per sequence, within the step's limits."""
    return DecodeGraphRunner(
        model,
        kv_caches,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        query_lens=verify_query_lens(config.num_speculative_tokens),
        max_model_len=int(config.max_model_len),
        block_size=config.block_size,
        device=device,
        set_lora=set_lora,
    )


class StaticDecodeBuffers:
    """Device buffers for the largest captured token count; a batch of `size` sequences of q
    tokens uses the first `size * q` token entries and the first `size` sequence rows.

    Columns of `block_table` past a plan's own width keep earlier plans' (valid) block ids;
    seq_lens bounds every read, so they are never read.
    """

    def __init__(
        self,
        max_sizes: Mapping[int, int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """`max_sizes`: q -> the largest batch captured for it."""
        if not max_sizes:
            raise ValueError("no query length to hold")
        self.max_sizes = dict(max_sizes)
        self.max_seqs = max(max_sizes.values())
        self.max_tokens = max(q * size for q, size in max_sizes.items())
        self.max_model_len = max_model_len
        self.block_size = block_size
        width = math.ceil(max_model_len / block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        n, t = self.max_seqs, self.max_tokens
        self.input_ids = torch.zeros(t, **i64)  # [T_max]
        self.positions = torch.zeros(t, **i64)  # [T_max]
        self.slot_mapping = torch.full((t,), _PAD_SLOT, **i64)  # [T_max]
        # [N]; before any step, as capture runs them: q keys for the longest q (see `load`).
        self.seq_lens = torch.full((n,), max(self.max_sizes), **i32)
        self.block_table = torch.full((n, width), _DUMMY_BLOCK, **i32)  # [N, W]
        # q -> [max_sizes[q] + 1] = 0, q, 2q, ...: never changes.
        self.query_start_loc = {
            q: torch.arange(0, size * q + 1, q, **i32) for q, size in self.max_sizes.items()
        }

    @property
    def width(self) -> int:
        return int(self.block_table.shape[1])

    def load(self, inputs: StepInputs, q: int, size: int) -> None:
        """Copy a step's prepared inputs, b sequences of q tokens each, into the first `size`
        sequences, padded.

        Device-to-device copies from the step's one host-to-device copy (`input_prep`), with
        its placeholder ids already resolved; padding is filled on the device. Stream order
        puts these writes after the previous replay's reads and before the next replay.
        """
        meta = inputs.meta
        b, w = meta.num_seqs, meta.block_table.shape[1]
        if uniform_query_len(meta.query_start_loc_host) != q:
            raise ValueError(f"step {inputs.step_id}: not a batch of {q} tokens per sequence")
        if q not in self.max_sizes or size > self.max_sizes[q] or b > size:
            raise ValueError(
                f"step {inputs.step_id}: {b} sequences of {q} tokens do not fit a batch of "
                f"{size} (static buffers hold {self.max_sizes})"
            )
        if w > self.width:
            raise ValueError(
                f"step {inputs.step_id}: block table of width {w} exceeds the static width "
                f"{self.width}"
            )
        t, padded_t = b * q, size * q
        self.input_ids[:t].copy_(inputs.input_ids)
        self.positions[:t].copy_(inputs.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_table[:b, :w].copy_(meta.block_table)
        if b < size:
            self.input_ids[t:padded_t].fill_(0)  # any valid token id
            self.positions[t:padded_t].fill_(0)  # a valid rotary row
            self.slot_mapping[t:padded_t].fill_(_PAD_SLOT)  # store nothing
            self.seq_lens[b:size].fill_(q)  # each query sees >= 1 key...
            # ...all in the dummy block, in every column q positions reach.
            cols = max(w, math.ceil(q / self.block_size))
            self.block_table[b:size, :cols].fill_(_DUMMY_BLOCK)

    def forward_args(
        self, q: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`(input_ids, positions, metadata)` over the first `size` sequences of q tokens.

        The host fields are bounds, not values: the graph captured with them is replayed for
        sequences of every length up to max_model_len.
        """
        t = size * q
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            query_start_loc=self.query_start_loc[q][: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=q,
            max_seq_len=self.max_model_len,
            query_start_loc_host=np.arange(0, t + 1, q, dtype=np.int32),
            seq_lens_host=np.full(size, self.max_model_len, dtype=np.int32),
        )
        return self.input_ids[:t], self.positions[:t], meta


class DecodeGraphRunner:
    """Runs uniform batches (q tokens per sequence) through captured graphs (see the module
    docstring).

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
        max_num_batched_tokens: int | None = None,
        query_lens: Iterable[int] = (1,),
        set_lora: Callable[[bool], None] | None = None,
    ) -> None:
        """`max_num_batched_tokens`: the step's token budget (None: none beyond max_num_seqs
        sequences of the longest q). `set_lora(on)`: with LoRA, turns the model's LoRA terms on
        or off for a capture (`rank_worker.lora.layers.AdapterBatch.capture_mode`); None
        without LoRA."""
        query_lens = tuple(query_lens)
        budget = max_num_batched_tokens
        if budget is None:
            budget = max_num_seqs * max(query_lens, default=1)
        self.model = model
        self.kv_caches = kv_caches
        self.ladders = ladders(query_lens, max_num_seqs, budget, max_model_len)
        if not self.ladders:
            raise ValueError(
                f"no batch of query lengths {query_lens} fits {max_num_seqs} sequences, "
                f"{budget} tokens and max_model_len {max_model_len}"
            )
        self.buffers = StaticDecodeBuffers(
            {q: sizes[-1] for q, sizes in self.ladders.items()}, max_model_len, block_size, device
        )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (q, size) ->
        self.outputs: dict[tuple[int, int], Outputs] = {}  # (q, size) -> in the graph pool
        # With LoRA: the graphs without the LoRA terms, for steps with no adapter.
        self.set_lora = set_lora
        self.base_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.base_outputs: dict[tuple[int, int], Outputs] = {}
        self.num_replays = 0
        self.num_base_replays = 0  # of them, replays of a graph without LoRA
        # Steps run per q: replayed, and run eagerly on the padded buffers (nothing captured).
        self.replays_by_query_len: Counter[int] = Counter()
        self.eager_runs_by_query_len: Counter[int] = Counter()
        # Of all those runs, per q, the ones with padding sequences (b < size).
        self.padded_runs_by_query_len: Counter[int] = Counter()

    @property
    def sizes(self) -> list[int]:
        """The decode (q = 1) ladder."""
        return self.ladders.get(1, [])

    @property
    def captures_states(self) -> bool:
        """Whether the model keeps the target's states for an EAGLE-3 head (graph outputs)."""
        inner = getattr(self.model, "model", None)
        return bool(getattr(inner, "capture_layers", ()))

    def can_run(self, plan: StepPlan) -> bool:
        # Any context fits: the static block table is as wide as max_model_len needs.
        q = uniform_query_len(plan.query_start_loc)
        sizes = self.ladders.get(q) if q is not None else None
        return sizes is not None and graph_size_for(plan.num_seqs, sizes) is not None

    def _forward(self, q: int, size: int) -> Outputs:
        input_ids, positions, meta = self.buffers.forward_args(q, size)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [size*q, hidden]
        if not self.captures_states:
            return (hidden,)
        embeds, aux = self.model.model.captured  # [size*q, H], [size*q, n*H]
        return hidden, embeds, aux

    def _capture_order(self) -> list[tuple[int, int]]:
        """Every (q, size), the most tokens first (see `capture`); ties by q, so that the
        order is the same on every rank."""
        keys = [(q, size) for q, sizes in self.ladders.items() for size in sizes]
        return sorted(keys, key=lambda key: (-key[0] * key[1], key[0]))

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Capture one graph per (q, size), the most tokens first, all in one memory pool
        (`pool`, shared with the mixed-step graphs; None: a new one).

        Most tokens first: the pool grows to the largest batch's activations once and the
        smaller graphs reuse that memory. Sharing is safe because replays never overlap and each
        output is consumed before the next replay. Each graph's batch runs once eagerly before
        its capture, so that Triton compiles (and NCCL sets up) outside the capture, where both
        would fail. The buffers hold padding (slot -1) throughout: nothing is stored.
        """
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        if self.set_lora is not None:
            self.set_lora(True)
        self._capture_set(self.graphs, self.outputs, pool)
        if self.set_lora is not None:
            self.set_lora(False)
            self._capture_set(self.base_graphs, self.base_outputs, pool)
        logger.info(
            "captured CUDA graphs for batch sizes %s by tokens per sequence%s",
            self.ladders,
            " (with and without LoRA)" if self.set_lora is not None else "",
        )

    def _capture_set(
        self,
        graphs: dict[tuple[int, int], torch.cuda.CUDAGraph],
        outputs: dict[tuple[int, int], Outputs],
        pool: Any,
    ) -> None:
        """One graph per (q, size) (see `capture`), into `graphs` and `outputs`."""
        for q, size in self._capture_order():
            self._forward(q, size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[q, size] = self._forward(q, size)
            graphs[q, size] = graph
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
        """Hidden states `[T, hidden]` of a step that `can_run` (b sequences of q tokens, T =
        b*q), from its prepared inputs (`input_prep.prepare_inputs`); with an EAGLE-3 head,
        `model.model.captured` then holds the step's states `[T, ...]`. `base_only`: no
        sequence has a LoRA adapter, so the graph without LoRA serves (where there is one)."""
        b = inputs.meta.num_seqs
        q = uniform_query_len(inputs.meta.query_start_loc_host)
        sizes = self.ladders.get(q) if q is not None else None
        size = None if sizes is None else graph_size_for(b, sizes)
        if q is None or size is None:
            raise ValueError(
                f"step {inputs.step_id}: no captured graph fits {b} sequences of "
                f"{'unequal numbers of' if q is None else q} tokens"
            )
        self.buffers.load(inputs, q, size)
        self.padded_runs_by_query_len[q] += b < size
        key = (q, size)
        base = base_only and key in self.base_graphs
        graph = (self.base_graphs if base else self.graphs).get(key)
        if graph is None:
            outputs = self._forward(q, size)
            self.eager_runs_by_query_len[q] += 1
        else:
            graph.replay()
            outputs = (self.base_outputs if base else self.outputs)[key]
            self.num_replays += 1
            self.num_base_replays += base
            self.replays_by_query_len[q] += 1
        t = b * q
        if self.captures_states and len(outputs) == 1:
            raise RuntimeError(
                f"step {inputs.step_id}: the graphs were captured before the model kept states"
            )
        if len(outputs) > 1:
            # As an eager forward of the step's own T tokens leaves it.
            self.model.model.captured = (outputs[1][:t], outputs[2][:t])
        return outputs[0][:t]
