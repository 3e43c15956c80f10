"""What attention needs to know about the batch, beyond q/k/v themselves.

Built once per step by `input_prep.prepare_inputs` from the StepPlan and passed as an argument
through the model's forward into every attention layer (no module-level context), so that two
steps can never see each other's metadata.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Paged-attention layout of one step's batch.

    B sequences, T new tokens; sequence i's new tokens are rows
    `query_start_loc[i] : query_start_loc[i+1]` and are the LAST `q_len_i` positions of its
    `seq_lens[i]`-token context, whose earlier K/V are already in the cache. That one rule covers a
    plain prefill (q_len == seq_len), a prefill with a cached prefix or a later chunk of a chunked
    prefill (q_len < seq_len), and a decode (q_len == 1).
    """

    # [T] int64 flat cache slot (block_id * block_size + offset) for each new token's K/V;
    # negative means "do not store" (padding tokens, e.g. in a CUDA-graph batch).
    slot_mapping: torch.Tensor
    # [B+1] int32 prefix sums of new tokens per sequence.
    query_start_loc: torch.Tensor
    # [B] int32 context length of each sequence after this step (cached + new).
    seq_lens: torch.Tensor
    # [B, W] int32 physical block ids of each sequence; entries past a sequence's own blocks
    # are padding and never read (seq_lens bounds every read).
    block_table: torch.Tensor
    # Longest query (new tokens of one sequence) and longest context in the batch, so that
    # kernels can size their grids without a device-to-host copy.
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens: the torch backend loops over sequences on
    # the host, and reading these from the GPU would force a sync per layer. In a batch
    # captured in a CUDA graph, max_seq_len and seq_lens_host hold an upper bound
    # (max_model_len), not the lengths the graph is replayed with (see `AttentionBackend`).
    query_start_loc_host: np.ndarray
    seq_lens_host: np.ndarray
    # Derived once per step (not per layer) in __post_init__: the sequences at the head of the
    # batch with exactly one new token (the scheduler puts running decodes first). In a mixed
    # batch they go to the split-KV decode kernel and the rest to the prefill kernel.
    num_leading_decodes: int = field(init=False)
    # Whether every sequence after the leading decodes is a fresh prompt (q_len == seq_len: no
    # cached prefix, not a later chunk), whose keys are all among the step's own K/V rows: the
    # triton backend may then attend from those dense rows (`kernels.prefill_attention_tma`).
    fresh_prefill: bool = field(init=False)
    # What the attention backend decided for this step, by the first layer that asked, with
    # every argument check, and reused by the layers after it: its launches (grids, tiles,
    # split buffers, slices of the tensors above), keyed by the layouts of the per-layer
    # tensors they were checked for (`rank_worker.attention.triton_plan`). Per step, like the
    # rest of the metadata, so no step can launch with another's decisions.
    launches: dict[Hashable, object] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        qsl = self.query_start_loc_host
        not_one = np.flatnonzero((qsl[1:] - qsl[:-1]) != 1)
        n = int(not_one[0]) if not_one.size else self.num_seqs
        object.__setattr__(self, "num_leading_decodes", n)
        fresh = bool(np.array_equal(qsl[n + 1 :] - qsl[n:-1], self.seq_lens_host[n:]))
        object.__setattr__(self, "fresh_prefill", n < self.num_seqs and fresh)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_host.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_host[-1])

    @property
    def query_lens_host(self) -> np.ndarray:
        """[B] new tokens per sequence."""
        return np.diff(self.query_start_loc_host)
