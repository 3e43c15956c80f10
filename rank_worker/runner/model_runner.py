"""One rank's model: its weight shard, its KV cache, and one forward pass per StepPlan.

Every rank (rank 0 included) owns a ModelRunner and calls `execute` with the same plan for
every step; the forward's collectives keep the ranks in lock-step, and the logits arrive on
rank 0 only. Under pipeline parallelism a runner holds its stage's layers and cache only, and
its forward pass receives from and sends to the neighbouring stages (`rank_worker.pp`). The
runner holds no request state: what a step needs is in the plan, and what it leaves behind is
K/V in cache slots that rank 0's block manager accounts for.

Life cycle: construct (load weights) → `determine_num_kv_blocks()` (every rank, collective) →
`init_kv_cache(n)` with the agreed n (where Triton kernels run, this also launches each of them
once on a small mixed step, so that every binary a step can need is compiled before serving;
on GPU it then captures the CUDA graphs, a collective too) → `execute(plan, last_sampled)` per
step. `startup_s` records how long each start-up phase took. Each step's inputs reach the
device in one copy through buffers the runner keeps for its life (`rank_worker.inputs.input_prep`).
Decode steps, and verify steps with as many drafts in every sequence, replay a graph when one
fits (`rank_worker.runner.cuda_graphs`); any other step of at most `cuda_graph_max_tokens` tokens
a mixed-step graph (`rank_worker.runner.mixed_graphs`); the rest runs eagerly.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rank_worker.attention.selection import get_backend, select_backend, select_layer_kernels
from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.input_prep import StepInputBuffers, StepInputs, prepare_inputs
from rank_worker.inputs.synthetic_plans import synthetic_plan
from rank_worker.kv.cache import CacheGroup, KVCacheSpec, allocate_kv_cache
from rank_worker.kv.copies import HostBlockCopier, PlanCopier, queue_plan_copies
from rank_worker.kv.device_memory import CudaMemory, DeviceMemory, add_cuda_user, drop_cuda_user
from rank_worker.lora.manager import LoraManager, plan_runs_adapters
from rank_worker.models.architectures import build_model
from rank_worker.models.loader import load_checkpoint
from rank_worker.models.model_spec import HeadSpec, load_hf_config
from rank_worker.models.qwen3 import KVCachePair
from rank_worker.models.weight_map import WeightMap
from rank_worker.pp import PipelineInfo, StageHandoff
from rank_worker.runner import graph_setup
from rank_worker.runner.cuda_graphs import DecodeGraphRunner
from rank_worker.runner.device_sleep import DeviceSleep
from rank_worker.runner.mixed_graphs import MixedGraphRunner
from rank_worker.runner.startup import (
    ProfileSampling,
    check_max_model_len,
    draft_config,
    kernel_warmup_plans,
    largest_step_plan,
    local_num_kv_blocks,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from rank_worker.runner_config import RunnerConfig
from rank_worker.spec.eagle3_runner import Eagle3Runner
from rank_worker.tp import TPInfo, all_reduce_min_int
from shm_ipc.step_plan import Command, StepPlan, batch_rows

__all__ = ["ModelRunner", "synthetic_plan"]

logger = logging.getLogger(__name__)


class ModelRunner:
    """This rank's shard of the model plus its KV cache (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        config: RunnerConfig,
        tp: TPInfo,
        device: torch.device | str,
        *,
        memory: DeviceMemory | None = None,
    ) -> None:
        """`memory`: what the KV-cache sizing reads of the device; None = `CudaMemory` on a
        GPU, and on CPU no measurement (the cache takes `kv_cache_memory_bytes`). Tests pass a
        stand-in to run the GPU's sizing on CPU. `tp`: this rank among all ranks (the world);
        with pipeline parallelism `self.tp` becomes its stage's group (`self.pipe`)."""
        start = time.perf_counter()
        self.config = config
        self.world = tp
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            # Triton launches on the current device, whatever device its tensors are on.
            torch.cuda.set_device(self.device)
            memory = memory or CudaMemory(self.device)
            add_cuda_user(self)
        self.memory = memory
        # Bytes of this process's tensors before this runner made any: not the engine's, and
        # left out of its measured use (`gpu_kv_budget_bytes`).
        self.baseline_allocated = memory.read().allocated if memory is not None else 0
        torch.manual_seed(config.seed)
        self.hf_config = load_hf_config(model_dir, config.hf_overrides)
        # This rank's stage (its groups made here, a world collective) and its TP group.
        self.pipe = PipelineInfo.build(
            tp, config.pipeline_parallel_size, self.hf_config.num_hidden_layers,
            config.pp_layer_partition,
        )  # fmt: skip
        self.tp = tp = self.pipe.tp
        check_max_model_len(config, self.hf_config, model_dir)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # Checked before the weights load: a backend that cannot run fails in a second.
        self.attention_backend = get_backend(
            select_backend(
                config.attention_backend,
                device=self.device,
                block_size=config.block_size,
                dtype=self.dtype,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        )
        self.layer_kernels = select_layer_kernels(
            config.layer_kernels, device=self.device, attention_backend=self.attention_backend.name
        )
        self.model = build_model(
            self.hf_config,
            tp,
            self.dtype,
            self.device,
            self.attention_backend,
            fused_kernels=self.layer_kernels == "triton",
            enable_expert_parallel=config.enable_expert_parallel,
            head=HeadSpec.from_dict(config.head),
            stage=self.pipe.stage,
        )
        # The name -> shard rules of this model: for the checkpoint now, for updates later.
        self.weight_map = WeightMap(self.model)
        load_checkpoint(self.weight_map, model_dir)
        self.model.eval()
        # Multi-LoRA's slot stacks, allocated here so that the KV-cache sizing counts them.
        self.lora: LoraManager | None = None
        if config.enable_lora:
            self.lora = LoraManager(self.model, config, self.dtype, self.uses_triton)
            logger.info("rank %d: LoRA slots take %d bytes", self.world.rank, self.lora.nbytes)
        # An fp8 cache halves bytes_per_block (vs bf16), so the same budget holds twice the blocks.
        self.kv_spec = KVCacheSpec.for_model(
            self.hf_config, tp, config.block_size, self.kv_cache_dtype,
            len(self.pipe.stage.layers),
        )  # fmt: skip
        # Staging for every step's inputs, sized for the largest step (`input_prep`), and this
        # rank's mirror of rank 0's block tables, which the plans' edits keep up to date.
        # `gpu_data_paths` takes the GPU's layout on a CPU device too (tests); None = the
        # device's own.
        gpu_paths = True if config.gpu_data_paths else None
        self.input_buffers = StepInputBuffers.for_config(
            config, self.device, double_buffered=gpu_paths
        )
        width = math.ceil(int(config.max_model_len) / config.block_size)
        self.block_tables = BlockTables(
            batch_rows(config.max_num_seqs), width, config.block_size, self.device,
            device_copy=gpu_paths,
        )  # fmt: skip
        self.kv_caches: list[KVCachePair] | None = None
        # The host KV tier's pool (`rank_worker.kv.copies`), kept across sleep; a PD decode's
        # staging pool in front of it (`rank_worker.kv.pd_staging`, set by its KV agent).
        self.host_pool: HostBlockCopier | None = None
        self.kv_staging: PlanCopier | None = None
        self.num_kv_blocks: int | None = None
        self.graph_runner: DecodeGraphRunner | None = None
        self.mixed_graphs: MixedGraphRunner | None = None
        self.graph_memory_bytes: int | None = None  # what capture took of the device
        self.graph_reserve_bytes: int | None = None  # what the KV sizing reserved for it
        # Sleep mode: releases and restores the weights' and the cache's device memory.
        self.device_sleep = DeviceSleep(self)
        # Speculative decoding with a draft model: a runner of its own (weights, cache, no
        # graphs) that shares this runner's table mirror and reads the same step inputs.
        self.draft: ModelRunner | None = None
        if config.draft_model is not None:
            self.draft = ModelRunner(
                config.draft_model, draft_config(config), self.world, self.device
            )
            self.draft.block_tables = self.block_tables
        # Speculative decoding with an EAGLE-3 head: replicated beside the target, its own cache.
        self.eagle3 = Eagle3Runner.for_runner(self) if config.eagle3_head is not None else None
        # Seconds per start-up phase: "load" (config, model, weights), "profile" (the memory
        # warm-up and sizing), "kv_cache" (allocation), "kernel_warmup" (first launch of every
        # Triton kernel: compiles on a GPU), "capture" (CUDA graphs).
        self.startup_s: dict[str, float] = {"load": time.perf_counter() - start}

    @property
    def uses_triton(self) -> bool:
        """Whether a step launches the project's Triton kernels (attention's or the layers')."""
        return self.layer_kernels == "triton" or self.attention_backend.name != "torch"

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def head_width(self) -> int:
        """Columns of the head's rows: the vocabulary for an LM head (`rank_worker.models.heads`).
        A stage without the head is under pipeline parallelism, which serves the LM head only."""
        head = self.model.head
        return self.vocab_size if head is None else int(head.width)

    @property
    def pool_spec(self) -> KVCacheSpec | CacheGroup:
        """What one block of the pool holds on this rank: the target's K/V, and the draft
        model's when there is one."""
        extra = [d.kv_spec for d in (self.draft, self.eagle3) if d is not None]
        return CacheGroup((self.kv_spec, *extra)) if extra else self.kv_spec

    def determine_num_kv_blocks(self, profile_sampling: ProfileSampling | None = None) -> int:
        """Blocks every rank can hold (collective over the world: every rank must call it; each
        stage's ranks size their own layers' cache, and the least of all wins).

        `profile_sampling(logits, num_sampled)`: rank 0's sampler at its most memory-hungry,
        run on the warm-up's logits so that the measurement leaves room for it (the sampler is
        rank 0's alone, `tp_engine.core.sampling`; the other ranks pass None).
        """
        start = time.perf_counter()
        try:
            graphs = graph_setup.captures_graphs(
                self.device, self.config, self.attention_backend, self.tp, self.pipe
            )
            local = local_num_kv_blocks(
                self.config, self.pool_spec, self.memory, self.baseline_allocated,
                self.tp.ranks_on_device, lambda: self._warmup(profile_sampling),
                self._graph_pool_probe if graphs else None,
            )  # fmt: skip
            return all_reduce_min_int(local, self.world)
        finally:
            self.startup_s["profile"] = time.perf_counter() - start

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then capture the decode graphs where they are on; `num_blocks`
        must be the same on every rank (and every rank captures the same sizes in the same
        order, since capture runs the forward's collectives)."""
        start = time.perf_counter()
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        self.num_kv_blocks = num_blocks
        draft = self.draft
        if draft is not None:
            draft.kv_caches = allocate_kv_cache(draft.kv_spec, num_blocks, self.device)
            draft.num_kv_blocks = num_blocks
        if self.eagle3 is not None:
            self.eagle3.allocate(num_blocks)
        if self.config.kv_offloading_size is not None and self.host_pool is None:
            self.host_pool = HostBlockCopier.of_size(
                self.config.kv_offloading_size, self.kv_caches, self.config.kv_offloading_dir,
                self.world,
            )  # fmt: skip
        self.startup_s["kv_cache"] = time.perf_counter() - start
        if self.uses_triton or (draft is not None and draft.uses_triton):
            start = time.perf_counter()
            if self.uses_triton:
                self._warm_up_kernels()
            if draft is not None and draft.uses_triton:
                draft._warm_up_kernels()
            self.startup_s["kernel_warmup"] = time.perf_counter() - start
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """Capture the decode, verify and mixed-step CUDA graphs where they are on (a collective:
        every rank captures the same graphs in the same order). At start-up, and again after a
        wake from sleep, since a graph holds the addresses of the weights and the cache."""
        set_lora = None if self.lora is None else self.lora.batch.capture_mode
        start = time.perf_counter()
        graphs = graph_setup.build_graphs(
            self.model, self.kv_caches, self.config, self.device, self.attention_backend,
            self.tp, self.pipe, set_lora, self.memory, self.world.rank,
        )  # fmt: skip
        if graphs is None:
            return
        self.graph_runner, self.mixed_graphs = graphs.decode, graphs.mixed
        self.graph_memory_bytes = graphs.memory_bytes
        k = self.config.num_speculative_tokens
        if self.eagle3 is not None and k > 0:  # the draft chain's graphs, after the target's
            self.eagle3.build_chain_graphs(k, self.config.max_num_seqs, capture=graphs.captured)
        if graphs.captured:
            self.startup_s["capture"] = time.perf_counter() - start

    def release_graphs(self) -> bool:
        """Drop every CUDA graph (the target's and the EAGLE-3 chain's) and their memory;
        whether there were any. Sleep drops them before it gives back what they hold."""
        had = self.graph_runner is not None or self.mixed_graphs is not None
        for graphs in (self.graph_runner, self.mixed_graphs):
            if graphs is not None:
                graphs.release()
        self.graph_runner = self.mixed_graphs = None
        if self.eagle3 is not None:
            self.eagle3.release_chain_graphs()
        return had

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Replace weights in place between steps: `named` holds full tensors under Hugging
        Face names (any subset, any float dtype, transformers 5's fused expert names too).
        The whole batch is checked before the first write (`WeightMap.prepare`); returns the
        reasons it was refused, [] when every tensor was written. Parameters keep their
        storage, so captured decode graphs replay the new weights. Every rank must call it
        with the same batch; the verdict reads only names and full shapes, so all agree."""
        self.device_sleep.check_weights_awake()
        return self.weight_map.update(named)

    def release(self) -> None:
        """Give back every device tensor this runner holds: weights, KV cache, graphs and their
        pool, staging buffers, tables. The process's device memory returns to what it was
        before the runner (another engine may then size itself in it); the runner cannot run
        again. Idempotent."""
        self.release_graphs()
        if self.draft is not None:
            self.draft.release()
            self.draft = None
        self.kv_caches = None
        self.eagle3 = None
        self.lora = None  # its slot stacks hang on the model's layers too
        self.model = None  # type: ignore[assignment]
        self.weight_map = None  # type: ignore[assignment]  # it holds the parameters too
        self.input_buffers = None  # type: ignore[assignment]
        self.block_tables = None  # type: ignore[assignment]
        gc.collect()  # modules hold reference cycles (parent <-> submodules via hooks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            drop_cuda_user(self)
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, last_sampled: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One forward pass. Logits `[B', vocab]` fp32 on rank 0, None on the other ranks (a
        pooling model: its head's rows, `[B', head_width]`).

        `last_sampled`: `[B'_prev]` int64 on this runner's device, the token ids sampled from
        the previous RUN step's logits rows. Required when the plan holds placeholder ids
        (`input_ids[i] < 0` stands for `last_sampled[-input_ids[i] - 1]`, see `input_prep`);
        ValueError naming the step when it is missing or too short.
        """
        if plan.command != Command.RUN:
            raise ValueError(f"step {plan.step_id}: execute takes RUN plans, got {plan.command!r}")
        if self.kv_caches is None:
            raise RuntimeError("execute before init_kv_cache, or after release")
        self._check_awake(plan)
        queue_plan_copies(self.kv_staging or self.host_pool, self.kv_caches, plan)
        inputs = self._prepare(plan, last_sampled)
        # A uniform step the decode graphs hold, else a step within the largest mixed bucket.
        runners = (self.graph_runner, self.mixed_graphs)
        graphs = next((g for g in runners if g is not None and g.can_run(plan)), None)
        if graphs is not None:
            base_only = self.lora is not None and self.lora.batch.skip
            hidden = graphs.run(inputs, base_only)  # [T, hidden], as eager
            logits = self._logits(hidden, inputs.logits_indices)
        else:
            logits = self._forward(inputs, self.kv_caches)
        if self.host_pool is not None:
            self.host_pool.after_forward()  # this plan's writes to files, while it runs
        if self.draft is not None:
            # The draft model's K/V of the same tokens (prompts, accepted drafts): what its
            # proposals attend to. No logits.
            self.draft.model(inputs.input_ids, inputs.positions, inputs.meta, self.draft.kv_caches)
        if self.eagle3 is not None:
            embeds, aux = self.model.model.captured
            self.eagle3.after_run(plan, embeds, aux, self.block_tables, self.input_buffers)
        return logits

    @torch.inference_mode()
    def execute_draft(
        self, plan: StepPlan, last_sampled: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """One forward pass of the draft model alone over a DRAFT plan (its table edits apply
        to the shared mirror): the draft's logits on rank 0, None elsewhere. Placeholder inputs
        read `last_sampled`, as in `execute` (the previous draft pass's tokens)."""
        if plan.command != Command.DRAFT:
            raise ValueError(f"step {plan.step_id}: execute_draft takes DRAFT plans")
        if self.eagle3 is not None:  # the whole chain of drafts: [R, k] target ids
            self._check_awake(plan)
            return self.eagle3.draft(plan, self.block_tables, self.input_buffers)
        draft = self.draft
        if draft is None or draft.kv_caches is None:
            raise RuntimeError(f"step {plan.step_id}: a DRAFT plan, but no draft model is loaded")
        self._check_awake(plan)
        inputs = self._prepare(plan, last_sampled)
        hidden = draft.model(inputs.input_ids, inputs.positions, inputs.meta, draft.kv_caches)
        return draft._logits(hidden, inputs.logits_indices)

    def _check_awake(self, plan: StepPlan) -> None:
        """A forward over released memory reads freed addresses (a crash, not an error)."""
        asleep = self.device_sleep.asleep
        if asleep:
            tags = ", ".join(sorted(tag.value for tag in asleep))
            raise RuntimeError(
                f"step {plan.step_id}: rank {self.world.rank} is asleep ({tags} released): "
                "wake_up before running a step"
            )

    def _prepare(self, plan: StepPlan, last_sampled: torch.Tensor | None = None) -> StepInputs:
        any_adapter = plan_runs_adapters(plan, self.lora)
        inputs = prepare_inputs(
            plan, self.block_tables, buffers=self.input_buffers, last_sampled=last_sampled
        )
        return self._bind_adapters(inputs, any_adapter)

    def _bind_adapters(self, inputs: StepInputs, any_adapter: bool) -> StepInputs:
        """Hand the step's per-token adapter slots to the LoRA layers (their fixed buffer);
        `any_adapter` False lets an eager forward skip the LoRA terms."""
        if self.lora is not None:
            self.lora.bind(inputs.adapter_slots, any_adapter)
        return inputs

    def _forward(self, inputs: StepInputs, kv_caches: list[KVCachePair]) -> torch.Tensor | None:
        """This rank's stage of one forward pass; the logits on world rank 0, None elsewhere.
        Every stage but the first starts from the previous one's hand-off, every stage but the
        last passes its own on, and the last stage's logits travel to rank 0 (`rank_worker.pp`)."""
        pipe, size = self.pipe, (inputs.input_ids.shape[0], self.hf_config.hidden_size)
        handoff = pipe.receive(*size, self.dtype, self.device)  # None on the first stage
        out = self.model(inputs.input_ids, inputs.positions, inputs.meta, kv_caches, handoff)
        if isinstance(out, StageHandoff):
            pipe.send(out)  # [T, hidden] twice
        logits = None if isinstance(out, StageHandoff) else self._logits(out, inputs.logits_indices)
        rows = inputs.logits_indices.numel()
        return pipe.deliver_logits(logits, rows, self.head_width, self.device)

    def _logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor | None:
        if logits_indices.numel() == 0:
            # A step of mid-prompt chunks only. Every rank sees the same plan, so all of them
            # skip the gather together.
            if not self.tp.is_first:
                return None
            return torch.empty((0, self.head_width), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[logits_indices])  # [B', vocab] on rank 0

    # -- warm-ups -----------------------------------------------------------------------------

    def _kernel_warmup_plans(self) -> list[StepPlan]:
        """The smallest steps that launch every Triton kernel a step can launch
        (`rank_worker.runner.startup.kernel_warmup_plans`)."""
        return kernel_warmup_plans(self.config, with_lora=self.lora is not None)

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Launch every Triton kernel once before serving (see `_kernel_warmup_plans`); a
        collective when TP > 1, like any step."""
        assert self.kv_caches is not None
        for plan in self._kernel_warmup_plans():
            self._forward(self._prepare_scratch(plan), self.kv_caches)

    def _prepare_scratch(self, plan: StepPlan) -> StepInputs:
        """Inputs of a synthetic (warm-up) plan that stores nothing, on tables of its own: the
        mirror of rank 0's tables never sees it."""
        width = math.ceil(int(self.config.max_model_len) / self.config.block_size)
        width = max(width, int(np.diff(plan.edit_offsets).max(initial=0)))
        scratch = BlockTables(
            plan.num_seqs,
            width,
            self.config.block_size,
            self.device,
            device_copy=self.block_tables.has_device_copy,
        )
        # The LoRA terms run (over slot -1 tokens): warm-ups compile their kernels and the
        # memory profile sees their temporaries.
        return self._bind_adapters(prepare_inputs(plan, scratch, store_kv=False), True)

    # -- memory profiling (GPU) -----------------------------------------------------------

    def _warmup_plan(self) -> tuple[StepPlan, int, int]:
        """The largest step the scheduler can send, the blocks its scratch cache needs and its
        sampled rows (`rank_worker.runner.startup.largest_step_plan`)."""
        return largest_step_plan(self.config)

    @torch.inference_mode()
    def _warmup(self, profile_sampling: ProfileSampling | None = None) -> int:
        """Run the largest step once; returns the bytes of scratch KV cache it allocated, which
        the sizing subtracts from the peak (the real cache replaces it)."""
        plan, num_blocks, num_sampled = self._warmup_plan()
        scratch = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        inputs = self._prepare_scratch(plan)
        logits = self._forward(inputs, scratch)  # [B', V] on rank 0
        if self.draft is not None:
            draft_scratch = allocate_kv_cache(self.draft.kv_spec, num_blocks, self.device)
            self.draft.model(inputs.input_ids, inputs.positions, inputs.meta, draft_scratch)
            del draft_scratch
        if logits is not None and profile_sampling is not None:
            # Sampled rows first, then prompt-logprob rows (`_warmup_plan`).
            profile_sampling(logits, num_sampled)
        del scratch, logits
        return num_blocks * self.pool_spec.bytes_per_block

    @torch.inference_mode()
    def _graph_pool_probe(self) -> int:
        """What the CUDA graphs' pool will hold (`graph_setup`): the peak of a forward over the
        largest graph's tokens, without logits, on a scratch cache."""
        tokens = graph_setup.largest_graph_tokens(self.config)
        plan, num_blocks, _ = largest_step_plan(replace(self.config, max_num_batched_tokens=tokens))
        scratch = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        inputs = self._prepare_scratch(plan)
        run = lambda: self.model(inputs.input_ids, inputs.positions, inputs.meta, scratch)  # noqa: E731
        self.graph_reserve_bytes = graph_setup.graph_pool_bytes(run, self.memory)
        return self.graph_reserve_bytes
