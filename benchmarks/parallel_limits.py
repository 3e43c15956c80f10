"""The physical limit of one step on a parallel layout: tensor parallelism (TP) inside a pipeline
stage, pipeline parallelism (PP) across stages, and the links between the GPUs.

`benchmarks.limits` bounds a whole offline run on N GPUs that share every byte and FLOP; this
module bounds one step on one rank, where the ranks do not share evenly (replicated KV heads,
the embedding on one stage and the LM head on another) and the collectives cost time. Layout
(vLLM's rank order): rank = stage * TP + tp_rank, nodes of `gpus_per_node` consecutive ranks; a
TP group is one stage's ranks, and it spans nodes when TP > `gpus_per_node`.

Memory per rank, stage s of `L_s` layers (bytes = parameters x bytes per value):
- per layer: attention `H (nq/TP + 2 kv) d + (nq/TP) d H`, with `kv = nkv/TP` KV heads per rank,
  or 1 when TP > nkv: each KV head is then replicated on TP/nkv ranks (vLLM and this runtime
  do so; TP must divide nkv or be a multiple of it); norms `2H + 2d` on every rank; a dense MLP
  `3 H I / TP`; a sparse layer's router `E H` on every rank and its experts `E 3 H I_e / TP`,
  tensor-parallel (a 1/TP slice of every expert) or expert-parallel (E/TP whole experts): the
  same bytes.
- the vocab-parallel embedding `V H / TP` on the first stage; the final norm `H` and the LM head
  `V H / TP` on the last (a tied head is the embedding's parameter when one stage holds both).
- KV per token: `2 L_s kv d` values; what is left for it is `HBM x utilization - weights -
  reserved`, so the KV pool holds `left / KV per token` tokens (every rank of a stage holds the
  same tokens; with PP each stage holds every token for its layers: the least wins).

Time per stage, per step (`Work`: tokens through the layers, KV tokens read, query-key pairs,
rows through the head):
- roofline: `max(FLOPs / peak FLOP/s, bytes / peak B/s)` on one rank. FLOPs: 2 per active
  weight per token (attention, a dense MLP or the router and k experts, all per rank), 4 nq/TP
  d per query-key pair and layer, 2 V H / TP per sampled row. Bytes: every weight of the rank
  except the experts no token routes to (uniform routing, `ModelShape.expected_experts`; with
  expert parallelism the reads are assumed even over the ranks, a lower bound at small batch),
  the embedding rows looked up (not the whole table, unlike `limits.offline_limit`), the KV
  read and the new tokens' KV written. Activations are assumed to stay on chip.
- communication, added to the roofline (not overlapped): two all-reduces per layer (after
  attention's o_proj and after the MLP or the experts) and the embedding's one, each of
  `tokens x H x act bytes`, as a ring all-reduce: `latency + 2 (n-1)/n x size / bandwidth`; the
  logits' gather to TP rank 0 (`rows x V x act bytes`: rank 0 receives (n-1)/n of it, the part
  from another node over InfiniBand); and, on every stage but the last, the send of hidden
  state and residual (`2 x tokens x H x act bytes`) to the next stage, each rank to its peer
  over its own NIC: `latency + size / bandwidth` (vLLM sends a 1/TP slice per rank and
  all-gathers it; not modelled).
- links: NVLink inside a node; InfiniBand when the group spans nodes. A cross-node ring is
  bounded by one NIC (the default, `inter_node_nics = 1`), or by `inter_node_nics` NICs when
  its traffic spreads over several channels, as NCCL's rings do (never above NVLink).

The pipeline (`StepLimit`), P stages of times `t_s`, slowest `t_max`, m micro-batches:
- `flushed`: one batch per step split into m micro-batches, the pipeline filled and drained
  every step: `step = sum t_s + (m-1) t_max`; balanced, `(m+P-1) t`, idle `(P-1)/(m+P-1)`.
- `in_flight`: m independent batches go round the stages (vLLM's batch queue; decode, where a
  sequence's next token needs its last): a batch's step `max(sum t_s, m t_max)`; balanced, idle
  `(P-m)/P` for m < P and none from m = P.
- either way with m = 1 the stages take turns: the throughput is 1/P of the stage-balanced
  case (every stage busy, `tokens per micro-batch / t_max`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from benchmarks.limits import ModelShape, Peaks


@dataclass(frozen=True)
class Link:
    """One kind of GPU-to-GPU link, as one GPU sees it."""

    name: str
    bytes_per_s: float  # per GPU, one direction
    latency_s: float  # fixed cost of one collective or send on this link
    source: str


# H100 SXM: NVLink 4, 18 links, 900 GB/s per GPU both directions together (NVIDIA's H100 data
# sheet), so 450 GB/s each way. Latency: an NVLS all-reduce of a few KB under CUDA graphs takes
# about 6 us on two H100s (NVIDIA/nccl#1259), more with more GPUs, so 6 us is a floor.
NVLINK4_H100 = Link(
    "NVLink4", 450e9, 6e-6, "H100 SXM data sheet (900 GB/s bidirectional); NVIDIA/nccl#1259"
)
# One ConnectX-7 NDR port per GPU: 400 Gb/s = 50 GB/s each way. Latency: NCCL's own model puts a
# 1 KB all-reduce over IB between 8 x H100 nodes at 25 us (its tuner log in NVIDIA/nccl#1453);
# an assumption for every cross-node collective and send, not a measurement here.
IB_NDR400 = Link("IB NDR 400Gb/s", 50e9, 25e-6, "NDR 400 Gb/s per NIC; NVIDIA/nccl#1453 tuner")


@dataclass(frozen=True)
class Hardware:
    """One GPU: its peaks and its memory."""

    peaks: Peaks
    hbm_bytes: float
    source: str


# The data sheet's 80 GB as 80e9 bytes; the device reports somewhat more (79.2 GiB), so the
# KV capacities below err low.
H100_SXM = Hardware(
    Peaks(989e12, 3.35e12, "H100 SXM data sheet (dense bf16, HBM3)"), 80e9, "H100 SXM 80 GB"
)


class Schedule(enum.Enum):
    FLUSHED = "flushed"  # one batch per step in m micro-batches, filled and drained each step
    IN_FLIGHT = "in_flight"  # m independent batches going round the stages


@dataclass(frozen=True)
class Layout:
    """Where the ranks are and what joins them."""

    tp_size: int
    pp_size: int = 1
    gpus_per_node: int = 8
    intra_node: Link = NVLINK4_H100
    inter_node: Link = IB_NDR400
    # NICs one cross-node ring spreads its traffic over (1: bounded by one GPU's NIC).
    inter_node_nics: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "gpus_per_node", "inter_node_nics"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        tp, g = self.tp_size, self.gpus_per_node
        # A TP group either fits in a node or fills whole nodes, so every group sees the same
        # links (vLLM's rank order puts a group on consecutive ranks).
        if (tp <= g and g % tp) or (tp > g and tp % g):
            raise ValueError(f"TP {tp} neither divides nor is a multiple of {g} GPUs per node")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node)

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @property
    def tp_spans_nodes(self) -> bool:
        return self.node(self.rank(0, 0)) != self.node(self.rank(0, self.tp_size - 1))

    @property
    def tp_nodes(self) -> int:
        return -(-self.tp_size // self.gpus_per_node)

    def cross_node_link(self) -> Link:
        """InfiniBand as a ring's bottleneck: `inter_node_nics` NICs at once, at most NVLink."""
        bw = min(self.inter_node.bytes_per_s * self.inter_node_nics, self.intra_node.bytes_per_s)
        name = self.inter_node.name + (
            f" x{self.inter_node_nics} NICs" if self.inter_node_nics > 1 else ""
        )
        return replace(self.inter_node, name=name, bytes_per_s=bw)

    @property
    def tp_link(self) -> Link:
        """The link that bounds the TP group's collectives."""
        return self.cross_node_link() if self.tp_spans_nodes else self.intra_node

    def boundary_link(self, stage: int) -> Link:
        """The link stage `stage` sends to stage `stage + 1` over (each rank to its peer)."""
        if not 0 <= stage < self.pp_size - 1:
            raise ValueError(f"stage {stage} has no next stage in {self.pp_size}")
        here, there = self.rank(stage, 0), self.rank(stage + 1, 0)
        # Point to point: one rank's own NIC, not several.
        return self.inter_node if self.node(here) != self.node(there) else self.intra_node


