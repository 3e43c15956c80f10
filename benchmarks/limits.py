"""The physical limit of an offline run: the shortest time the GPUs could possibly take.

The model (the issue's definition, a lower bound on the time):

    t_limit = prefill FLOPs / peak FLOP/s
            + sum over decode steps of (all weight bytes + running sequences' KV bytes) / peak B/s

Prefill is compute-bound, decode memory-bound. With tensor parallelism the N GPUs share both
the work and the bytes, so both peaks are multiplied by N. Decode FLOPs are reported as well
but not added (at these batch sizes they are far below the weight reads).

Counted, for a Qwen3 dense config:
- linear weights per layer: qkv (H x (nq + 2 nkv) d), o (nq d x H), gate/up/down (3 H I);
  norms: input and post-attention (2 H) and q/k norms (2 d); final norm H; LM head V H
  (shared with the embedding when tied, so counted once). The embedding is a gather, its
  bytes are counted only when it is not the LM head.
- prefill, per sequence of P tokens: 2 FLOPs per linear weight per token, attention
  QK^T and PV over the causal triangle (4 nq d FLOPs per query-key pair, P(P+1)/2 pairs per
  layer) and one LM-head row (2 V H) for the sampled token.
- decode: sequence i's prefill yields its first token; its k-th token (k = 2..O_i) is one
  decode step that reads its KV of P_i + k - 1 tokens (2 L nkv d values per token). Sequences
  run at once up to `max_num_seqs`; a finished one's slot goes to the next waiting one.

Mixture of experts (Qwen3-MoE: E experts of I_e features, k routed per token, in the sparse
layers; the others keep a dense MLP of I):
- a sparse layer holds a router (E H) and E experts (3 H I_e each); a token's FLOPs count the
  active parameters only: the router and its k experts (2 FLOPs per weight, as above).
- a decode step of B running sequences reads every non-expert weight and, per sparse layer, the
  experts its tokens route to: under uniform routing (each token picks k of E experts at
  random) the expected number of distinct experts is `E (1 - (1 - k/E)^B)`, from k at B = 1 to
  all E in large batches. Real routing is not uniform; skewed routing reads fewer experts,
  so this is the bound for a balanced router. With expert or tensor parallelism the ranks
  share those bytes (assumed evenly).

Per rank and per pipeline stage, with the links between GPUs (replicated KV heads, stages,
collectives, bubbles): `benchmarks.parallel_limits`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Qwen3 config.json that the limit depends on."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    # Mixture of experts; num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_sparse_layers: int = 0  # layers with experts; the others have the dense MLP

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        num_layers = cfg["num_hidden_layers"]
        # transformers 5 writes `num_local_experts`; the published configs `num_experts`.
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or ())
        sparse = (
            sum(1 for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
            if num_experts
            else 0
        )
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=num_layers,
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if num_experts else 0,
            num_sparse_layers=sparse,
        )

    @property
    def attention_params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h

    @property
    def linear_params_per_layer(self) -> int:
        """Linear weights of a dense layer: attention and the dense MLP."""
        return self.attention_params_per_layer + 3 * self.hidden_size * self.intermediate_size

    @property
    def params_per_expert(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_sparse_layers

    def _sparse_layer_params(self, num_experts: float) -> float:
        """Attention, router and `num_experts` experts of one sparse layer."""
        router = self.num_experts * self.hidden_size
        return self.attention_params_per_layer + router + num_experts * self.params_per_expert

    @property
    def active_linear_params(self) -> int:
        """Linear weights one token is multiplied by, over all layers (the LM head apart): every
        dense layer, and in each sparse layer attention, the router and k experts."""
        sparse = self._sparse_layer_params(self.num_experts_per_tok) if self.num_experts else 0
        return int(
            self.num_dense_layers * self.linear_params_per_layer + self.num_sparse_layers * sparse
        )

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_params(self) -> int:
        """Every parameter of the model (the embedding only when it is not the head): what a
        dense model's decode step reads."""
        return round(self._weights_read(self.num_experts))

    def expected_experts(self, batch: int) -> float:
        """Distinct experts B tokens reach in one sparse layer under uniform routing (each
        token picks k of E at random): `E (1 - (1 - k/E)^B)`."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** batch)

    def decode_weight_params(self, batch: int) -> float:
        """Parameters a decode step of `batch` running sequences reads: all but the experts
        nobody routes to (their expected number, `expected_experts`)."""
        if not self.num_experts:
            return self.weight_params
        return self._weights_read(self.expected_experts(batch))

    def _weights_read(self, experts_per_sparse_layer: float) -> float:
        norms = self.num_layers * (2 * self.hidden_size + 2 * self.head_dim) + self.hidden_size
        embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        sparse = (
            self.num_sparse_layers * self._sparse_layer_params(experts_per_sparse_layer)
            if self.num_experts
            else 0
        )
        return (
            self.num_dense_layers * self.linear_params_per_layer
            + sparse
            + norms
            + self.lm_head_params
            + embedding
        )

    def decode_linear_params(self, batch: int) -> float:
        """The part of `decode_weight_params` in the decoder layers' linear weights (attention
        and MLP or experts; not the router, norms, embedding or head): what an FP8 checkpoint
        stores in e4m3."""
        experts = self.expected_experts(batch) if self.num_experts else 0.0
        sparse = self.attention_params_per_layer + experts * self.params_per_expert
        return self.num_dense_layers * self.linear_params_per_layer + (
            self.num_sparse_layers * sparse if self.num_experts else 0
        )

    @property
    def kv_values_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def prefill_flops(self, prompt_len: int) -> int:
        """FLOPs to prefill one prompt and produce its first token's logits."""
        linear = 2 * prompt_len * self.active_linear_params
        pairs = prompt_len * (prompt_len + 1) // 2
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * pairs
        return linear + attention + 2 * self.lm_head_params

    def decode_flops(self, context_len: int) -> int:
        """FLOPs of one decode token that attends to `context_len` keys (itself included)."""
        linear = 2 * (self.active_linear_params + self.lm_head_params)
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context_len
        return linear + attention


