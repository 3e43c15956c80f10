"""CUDA graphs for the EAGLE-3 draft chain: the k chained head steps of a DRAFT plan in one
graph per batch size.

A DRAFT plan's chain (`Eagle3Runner.draft`) is k one-token-per-sequence steps of a one-layer
head: a few dozen small kernels each, launched k times, with host work between the steps. Here
the whole chain is captured once per batch size and replayed with one launch; the host work
left is the plan's own input preparation and the lookup of each row's kept target states.

Static inputs (`ChainBuffers`, rows of the largest size; batch `size` uses the first `size`):

    tokens       [N]     int64  the last token x_L of each row (chain step 0's input)
    hidden       [N, H]         fc(target states at L-1), zeros where none were kept
    seq_lens     [N]     int32  L: the entries before the chain's first
    wanted       [N]     int32  drafts the row wants; 0 in padding rows
    block_table  [N, W]  int32  whole mirror rows (W = ceil(max_model_len / block_size)), so
                                that every position a draft reaches has its block

Chain step j works out each row's entry on the device, from those buffers alone:

    live      = wanted > j
    position  = L - 1 + j                  (live)   0   (not)
    seq_len   = L + j                      (live)   1   (not)
    slot      = its block's slot           (live)  -1   (not: stores nothing)

so a row that wants fewer drafts than the others, and a padding row, compute finite garbage
against position 0 of their first block (column 0 of a real row is its own first block;
padding rows read block 0) and write nowhere; their tokens past `wanted` are never read (the
proposer keeps row i's first `wanted[i]`). One graph therefore serves every DRAFT plan whose
rows want at most k drafts, whatever the mix. The attention metadata's host fields are bounds
(`max_model_len`), as for the target's decode graphs (`rank_worker.runner.cuda_graphs`).

Where it runs: beside the target's decode graphs, under the same conditions
(`cuda_graphs.disabled_reason`), captured after them, and dropped with them on sleep (a graph
holds the target embedding's addresses, which sleep gives back). Before `capture` (and on CPU)
`run` executes the same chain eagerly over the same padded buffers: the tests compare it with
the plain chain.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.graph_sizes import capture_sizes, graph_size_for
from rank_worker.inputs.input_prep import StepInputs
from rank_worker.models.qwen3 import KVCachePair
from rank_worker.spec.eagle3_head import Eagle3Head

logger = logging.getLogger(__name__)

# What padding rows read: block 0 always exists (any allocated block would do).
_DUMMY_BLOCK = 0


class ChainBuffers:
    """The chain's static inputs (see the module docstring)."""

    def __init__(
        self, max_size: int, hidden_size: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_size = max_size
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_size, **i64)  # [N]
        self.hidden = torch.zeros(max_size, hidden_size, dtype=dtype, device=device)  # [N, H]
        self.seq_lens = torch.ones(max_size, **i32)  # [N]
        self.wanted = torch.zeros(max_size, **i32)  # [N]
        self.block_table = torch.full((max_size, width), _DUMMY_BLOCK, **i32)  # [N, W]
        self.query_start_loc = torch.arange(max_size + 1, **i32)  # [N+1], never changes

    @property
    def width(self) -> int:
        return int(self.block_table.shape[1])

    def load(
        self,
        inputs: StepInputs,
        rows: np.ndarray,
        wanted: np.ndarray,
        tables: BlockTables,
        size: int,
    ) -> None:
        """A DRAFT plan's chain inputs into the first `size` rows, padded: `inputs` prepared
        from the plan (its table edits applied), `rows`/`wanted [b]` its batch rows and drafts
        wanted. The caller has written the rows' kept states into `hidden[:b]`."""
        b = inputs.meta.num_seqs
        if b > size or size > self.max_size:
            raise ValueError(
                f"step {inputs.step_id}: {b} rows do not fit a chain of {size} "
                f"(static buffers hold {self.max_size})"
            )
        if tables.max_blocks != self.width:
            raise ValueError(
                f"step {inputs.step_id}: block tables {tables.max_blocks} wide, the chain's "
                f"static table {self.width}"
            )
        self.tokens[:b].copy_(inputs.input_ids)
        self.seq_lens[:b].copy_(inputs.meta.seq_lens)
        # One host-to-device copy for the rows and what they want.
        host = torch.from_numpy(np.stack([rows, wanted]).astype(np.int64))  # [2, b]
        on_device = host.to(self.tokens.device, non_blocking=True)
        self.wanted[:b].copy_(on_device[1])
        self.block_table[:b].copy_(tables.gather(on_device[0], self.width))
        if b < size:
            self.tokens[b:size].fill_(0)  # any valid token id
            self.hidden[b:size].fill_(0)  # finite
            self.seq_lens[b:size].fill_(1)
            self.wanted[b:size].fill_(0)  # no live step: stores nothing
            self.block_table[b:size].fill_(_DUMMY_BLOCK)


