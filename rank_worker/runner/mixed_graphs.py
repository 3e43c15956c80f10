"""CUDA graphs for mixed steps: steps that carry prompt tokens (prefills, chunks of long prompts,
prompts after a cached prefix), alone or beside decodes, captured by token count.

The decode graphs (`rank_worker.runner.cuda_graphs`) take uniform steps only; a step with a
prompt in it has a different split of tokens between sequences every time. As vLLM's full
graphs for mixed batches do with FlashAttention 3, these graphs are keyed by the step's token
count alone, in buckets (`token_buckets`: 8, 16, 32, 64, then every 64 up to 512, then every
256, up to the largest, `RunnerConfig.cuda_graph_max_tokens`), and attention reads every
per-sequence fact from static device buffers:

    tokens  | real tokens [0, t)                 | padding [t, T)          |
    seqs    | real sequences 0 .. b-1            | b: the padding sequence | b+1 .. S-1: empty |
    qsl     | 0 .. t (the step's)                | t, then T               | T ...             |
    seq_len | the step's                         | T - t                   | 0                 |
    slots   | the step's                         | -1 (store nothing)      |                   |
    table   | the step's blocks (columns past    | block 0 (dummy) in the  | never read        |
            | them: stale, never read)           | columns T - t reaches   |                   |

S = min(max_num_seqs, T) + 1 rows: a step of b <= min(max_num_seqs, t) sequences always leaves
row b for the padding sequence. Its T - t queries attend causally to T - t keys of the dummy
block (each query sees at least one key: finite garbage, sliced off) and store nothing, so no
real block is written; the empty rows compute nothing. Capture runs the empty step (b = t = 0:
the padding sequence holds all T tokens).

Attention through the Triton backend: one launch of the paged prefill kernel over all S rows,
decodes included (the prefill kernel treats a one-token sequence as a query at its last
position). Its grid, `(cdiv(T, BLOCK_M), S, kv_heads)`, is fixed per bucket: the host fields
of the metadata are the capture's (`max_query_len` = T, `query_start_loc_host` the capture's
layout, `seq_lens_host` and `max_seq_len` the bound max(max_model_len, T_max)), and the kernel
reads the lengths on the device; programs past a sequence's query length return at once
(`kernels.prefill_attention`, `if m_block * BLOCK_M >= q_len: return`). The capture's layout
has no leading decode (`num_leading_decodes` 0: the split-KV decode kernel, whose share of the
batch changes every step, is not launched) and is no fresh prefill (`fresh_prefill` False: the
TMA path, which attends from the step's dense K/V and ignores the cache, is never captured).
The cost: a decode over a long context is attended by one program per KV head instead of the
decode kernel's split, and idle programs launch. flash_attn's varlen call takes the same
bounds (its empty rows and bounds not yet checked on a GPU). The torch backend loops over host
lengths: never captured (`disabled_reason`), and on the padded CPU path below it reads the
host fields back from the static buffers themselves (`host_bounds=False`), so that a stale
buffer still shows.

Which step takes which path (`ModelRunner.execute`): a uniform step the decode graphs hold
replays one of those; any other step of at most the largest bucket's tokens replays the
smallest bucket that holds it (with LoRA, the graph without the LoRA terms when no sequence has
an adapter, as the decode graphs); a larger one, and everything when graphs are off, runs
eagerly. Every layer is captured, attention included: the Triton and flash_attn backends need
no piecewise graphs (layers captured, attention eager), so none are built; the torch backend
gets no graphs at all. The start-up log line names the buckets and the decode ladders.

Start-up (`rank_worker.runner.graph_setup`): the mixed graphs, largest bucket first, then the
decode graphs, all in one memory pool (replays never overlap, so the pool holds the largest
graph's activations once); the seconds and the device bytes the capture took are logged and
kept (`ModelRunner.startup_s["capture"]`, `ModelRunner.graph_memory_bytes`). The KV-cache
sizing, which runs before any graph exists, reserves the pool from a measured forward of the
largest graph's tokens, and a rank the graphs push past gpu_memory_utilization all the same
warns (`graph_setup`).

Tests: `TP_ENGINE_DECODE_GRAPHS=padded` builds this runner on CPU too, uncaptured; `run` then
runs the model eagerly on the same padded buffers (tests/test_mixed_step_graphs.py).

Ownership: as the decode graphs, one `MixedGraphRunner` per ModelRunner and its KV cache; the
step's prepared inputs are copied device-to-device into the buffers, padding filled on the
device.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.inputs.graph_sizes import graph_size_for, token_buckets
from rank_worker.inputs.input_prep import StepInputs
from rank_worker.runner_config import RunnerConfig
from shm_ipc.step_plan import StepPlan

logger = logging.getLogger(__name__)

# As the decode graphs': block 0 always exists; slot -1 stores nothing.
_DUMMY_BLOCK = 0
_PAD_SLOT = -1

# One graph's outputs: the hidden states `[T, hidden]`, then (EAGLE-3) the captured embeddings
# `[T, hidden]` and states `[T, n * hidden]`.
Outputs = tuple[torch.Tensor, ...]


class StaticMixedBuffers:
    """Device buffers for the largest bucket; a step in bucket T uses the first T tokens and the
    first `rows(T)` sequence rows (see the module docstring's layout)."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """`max_tokens`: the largest bucket; `max_seqs`: the most real sequences a step has."""
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.block_size = block_size
        # The longest context a row can have: a real sequence's, or the padding sequence's T.
        self.context_bound = max(max_model_len, max_tokens)
        width = math.ceil(self.context_bound / block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        t, n = max_tokens, self.rows(max_tokens)
        self.input_ids = torch.zeros(t, **i64)  # [T_max]
        self.positions = torch.zeros(t, **i64)  # [T_max]
        self.slot_mapping = torch.full((t,), _PAD_SLOT, **i64)  # [T_max]
        self.query_start_loc = torch.zeros(n + 1, **i32)  # [S_max + 1]
        self.seq_lens = torch.zeros(n, **i32)  # [S_max]
        self.block_table = torch.full((n, width), _DUMMY_BLOCK, **i32)  # [S_max, W]

    def rows(self, bucket: int) -> int:
        """Sequence rows of bucket T: as many real sequences as a step of T tokens can have,
        and the padding sequence."""
        return min(self.max_seqs, bucket) + 1

    @property
    def width(self) -> int:
        return int(self.block_table.shape[1])

    def load(self, inputs: StepInputs, bucket: int) -> None:
        """Copy a step's prepared inputs (b sequences, t tokens) into bucket T, padded.

        Device-to-device copies from the step's one host-to-device copy (placeholder ids
        already resolved); stream order puts them after the previous replay's reads."""
        meta = inputs.meta
        b, t, w = meta.num_seqs, meta.num_tokens, meta.block_table.shape[1]
        if bucket > self.max_tokens or t > bucket or b > self.rows(bucket) - 1:
            raise ValueError(
                f"step {inputs.step_id}: {b} sequences of {t} tokens do not fit the bucket of "
                f"{bucket} tokens (static buffers hold {self.max_tokens} tokens, "
                f"{self.max_seqs} sequences)"
            )
        if w > self.width:
            raise ValueError(
                f"step {inputs.step_id}: block table of width {w} exceeds the static width "
                f"{self.width}"
            )
        self.input_ids[:t].copy_(inputs.input_ids)
        self.positions[:t].copy_(inputs.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.query_start_loc[: b + 1].copy_(meta.query_start_loc)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_table[:b, :w].copy_(meta.block_table)
        self._pad(bucket, b, t)

    def load_padding(self, bucket: int) -> None:
        """The empty step: the padding sequence holds all T tokens (what capture runs)."""
        self.query_start_loc[:1].fill_(0)
        self._pad(bucket, 0, 0)

    def _pad(self, bucket: int, b: int, t: int) -> None:
        """Tokens [t, T) to the padding sequence b, rows after it empty (module docstring)."""
        rows, pad = self.rows(bucket), bucket - t
        self.input_ids[t:bucket].fill_(0)  # any valid token id
        self.positions[t:bucket].fill_(0)  # a valid rotary row
        self.slot_mapping[t:bucket].fill_(_PAD_SLOT)  # store nothing
        self.query_start_loc[b + 1 : rows + 1].fill_(bucket)
        self.seq_lens[b : b + 1].fill_(pad)  # each padding query sees >= 1 key...
        self.seq_lens[b + 1 : rows].fill_(0)
        # ...all in the dummy block, in every column its T - t positions reach.
        self.block_table[b, : math.ceil(pad / self.block_size)].fill_(_DUMMY_BLOCK)

    def forward_args(
        self, bucket: int, host_bounds: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`(input_ids, positions, metadata)` of bucket T. `host_bounds`: the host fields are
        the capture's, the same for every step (what a graph is captured with); False (the
        torch backend, CPU only): read back from the buffers."""
        rows = self.rows(bucket)
        if host_bounds:
            qsl_host = np.full(rows + 1, bucket, dtype=np.int32)  # the capture's layout
            qsl_host[0] = 0
            seq_lens_host = np.full(rows, self.context_bound, dtype=np.int32)
        else:
            qsl_host = self.query_start_loc[: rows + 1].cpu().numpy().copy()
            seq_lens_host = self.seq_lens[:rows].cpu().numpy().copy()
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_table=self.block_table[:rows],
            max_query_len=bucket,
            max_seq_len=int(seq_lens_host.max()),
            query_start_loc_host=qsl_host,
            seq_lens_host=seq_lens_host,
        )
        return self.input_ids[:bucket], self.positions[:bucket], meta


class MixedGraphRunner:
    """Runs steps of up to the largest bucket's tokens through graphs captured per bucket (see
    the module docstring). `run` works before `capture` too (and on CPU): it then runs the
    model eagerly on the same padded buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[Any],
        *,
        max_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        host_bounds: bool = True,
        set_lora: Callable[[bool], None] | None = None,
    ) -> None:
        """`host_bounds`: the attention backend runs on device lengths and host bounds (any
        backend a graph can capture); False for the torch backend (see `forward_args`).
        `set_lora`: as `DecodeGraphRunner`'s."""
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = token_buckets(max_tokens)
        self.buffers = StaticMixedBuffers(max_tokens, max_num_seqs, max_model_len, block_size,
                                          device)  # fmt: skip
        self.host_bounds = host_bounds
        self.set_lora = set_lora
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket ->
        self.outputs: dict[int, Outputs] = {}  # bucket -> in the graph pool
        self.base_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # without the LoRA terms
        self.base_outputs: dict[int, Outputs] = {}
        self.num_replays = 0
        self.num_base_replays = 0
        # Steps per bucket: replayed, and run eagerly on the padded buffers (nothing captured).
        self.replays_by_bucket: Counter[int] = Counter()
        self.eager_runs_by_bucket: Counter[int] = Counter()
        self.padding_tokens = 0  # summed over every run: the work padding cost

    @property
    def captures_states(self) -> bool:
        """Whether the model keeps the target's states for an EAGLE-3 head (graph outputs)."""
        inner = getattr(self.model, "model", None)
        return bool(getattr(inner, "capture_layers", ()))

    def bucket_for(self, num_tokens: int) -> int | None:
        return graph_size_for(num_tokens, self.buckets) if num_tokens >= 1 else None

    def can_run(self, plan: StepPlan) -> bool:
        bucket = self.bucket_for(plan.num_tokens)
        return bucket is not None and plan.num_seqs < self.buffers.rows(bucket)

    def _forward(self, bucket: int) -> Outputs:
        input_ids, positions, meta = self.buffers.forward_args(bucket, self.host_bounds)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [T, hidden]
        if not self.captures_states:
            return (hidden,)
        embeds, aux = self.model.model.captured  # [T, H], [T, n*H]
        return hidden, embeds, aux

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """One graph per bucket (two with LoRA), the largest first, into `pool` (None: a new
        one). Each runs once eagerly first, so that Triton compiles outside the capture; the
        buffers hold the empty step throughout: nothing is stored."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        sets = [(True, self.graphs, self.outputs)]
        if self.set_lora is not None:
            sets.append((False, self.base_graphs, self.base_outputs))
        for lora, graphs, outputs in sets:
            if self.set_lora is not None:
                self.set_lora(lora)
            for bucket in reversed(self.buckets):
                self.buffers.load_padding(bucket)
                self._forward(bucket)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs[bucket] = self._forward(bucket)
                graphs[bucket] = graph
        torch.cuda.synchronize()

    def release(self) -> None:
        """Drop the graphs, their outputs and the model; `run` cannot be called again."""
        for graph in (*self.graphs.values(), *self.base_graphs.values()):
            graph.reset()
        for held in (self.graphs, self.outputs, self.base_graphs, self.base_outputs):
            held.clear()
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]

    @torch.inference_mode()
    def run(self, inputs: StepInputs, base_only: bool = False) -> torch.Tensor:
        """Hidden states `[t, hidden]` of a step that `can_run`, as the eager forward returns
        them (with an EAGLE-3 head, `model.model.captured` sliced alike); valid until the next
        `run`. `base_only`: no sequence has a LoRA adapter."""
        t = inputs.meta.num_tokens
        bucket = self.bucket_for(t)
        if bucket is None:
            raise ValueError(
                f"step {inputs.step_id}: {t} tokens exceed the largest mixed-step bucket "
                f"({self.buckets[-1]})"
            )
        self.buffers.load(inputs, bucket)
        self.padding_tokens += bucket - t
        base = base_only and bucket in self.base_graphs
        graph = (self.base_graphs if base else self.graphs).get(bucket)
        if graph is None:
            outputs = self._forward(bucket)
            self.eager_runs_by_bucket[bucket] += 1
        else:
            graph.replay()
            outputs = (self.base_outputs if base else self.outputs)[bucket]
            self.num_replays += 1
            self.num_base_replays += base
            self.replays_by_bucket[bucket] += 1
        if self.captures_states and len(outputs) == 1:
            raise RuntimeError(
                f"step {inputs.step_id}: the graphs were captured before the model kept states"
            )
        if len(outputs) > 1:
            self.model.model.captured = (outputs[1][:t], outputs[2][:t])
        return outputs[0][:t]


def mixed_runner_for(
    model: torch.nn.Module,
    kv_caches: list[Any],
    config: RunnerConfig,
    device: torch.device,
    set_lora: Callable[[bool], None] | None,
    host_bounds: bool,
) -> MixedGraphRunner | None:
    """The mixed-step runner `ModelRunner.capture_graphs` builds, or None when
    `cuda_graph_max_tokens` says none."""
    max_tokens = config.resolved_cuda_graph_max_tokens
    if max_tokens < 2:
        return None
    return MixedGraphRunner(
        model, kv_caches, max_tokens=max_tokens, max_num_seqs=config.max_num_seqs,
        max_model_len=int(config.max_model_len), block_size=config.block_size, device=device,
        host_bounds=host_bounds, set_lora=set_lora,
    )  # fmt: skip