@dataclass(frozen=True)
class Peaks:
    """Peak rates of one GPU, and where the figures come from."""

    flops_per_s: float
    bytes_per_s: float
    source: str


# Dense bf16 tensor-core FLOP/s (no sparsity) and HBM bandwidth, from the vendors' data sheets.
KNOWN_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.039e12),
}
# Stand-ins for a CPU or an unknown device, so that the code path runs; the fraction they give
# means nothing and the result file says so.
NOMINAL_PEAKS = Peaks(1e12, 1e11, "nominal placeholder (not this device's peak; pass --peak-*)")


def peaks_for(device_name: str) -> Peaks:
    for key, (flops, bw) in KNOWN_PEAKS.items():
        if key in device_name:
            return Peaks(flops, bw, f"{key} data sheet (dense bf16, HBM)")
    return NOMINAL_PEAKS


@dataclass(frozen=True)
class Limit:
    prefill_flops: int
    decode_flops: int
    decode_weight_bytes: int
    decode_kv_bytes: int
    num_decode_steps: int
    prefill_time_s: float
    decode_time_s: float

    @property
    def time_s(self) -> float:
        return self.prefill_time_s + self.decode_time_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "time_s": self.time_s}


def decode_steps(
    prompt_lens: Sequence[int], output_lens: Sequence[int], max_num_seqs: int
) -> list[tuple[int, int]]:
    """(running sequences, KV tokens read) of every decode step of ideal continuous batching.

    Sequences take free slots in order; a sequence in a slot decodes once per step until it has
    all its output tokens (the first came from its prefill).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    steps: list[tuple[int, int]] = []
    waiting = list(zip(prompt_lens, output_lens, strict=True))[::-1]
    # Running sequences: (step at which it has all its tokens, prompt_len, step admitted).
    running: list[tuple[int, int, int]] = []
    step = 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            p, o = waiting.pop()
            if o > 1:
                heapq.heappush(running, (step + o - 1, p, step))
        if not running:
            continue
        # Token k of a sequence admitted at step s is produced at step s + k - 1 (k >= 2) and
        # reads P + k - 1 tokens of KV, i.e. P + (step - s) + 1 where step counts from 0.
        kv = sum(p + (step - s) + 1 for _, p, s in running)
        steps.append((len(running), kv))
        step += 1
        while running and running[0][0] <= step:
            heapq.heappop(running)
    return steps


def offline_limit(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    *,
    max_num_seqs: int,
    bytes_per_value: int,
    peaks: Peaks,
    tp_size: int = 1,
    linear_bytes_per_value: float | None = None,
    kv_bytes_per_value: float | None = None,
) -> Limit:
    """The workload's time at the peaks. Bytes are those stored: `bytes_per_value` for every
    weight and KV value, except the decoder layers' linear weights at `linear_bytes_per_value`
    (an FP8 checkpoint: 1 byte plus its share of the block scales) and KV values at
    `kv_bytes_per_value` (an fp8 cache: 1) when given."""
    linear_bpv = bytes_per_value if linear_bytes_per_value is None else linear_bytes_per_value
    kv_bpv = bytes_per_value if kv_bytes_per_value is None else kv_bytes_per_value
    steps = decode_steps(prompt_lens, output_lens, max_num_seqs)
    prefill = sum(shape.prefill_flops(p) for p in prompt_lens)
    decode_flops = sum(
        shape.decode_flops(p + k - 1)
        for p, o in zip(prompt_lens, output_lens, strict=True)
        for k in range(2, o + 1)
    )
    weight_bytes = round(
        sum(
            (shape.decode_weight_params(running) - shape.decode_linear_params(running))
            * bytes_per_value
            + shape.decode_linear_params(running) * linear_bpv
            for running, _ in steps
        )
    )
    kv_bytes = round(sum(kv for _, kv in steps) * shape.kv_values_per_token * kv_bpv)
    return Limit(
        prefill_flops=prefill,
        decode_flops=decode_flops,
        decode_weight_bytes=weight_bytes,
        decode_kv_bytes=kv_bytes,
        num_decode_steps=len(steps),
        prefill_time_s=prefill / (peaks.flops_per_s * tp_size),
        decode_time_s=(weight_bytes + kv_bytes) / (peaks.bytes_per_s * tp_size),
    )