class DraftChainGraphs:
    """The chain of `num_steps` head steps per captured batch size (see the module docstring).

    `embed`: the target's embedding (vocab-parallel: an all-reduce per step at TP > 1, which the
    graph captures with NCCL); `head` and `kv_cache`: the head and its one-layer cache.
    """

    def __init__(
        self,
        head: Eagle3Head,
        embed: torch.nn.Module,
        kv_cache: KVCachePair,
        *,
        num_steps: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"a draft chain needs at least one step, got {num_steps}")
        self.head = head
        self.embed = embed
        self.kv_cache = kv_cache
        self.num_steps = num_steps
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        width = math.ceil(max_model_len / block_size)
        self.buffers = ChainBuffers(
            self.sizes[-1], head.cfg.hidden_size, width, head.fc.weight.dtype, device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, num_steps] int64, in the pool
        self.num_replays = 0
        self.num_padded_runs = 0  # chains run eagerly over the padded buffers (no graph)

    def can_run(self, num_seqs: int, wanted: np.ndarray) -> bool:
        """Whether a chain of `num_seqs` rows wanting `wanted` drafts fits a captured size."""
        return (
            graph_size_for(num_seqs, self.sizes) is not None
            and int(wanted.max(initial=0)) <= self.num_steps
        )

    def _chain(self, size: int) -> torch.Tensor:
        """The chain over the first `size` rows of the buffers: `[size, num_steps]` target ids.
        Device work only (what a capture records)."""
        buf, bs = self.buffers, self.block_size
        tokens, hidden = buf.tokens[:size], buf.hidden[:size]
        first_len = buf.seq_lens[:size].long()  # [size] L
        wanted, table = buf.wanted[:size], buf.block_table[:size]
        meta_bounds = dict(
            query_start_loc=buf.query_start_loc[: size + 1],
            block_table=table,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_host=np.arange(size + 1, dtype=np.int32),
            seq_lens_host=np.full(size, self.max_model_len, dtype=np.int32),
        )
        drafts = []
        for j in range(self.num_steps):
            live = wanted > j  # [size] bool
            positions = torch.where(live, first_len - 1 + j, 0)  # [size] int64
            block = table.gather(1, (positions // bs).unsqueeze(1)).squeeze(1).long()
            slots = torch.where(live, block * bs + positions % bs, -1)  # [size] int64
            seq_lens = torch.where(live, first_len + j, 1).to(torch.int32)
            meta = AttentionMetadata(slot_mapping=slots, seq_lens=seq_lens, **meta_bounds)
            hidden = self.head(self.embed(tokens), hidden, positions, meta, self.kv_cache)
            tokens = self.head.draft_tokens(hidden)  # [size] int64
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, in a memory pool of their own (see
        `DecodeGraphRunner.capture` for why largest first and why each size runs once eagerly
        first). The buffers hold padding rows (nothing live): nothing is stored."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._chain(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._chain(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for the EAGLE-3 chain (%d steps), batch sizes %s",
            self.num_steps,
            self.sizes,
        )

    def release(self) -> None:
        """Drop the graphs and their outputs; `run` cannot be called again."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.kv_cache = None  # type: ignore[assignment]

    @torch.inference_mode()
    def run(
        self, inputs: StepInputs, rows: np.ndarray, wanted: np.ndarray, tables: BlockTables
    ) -> torch.Tensor:
        """`[b, max(wanted)]` int64 target ids of a DRAFT plan that `can_run` (arguments as
        `ChainBuffers.load`): row i's first `wanted[i]` are its drafts, the rest garbage."""
        b = inputs.meta.num_seqs
        if not self.can_run(b, wanted):
            raise ValueError(f"step {inputs.step_id}: no captured chain fits this DRAFT plan")
        size = graph_size_for(b, self.sizes)
        self.buffers.load(inputs, rows, wanted, tables, size)
        graph = self.graphs.get(size)
        if graph is None:
            out = self._chain(size)
            self.num_padded_runs += 1
        else:
            graph.replay()
            out = self.outputs[size]
            self.num_replays += 1
        return out[:b, : int(wanted.max(initial=1))]
