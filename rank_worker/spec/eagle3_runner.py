"""EAGLE-3 on one rank: the head beside the target, its own one-layer KV cache, and the two
passes that use it. Every rank runs both passes with the same inputs (the head is replicated:
`rank_worker.spec.eagle3_head` says why), so the ranks stay in lock-step through the target's
embedding, the only collective here.

Entry p of a sequence (the head's K/V at slot p) needs the target's states at p and the token
at p + 1. So the passes are:

    RUN plan, tokens at positions c .. c+m-1 (after the target's forward, which captured its
    embeddings and the three aux states of every token):
        entries c-1 .. c+m-2 (their K/V alone, `Eagle3Head.store_entries`: nothing reads
        their outputs): token x_q beside the states of position q - 1. Entry c-1 takes
        the states of position c-1 from the previous RUN plan (kept here, `_Kept`); without
        them (c = 0, or position c-1 was not in that plan) the sequence starts at entry c.
        A verify entry's positions after its first rejected draft get entries from rejected
        tokens; they are rewritten before anything attends to them (next step's entry c-1
        and the chain below), and attention never reads past a sequence's length.
    DRAFT plan (one token per drafting sequence: its last token x_L, seq_len L):
        chain step 0: entry L-1, x_L beside the kept states of position L-1 -> draft 1;
        chain step j: entry L-1+j, draft j beside step j-1's y -> draft j+1, for the
        sequences that want more than j drafts (`eagle_drafts` section).
        Returns `[R, max drafts]` int64 target ids (rank 0 hands them to the proposer).

"Kept" is the previous RUN plan's fc(states) `[T_prev, H]` and its layout (rows, first
positions, lengths): looked up by (row, position). A row rewritten from column 0 since (a new
sequence in it) is forgotten, so a newcomer never reads its predecessor's states. Nothing here
is request state: it is the last step's tensors, as the block-table mirror is the last
plans' tables.

CUDA graphs: where the target's decode graphs are on, the DRAFT plan's chain replays one
graph per batch size (`rank_worker.spec.eagle3_graphs`; the host work left is `prepare_inputs` of the
plan and the `_Kept` lookup), and the target's graphs return its captured states
(`rank_worker.runner.cuda_graphs`). The RUN plan's pass (`after_run`) stays eager: its entries
depend on which tokens the previous plan kept, a host-side lookup per sequence.

Not yet done (none of it needed for exact outputs):
- Memory: the KV sizing's warm-up forward captures the states (counted), but does not run the
  head's pass. (Sleep gives back the head's weights, kept on the host at both levels, and its
  cache: `rank_worker.runner.device_sleep`.)
- Entry p depends on the token after p, which the prefix cache's hash of p's block does not
  cover. A hit starts a sequence at c > 0 with no kept states for entry c - 1, so that entry
  keeps what the block's first owner wrote (the new sequence writes nothing into a cached
  block). That can only cost acceptance, never exactness (verification is exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rank_worker.attention.backend import AttentionBackend
from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.input_prep import StepInputBuffers, StepInputs, prepare_inputs
from rank_worker.kv.cache import KVCacheSpec, allocate_kv_cache
from rank_worker.models.qwen3 import KVCachePair
from rank_worker.spec.eagle3_format import Eagle3HeadConfig, load_eagle3_tensors, read_eagle3_config
from rank_worker.spec.eagle3_graphs import DraftChainGraphs
from rank_worker.spec.eagle3_head import Eagle3Head
from shm_ipc.step_plan import Command, StepPlan

_NO_EDITS = {
    "edit_rows": np.zeros(0, np.int32),
    "edit_starts": np.zeros(0, np.int32),
    "edit_offsets": np.zeros(1, np.int32),
    "edit_blocks": np.zeros(0, np.int32),
}


@dataclass
class _Kept:
    """The previous RUN plan's head inputs: fc(states) per token and where each row's were."""

    states: torch.Tensor  # [T_prev, H] fc output of every token of that plan
    slot_of_row: dict[int, int]  # batch row -> its sequence's index in that plan
    first_pos: np.ndarray  # [B_prev] position of each sequence's first token there
    num_tokens: np.ndarray  # [B_prev] its tokens there
    start: np.ndarray  # [B_prev] index of its first token in `states`

    def lookup(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Index into `states` of (row, position) for each pair, -1 where that plan did not
        compute it."""
        out = np.full(rows.size, -1, dtype=np.int64)
        for i, (row, pos) in enumerate(zip(rows.tolist(), positions.tolist(), strict=True)):
            s = self.slot_of_row.get(row)
            if s is not None and 0 <= pos - self.first_pos[s] < self.num_tokens[s]:
                out[i] = self.start[s] + pos - self.first_pos[s]
        return out


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated `arange(starts[i], starts[i] + lengths[i])`."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total)