def ring_allreduce_s(size_bytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of `size_bytes` over `n` ranks: each sends and receives 2(n-1)/n of it."""
    if n == 1:
        return 0.0
    return link.latency_s + 2 * (n - 1) / n * size_bytes / link.bytes_per_s


def send_s(size_bytes: float, link: Link) -> float:
    return link.latency_s + size_bytes / link.bytes_per_s


def gather_to_first_s(size_bytes: float, layout: Layout) -> float:
    """`size_bytes` gathered to TP rank 0: it receives (n-1)/n of it, the shares of ranks on
    other nodes over InfiniBand while its own node's arrive over NVLink."""
    n = layout.tp_size
    if n == 1:
        return 0.0
    local = min(n, layout.gpus_per_node)
    near = (local - 1) / n * size_bytes
    far = (n - local) / n * size_bytes
    t = near / layout.intra_node.bytes_per_s
    if far:
        cross = layout.cross_node_link()
        return cross.latency_s + max(t, far / cross.bytes_per_s)
    return layout.intra_node.latency_s + t


def stage_layers(num_layers: int, pp_size: int) -> list[int]:
    """Layers per stage, as even as can be; the extra ones go to the stages before the last
    (which holds the LM head), nearest the last first."""
    if pp_size > num_layers:
        raise ValueError(f"{pp_size} stages for {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    counts = [base] * pp_size
    for i in range(extra):
        counts[-2 - i if pp_size > 1 else 0] += 1
    return counts


def kv_heads_per_rank(shape: ModelShape, tp_size: int) -> int:
    nkv = shape.num_kv_heads
    if tp_size <= nkv:
        if nkv % tp_size:
            raise ValueError(f"TP {tp_size} does not divide {nkv} KV heads")
        return nkv // tp_size
    if tp_size % nkv:
        raise ValueError(f"TP {tp_size} is not a multiple of {nkv} KV heads")
    return 1


def kv_replication(shape: ModelShape, tp_size: int) -> int:
    """Ranks that hold each KV head: TP / nkv once TP passes the KV heads, else 1."""
    return tp_size * kv_heads_per_rank(shape, tp_size) // shape.num_kv_heads


def _check_split(shape: ModelShape, layout: Layout) -> None:
    tp = layout.tp_size
    if shape.num_heads % tp:
        raise ValueError(f"TP {tp} does not divide {shape.num_heads} query heads")
    if shape.num_dense_layers and shape.intermediate_size % tp:
        raise ValueError(f"TP {tp} does not divide intermediate_size {shape.intermediate_size}")
    if shape.num_experts:
        if layout.expert_parallel and shape.num_experts % tp:
            raise ValueError(f"expert parallelism: TP {tp} does not divide {shape.num_experts}")
        if not layout.expert_parallel and shape.moe_intermediate_size % tp:
            raise ValueError(f"TP {tp} does not divide {shape.moe_intermediate_size}")
        if shape.num_dense_layers and layout.pp_size > 1:
            # ModelShape counts the sparse layers but does not say which they are.
            raise ValueError("a mixed dense/sparse stack cannot be split into stages here")


@dataclass(frozen=True)
class _RankLayer:
    """Parameters of one decoder layer on one rank."""

    resident: float  # stored
    fixed_read: float  # read by every step: all but the experts
    per_expert: float  # one expert's share on this rank
    active: float  # multiplied by each token (FLOPs / 2)


def _rank_layer(shape: ModelShape, tp: int) -> _RankLayer:
    h, d = shape.hidden_size, shape.head_dim
    q_heads, kv = shape.num_heads // tp, kv_heads_per_rank(shape, tp)
    attention = h * (q_heads + 2 * kv) * d + q_heads * d * h
    norms = 2 * h + 2 * d
    if not shape.num_experts:
        mlp = 3 * h * shape.intermediate_size / tp
        fixed = attention + norms + mlp
        return _RankLayer(fixed, fixed, 0.0, attention + mlp)
    router = shape.num_experts * h
    per_expert = shape.params_per_expert / tp  # a slice of each, or 1/TP of the whole ones
    fixed = attention + norms + router
    active = attention + router + shape.num_experts_per_tok * per_expert
    return _RankLayer(fixed + shape.num_experts * per_expert, fixed, per_expert, active)


@dataclass(frozen=True)
class RankMemory:
    """One rank of stage `stage`: its weights and what is left for KV."""

    stage: int
    layers: int
    weight_bytes: float
    kv_bytes_per_token: float
    kv_budget_bytes: float  # HBM x utilization - weights - reserved

    @property
    def fits(self) -> bool:
        return self.kv_budget_bytes > 0

    @property
    def max_kv_tokens(self) -> int:
        return int(self.kv_budget_bytes // self.kv_bytes_per_token) if self.fits else 0


def rank_memory(
    shape: ModelShape,
    layout: Layout,
    stage: int,
    hardware: Hardware = H100_SXM,
    *,
    memory_utilization: float = 0.9,
    reserved_bytes: float = 0.0,
    bytes_per_value: float = 2,
    kv_bytes_per_value: float = 2,
) -> RankMemory:
    """Weights and KV room of one rank of `stage`. `reserved_bytes`: activations, CUDA graphs,
    NCCL buffers (0: the KV room is an upper bound)."""
    _check_split(shape, layout)
    tp, last = layout.tp_size, layout.pp_size - 1
    layers = stage_layers(shape.num_layers, layout.pp_size)[stage]
    params = layers * _rank_layer(shape, tp).resident
    table = shape.vocab_size * shape.hidden_size / tp
    if stage == 0:
        params += table
    if stage == last:
        params += shape.hidden_size  # final norm
        if not (shape.tie_word_embeddings and stage == 0):
            params += table
    weights = params * bytes_per_value
    kv_per_token = 2 * layers * kv_heads_per_rank(shape, tp) * shape.head_dim
    budget = hardware.hbm_bytes * memory_utilization - weights - reserved_bytes
    return RankMemory(stage, layers, weights, kv_per_token * kv_bytes_per_value, budget)


@dataclass(frozen=True)
class Work:
    """What one step (or one micro-batch) asks of every layer."""

    tokens: float  # tokens through the layers
    kv_read_tokens: float  # KV entries attention reads, summed over the sequences
    attention_pairs: float  # query-key pairs per layer and head
    sampled_rows: float  # rows through the LM head

    @classmethod
    def decode(cls, batch: float, context_len: int) -> Work:
        """`batch` sequences, one token each, attending to `context_len` tokens (itself too)."""
        return cls(batch, batch * context_len, batch * context_len, batch)

    @classmethod
    def prefill(cls, prompt_len: int, chunks: int = 1) -> Work:
        """One of `chunks` equal chunks of a prompt, on average: its tokens, its share of the
        causal triangle, the earlier chunks' KV it reads; one row sampled per prompt."""
        pairs = prompt_len * (prompt_len + 1) / 2
        earlier = prompt_len * (chunks - 1) / (2 * chunks)
        return cls(prompt_len / chunks, earlier * prompt_len / chunks, pairs / chunks, 1 / chunks)


@dataclass(frozen=True)
class StageTime:
    """One rank of a stage, one step: its roofline and its communication."""

    stage: int
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    allreduce_s: float  # the TP all-reduces: two per layer, and the embedding's
    gather_s: float  # logits to TP rank 0 (last stage)
    send_s: float  # hidden state and residual to the next stage (not on the last)

    @property
    def roofline_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def comm_s(self) -> float:
        return self.allreduce_s + self.gather_s + self.send_s

    @property
    def time_s(self) -> float:
        return self.roofline_s + self.comm_s


def stage_time(
    shape: ModelShape,
    layout: Layout,
    stage: int,
    work: Work,
    hardware: Hardware = H100_SXM,
    *,
    bytes_per_value: float = 2,
    kv_bytes_per_value: float = 2,
    act_bytes: float = 2,
) -> StageTime:
    _check_split(shape, layout)
    tp, last = layout.tp_size, layout.pp_size - 1
    h, v = shape.hidden_size, shape.vocab_size
    layers = stage_layers(shape.num_layers, layout.pp_size)[stage]
    layer = _rank_layer(shape, tp)
    experts = shape.expected_experts(round(work.tokens)) if shape.num_experts else 0.0
    head = v * h / tp if stage == last else 0.0  # the LM head's share (FLOPs and bytes)
    flops = (
        2 * work.tokens * layers * layer.active
        + 4 * layers * (shape.num_heads // tp) * shape.head_dim * work.attention_pairs
        + 2 * work.sampled_rows * head
    )
    weight_params = layers * (layer.fixed_read + experts * layer.per_expert)
    if stage == last:
        weight_params += head + h  # and the final norm
    if stage == 0:
        weight_params += work.tokens * h / tp  # the rows looked up, each rank its vocab share
    kv_per_token = 2 * layers * kv_heads_per_rank(shape, tp) * shape.head_dim * kv_bytes_per_value
    nbytes = weight_params * bytes_per_value + (work.kv_read_tokens + work.tokens) * kv_per_token
    hidden = work.tokens * h * act_bytes
    allreduces = 2 * layers + (1 if stage == 0 else 0)
    return StageTime(
        stage=stage,
        flops=flops,
        bytes=nbytes,
        compute_s=flops / hardware.peaks.flops_per_s,
        memory_s=nbytes / hardware.peaks.bytes_per_s,
        allreduce_s=allreduces * ring_allreduce_s(hidden, tp, layout.tp_link),
        gather_s=gather_to_first_s(work.sampled_rows * v * act_bytes, layout)
        if stage == last
        else 0.0,
        send_s=send_s(2 * hidden, layout.boundary_link(stage)) if stage < last else 0.0,
    )


def bubble_fraction(pp_size: int, micro_batches: int) -> float:
    """Idle share of a flushed pipeline: P stages, m equal micro-batches, `(P-1)/(m+P-1)`."""
    if pp_size < 1 or micro_batches < 1:
        raise ValueError(f"need P >= 1 and m >= 1, got {pp_size}, {micro_batches}")
    return (pp_size - 1) / (micro_batches + pp_size - 1)


def in_flight_idle_fraction(pp_size: int, in_flight: int) -> float:
    """Idle share with `in_flight` independent batches going round P equal stages."""
    if pp_size < 1 or in_flight < 1:
        raise ValueError(f"need P >= 1 and m >= 1, got {pp_size}, {in_flight}")
    return max(0, pp_size - in_flight) / max(pp_size, in_flight)


@dataclass(frozen=True)
class StepLimit:
    """One step's limit on a layout: the stages' times for one micro-batch, put together."""

    layout: Layout
    stages: tuple[StageTime, ...]
    micro_batches: int
    schedule: Schedule
    tokens: float  # tokens a step handles, over its micro-batches

    @property
    def slowest_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def step_s(self) -> float:
        """Flushed: the step's time. In flight: the time between one batch's steps (TPOT)."""
        path, m = sum(s.time_s for s in self.stages), self.micro_batches
        if self.schedule is Schedule.FLUSHED:
            return path + (m - 1) * self.slowest_s
        return max(path, m * self.slowest_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def balanced_tokens_per_s(self) -> float:
        """Every stage busy all the time: one micro-batch out per slowest stage's time."""
        return self.tokens / self.micro_batches / self.slowest_s

    @property
    def idle_fraction(self) -> float:
        busy = self.micro_batches * sum(s.time_s for s in self.stages)
        return 1.0 - busy / (len(self.stages) * self.step_s)

    @property
    def comm_share(self) -> float:
        """Communication's share of one micro-batch's path through the stages."""
        return sum(s.comm_s for s in self.stages) / sum(s.time_s for s in self.stages)


def step_limit(
    shape: ModelShape,
    layout: Layout,
    micro_batch: Work,
    hardware: Hardware = H100_SXM,
    *,
    micro_batches: int = 1,
    schedule: Schedule = Schedule.IN_FLIGHT,
    **bytes_kw: float,
) -> StepLimit:
    """`micro_batches` micro-batches of `micro_batch` each, through every stage."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    stages = tuple(
        stage_time(shape, layout, s, micro_batch, hardware, **bytes_kw)
        for s in range(layout.pp_size)
    )
    return StepLimit(layout, stages, micro_batches, schedule, micro_batch.tokens * micro_batches)