class Eagle3Runner:
    """This rank's EAGLE-3 head and cache (see the module docstring)."""

    def __init__(
        self,
        head_dir: str,
        cfg: Eagle3HeadConfig,
        embed: torch.nn.Module,
        backend: AttentionBackend,
        *,
        block_size: int,
        max_positions: int,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.embed = embed  # the target's (vocab-parallel: one all-reduce per call at TP > 1)
        self.device = device
        self.head = Eagle3Head(
            cfg, backend, max_positions=max_positions, dtype=dtype, device=device
        )
        self.head.load(load_eagle3_tensors(head_dir, cfg))
        self.head.eval()
        self.kv_spec = KVCacheSpec(1, cfg.num_kv_heads, cfg.head_dim, block_size, kv_cache_dtype)
        self.kv_cache: KVCachePair | None = None
        self._kept: _Kept | None = None
        # The aux states of the tokens the last RUN plan's `hidden_rows` section named.
        self._requested: torch.Tensor | None = None
        self.max_model_len = max_positions
        # The chain's CUDA graphs (`eagle3_graphs`), built beside the target's decode graphs.
        self.chain_graphs: DraftChainGraphs | None = None

    @classmethod
    def for_runner(cls, runner: Any) -> Eagle3Runner:
        """The head of `runner.config.eagle3_head` beside `runner`'s target, whose forward
        then captures the head's three states (`Qwen3Model.capture_layers`)."""
        head_dir = runner.config.eagle3_head
        cfg = read_eagle3_config(head_dir, runner.hf_config)  # refusals, again on every rank
        target = runner.model.model
        target.capture_layers = cfg.capture_layers
        return cls(
            head_dir,
            cfg,
            target.embed_tokens,
            runner.attention_backend,
            block_size=runner.config.block_size,
            max_positions=int(runner.config.max_model_len),
            dtype=runner.dtype,
            kv_cache_dtype=runner.kv_cache_dtype,
            device=runner.device,
        )

    def take_hidden_states(self) -> torch.Tensor | None:
        """`[R, 3H]`: the target states of the tokens the last RUN plan asked for (its
        `hidden_rows` section), once; None when it asked for none."""
        out, self._requested = self._requested, None
        return out

    def allocate(self, num_blocks: int) -> None:
        """The head's cache on the pool's block ids (a block of the pool holds both models')."""
        self.kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, self.device)[0]
        self._kept = None

    def build_chain_graphs(self, num_steps: int, max_num_seqs: int, *, capture: bool) -> None:
        """The chain's graphs for chains of `num_steps` drafts and up to `max_num_seqs` rows,
        captured (a GPU; every rank alike: the embedding's all-reduce is captured) or, with
        `capture` False, the padded chain run eagerly (`TP_ENGINE_DECODE_GRAPHS=padded`)."""
        assert self.kv_cache is not None, "allocate() first"
        self.chain_graphs = DraftChainGraphs(
            self.head,
            self.embed,
            self.kv_cache,
            num_steps=num_steps,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.kv_spec.block_size,
            device=self.device,
        )
        if capture:
            self.chain_graphs.capture()

    def release_chain_graphs(self) -> None:
        """Drop the chain's graphs (before sleep releases what they hold, and at release)."""
        if self.chain_graphs is not None:
            self.chain_graphs.release()
            self.chain_graphs = None

    def forget_rewritten_rows(self, plan: StepPlan) -> None:
        """Rows that `plan` rewrites from column 0 hold a new sequence: drop what was kept."""
        if self._kept is not None and plan.edit_rows.size:
            for row in plan.edit_rows[plan.edit_starts == 0].tolist():
                self._kept.slot_of_row.pop(int(row), None)

    # -- the RUN plan's pass -------------------------------------------------------------------

    @torch.inference_mode()
    def after_run(
        self,
        plan: StepPlan,
        embeds: torch.Tensor,
        aux: torch.Tensor,
        tables: BlockTables,
        buffers: StepInputBuffers,
    ) -> None:
        """Write the head's entries for `plan`'s tokens (module docstring); `embeds [T, H]` and
        `aux [T, 3H]` are what the target's forward captured for them."""
        assert self.kv_cache is not None, "allocate() first"
        asked = plan.section("hidden_rows").astype(np.int64)
        if asked.size and asked.max() >= plan.num_tokens:
            raise ValueError(
                f"step {plan.step_id}: hidden_rows names token {asked.max()}, the plan has "
                f"{plan.num_tokens}"
            )
        self._requested = aux[torch.from_numpy(asked).to(self.device)] if asked.size else None
        self.forget_rewritten_rows(plan)
        qsl = plan.query_start_loc.astype(np.int64)
        q_lens = qsl[1:] - qsl[:-1]  # [B]
        first_pos = plan.seq_lens.astype(np.int64) - q_lens  # [B] c
        rows = plan.rows.astype(np.int64)
        states = self.head.fc_states(aux)  # [T, H]
        t = states.shape[0]
        prev = (
            self._kept.lookup(rows, first_pos - 1)
            if self._kept is not None
            else np.full(rows.size, -1, dtype=np.int64)
        )
        has_prev = (prev >= 0) & (q_lens > 0)
        n_entries = q_lens - 1 + has_prev  # [B]
        keep = n_entries > 0
        tok_idx = _ranges((qsl[:-1] + 1 - has_prev)[keep], n_entries[keep])  # [E] token indices
        # Entry of token t takes the states of token t-1, or the kept ones for a first token.
        src = tok_idx - 1
        first = np.zeros(t + 1, dtype=bool)
        first[qsl[:-1][has_prev]] = True
        firsts = first[tok_idx]
        src[firsts] = t + prev[np.searchsorted(qsl[:-1], tok_idx[firsts], side="right") - 1]
        if tok_idx.size:
            pool = states if self._kept is None else torch.cat([states, self._kept.states])
            index = torch.from_numpy(src).to(self.device)
            head_plan = StepPlan(
                step_id=plan.step_id,
                command=Command.RUN,
                input_ids=np.zeros(tok_idx.size, dtype=np.int32),  # embeddings come captured
                query_start_loc=np.concatenate([[0], np.cumsum(n_entries[keep])]).astype(np.int32),
                seq_lens=(plan.seq_lens[keep] - 1).astype(np.int32),
                rows=plan.rows[keep],
                logits_indices=np.zeros(0, dtype=np.int32),
                **_NO_EDITS,
            )
            inputs = prepare_inputs(head_plan, tables, buffers=buffers)
            tok = torch.from_numpy(tok_idx).to(self.device)
            self.head.store_entries(
                embeds[tok], pool[index], inputs.positions, inputs.meta.slot_mapping, self.kv_cache
            )
        self._kept = _Kept(
            states=states,
            slot_of_row={int(r): i for i, r in enumerate(rows.tolist())},
            first_pos=first_pos,
            num_tokens=q_lens,
            start=qsl[:-1],
        )

    # -- the DRAFT plan's chain ----------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, plan: StepPlan, tables: BlockTables, buffers: StepInputBuffers) -> torch.Tensor:
        """`[R, max drafts]` int64 target ids: row i's first `eagle_drafts[i]` are its drafts
        (the rest is garbage). Through the chain's graphs when they fit (`eagle3_graphs`)."""
        assert self.kv_cache is not None, "allocate() first"
        wanted = plan.section("eagle_drafts").astype(np.int64)
        if wanted.size != plan.num_seqs:
            raise ValueError(f"step {plan.step_id}: an EAGLE-3 DRAFT plan needs eagle_drafts")
        self.forget_rewritten_rows(plan)
        inputs = prepare_inputs(plan, tables, buffers=buffers)  # the step's table edits too
        chain = self.chain_graphs
        if chain is not None and chain.can_run(plan.num_seqs, wanted):
            # The kept states go straight into the chain's static rows.
            self._kept_states(plan, out=chain.buffers.hidden[: plan.num_seqs])
            return chain.run(inputs, plan.rows, wanted, tables)
        hidden = self._kept_states(plan)  # [R, H]
        return self._eager_chain(plan, inputs, hidden, wanted, tables, buffers)

    def _kept_states(self, plan: StepPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[R, H]` (into `out` when given): fc(target states at L-1) of each row, from the
        last RUN plan. Missing states (the row was not in that plan) are zeros: a poor draft,
        never a wrong output (verification is exact)."""
        last_pos = plan.seq_lens.astype(np.int64) - 1  # entry L-1 of each sequence
        idx = (
            self._kept.lookup(plan.rows.astype(np.int64), last_pos)
            if self._kept is not None
            else np.full(plan.num_seqs, -1, dtype=np.int64)
        )
        if out is None:
            dtype = self.head.fc.weight.dtype
            out = torch.empty(plan.num_seqs, self.cfg.hidden_size, dtype=dtype, device=self.device)
        hidden = out.zero_()
        found = np.flatnonzero(idx >= 0)
        if found.size:
            assert self._kept is not None
            hidden[torch.from_numpy(found).to(self.device)] = self._kept.states[
                torch.from_numpy(idx[found]).to(self.device)
            ]
        return hidden

    def _eager_chain(
        self,
        plan: StepPlan,
        inputs: StepInputs,
        hidden: torch.Tensor,
        wanted: np.ndarray,
        tables: BlockTables,
        buffers: StepInputBuffers,
    ) -> torch.Tensor:
        """The chain step by step, each over the rows that still want a draft."""
        num = plan.num_seqs
        y = self.head(
            self.embed(inputs.input_ids), hidden, inputs.positions, inputs.meta, self.kv_cache
        )
        tokens = self.head.draft_tokens(y)  # [R]
        out = torch.zeros(num, int(wanted.max(initial=1)), dtype=torch.int64, device=self.device)
        out[:, 0] = tokens
        sel_prev = np.arange(num)
        for j in range(1, out.shape[1]):
            sel = np.flatnonzero(wanted > j)  # sequences drafting a (j+1)-th token
            # Where each of them sat in the previous chain step's batch.
            at_prev = torch.from_numpy(np.searchsorted(sel_prev, sel)).to(self.device)
            step = StepPlan(
                step_id=plan.step_id,
                command=Command.RUN,
                input_ids=np.zeros(sel.size, dtype=np.int32),
                query_start_loc=np.arange(sel.size + 1, dtype=np.int32),
                seq_lens=(plan.seq_lens[sel] + j).astype(np.int32),
                rows=plan.rows[sel],
                logits_indices=np.zeros(0, dtype=np.int32),
                **_NO_EDITS,
            )
            step_inputs = prepare_inputs(step, tables, buffers=buffers)
            y = self.head(
                self.embed(tokens[at_prev]),
                y[at_prev],
                step_inputs.positions,
                step_inputs.meta,
                self.kv_cache,
            )
            tokens = self.head.draft_tokens(y)
            out[torch.from_numpy(sel).to(self.device), j] = tokens
            sel_prev = sel
        return out
