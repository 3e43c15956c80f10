"""Rank 0's bring-up: `LLMEngine` holds the engine core and the tensor-parallel executor, with
the features plugged in.

`LLMEngine(config, tp)` reads the checkpoint (tokenizer, `ModelSpec`: task, head and context
length, decided once here and shipped to every rank), starts every rank through
`tp_engine.executor.tp.TPExecutor` (rank 0's `ModelRunner` plus the plan ring), builds the
features (control calls, LoRA slots, sleep mode) and plugs them into the core
(`tp_engine.core.hooks.CoreHooks`), and keeps the thin delegates the front ends call (`add_lora`,
`sleep`, `load_weights`...). The stepping, the requests and the engine's states are
`tp_engine.core.engine_core.EngineCore`'s: `LLMEngine.core`, whose public surface the engine
delegates to (`add_request`, `step`, `stats`...; tests and diagnostics read the core's members
through `core`).

Start-up mirrors `rank_worker.dist.worker.run_worker` on the other ranks (see
`rank_worker.dist.bootstrap` for the order). A failure on another rank surfaces here as
`EngineDeadError` naming that rank and step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rank_worker.fault_injection import Fault
from rank_worker.models.model_spec import ModelSpec, load_hf_config
from rank_worker.pp import layer_partition
from rank_worker.spec.eagle3_format import read_eagle3_config
from rank_worker.tp import TPInfo
from tp_engine.common.failures import EngineDeadError
from tp_engine.common.step_timeline import StepTimeline
from tp_engine.config import EngineConfig
from tp_engine.config.generation import eos_token_ids, sampling_defaults
from tp_engine.core.engine_core import EngineCore
from tp_engine.core.engine_states import PauseMode
from tp_engine.core.hooks import CoreHooks
from tp_engine.core.kv.file_tier import open_file_tier
from tp_engine.core.outputs import EngineStats, StepOutputs
from tp_engine.core.sampling.profiling import profile_sampling
from tp_engine.core.scheduled_step import RequestRejectedError
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.core.spec_metrics import SpecDecodeStats
from tp_engine.executor.control import EngineControl, EngineInconsistentError
from tp_engine.executor.rank_config import (
    draft_model_dir,
    eagle3_head_dir,
    pp_layer_partition,
    runner_config_for,
)
from tp_engine.executor.tp import TPExecutor
from tp_engine.features import speculative
from tp_engine.features.lora import control as lora_control
from tp_engine.features.weights_and_sleep import weight_updates
from tp_engine.features.weights_and_sleep.sleep import EngineSleep
from tp_engine.lora_request import LoRARequest
from tp_engine.pooling_params import PoolingParams
from tp_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["EngineDeadError", "LLMEngine", "RequestRejectedError"]


class LLMEngine:
    """The engine on rank 0 of a process group of `tp.size` ranks: `core` (the requests and
    the steps) over `executor` (the ranks), and the features."""

    def __init__(self, config: EngineConfig, tp: TPInfo, fault: Fault | None = None):
        from transformers import AutoTokenizer  # deferred: slow to import

        if not tp.is_first:
            raise ValueError("LLMEngine runs on rank 0; other ranks run rank_worker.dist.worker")
        if config.world_size != tp.size:
            raise ValueError(
                f"tensor_parallel_size ({config.tensor_parallel_size}) x pipeline_parallel_size "
                f"({config.pipeline_parallel_size}) does not match the process group's size "
                f"({tp.size})"
            )
        model_dir = Path(config.model) if config.model else _demo_model_dir()
        hf_config = load_hf_config(model_dir, config.hf_overrides)
        # The stages' layers, refused here (before any rank builds a model) when they do not fit.
        layer_partition(
            hf_config.num_hidden_layers, config.pipeline_parallel_size, pp_layer_partition(config)
        )
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or str(model_dir))
        # Task, head and context length, decided once here and shipped to every rank.
        model_spec = ModelSpec.resolve(
            model_dir, hf_config, config.runner, config.convert, _token_id_of(tokenizer)
        )
        _check_pooling_config(model_spec, config)
        # The same rope spec sizes every rank's cos/sin table (rank_worker/models/qwen3.py).
        rope = model_spec.rope
        config = config.with_model_defaults(rope.max_positions, rope.max_positions_source)
        self.model_dir = model_dir
        self.tp = tp
        vocab_size = int(hf_config.vocab_size)
        draft_dir = draft_model_dir(config)
        if draft_dir is not None:
            check_draft_model(draft_dir, vocab_size, tokenizer)
        head_dir = eagle3_head_dir(config)
        if head_dir is not None:
            # Refused here, with the key or tensor that does not fit, before any rank starts.
            read_eagle3_config(head_dir, hf_config)
        # A pooling model samples nothing: no sampler to leave room for.
        executor = TPExecutor.start(
            model_dir,
            runner_config_for(config, model_spec.head),
            tp,
            fault,
            None if model_spec.is_pooling else profile_sampling,
        )
        # Speculative decoding's proposer (`tp_engine.features.speculative`): the core builds
        # it, so its hook is in place first.
        hooks = CoreHooks()
        if config.speculative_config is not None:
            speculative.plug_in(config.speculative_config, hooks)
        file_tier = None
        if config.kv_offloading_dir is not None:
            pool = executor.runner.host_pool
            layout = f"{tuple(pool.host.shape[1:])} {pool.host.dtype}"
            file_tier = open_file_tier(config, model_dir, pool.block_bytes, layout)
        self.executor = executor
        self.core = core = EngineCore(
            config,
            executor,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids(tokenizer, model_dir),
            model_spec=model_spec,
            generation_defaults=sampling_defaults(model_dir),
            hooks=hooks,
            file_tier=file_tier,
        )
        # The other features, each given the core's `CoreAccess` and plugged in by its hooks
        # (`tp_engine.core.hooks`). Control calls to every rank (`tp_engine.executor.control`),
        # run between steps:
        self.control = EngineControl(core, executor)
        # Sleep mode (`tp_engine.features.weights_and_sleep.sleep`): what sleeps on every rank;
        # it closes the gate too.
        self.sleep_state = EngineSleep(core, self.control)
        hooks.admission_checks.append(self.sleep_state.check_can_generate)
        hooks.holds_requests.append(lambda: self.sleep_state.holds_requests)
        # LoRA adapters' slots and pins (`tp_engine.features.lora.registry`); None without
        # enable_lora.
        self.lora = lora = lora_control.build_registry(config, self.control)
        if lora is not None:
            lora_control.plug_in(lora, core, hooks)
        core.update_gate()  # the gate reads the hooks just registered
        # The label of the weights in use (SGLang's `weight_version`); set by weight updates.
        self.weight_version = "default"
        spec = config.speculative_config
        if spec is not None:
            logger.info(
                "speculative decoding (%s, k=%d): synchronous scheduling; %s",
                spec.method,
                spec.num_speculative_tokens,
                "a verify step replays a CUDA graph when every sequence verifies k drafts (or "
                "every sequence none), and runs eagerly otherwise"
                if executor.uses_cuda_graphs
                else "verify steps run eagerly",
            )

    @property
    def runner(self) -> Any:
        """Rank 0's `ModelRunner` (weight updates, benchmarks and tests read its model)."""
        return self.executor.runner

    # -- the core's public surface (`tp_engine.core.engine_core`) ---------------------------------

    @property
    def config(self) -> EngineConfig:
        """The configuration in use (resolved; `reconfigure` changes it)."""
        return self.core.config

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int] | set[int] | tuple[int, ...]:
        return self.core.eos_token_ids

    @property
    def model_spec(self) -> ModelSpec:
        return self.core.model_spec

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self.core.generation_defaults

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks allocated on every rank."""
        return self.core.num_kv_blocks

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.core.spec_stats

    @property
    def step_id(self) -> int:
        return self.core.step_id

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def pause_mode(self) -> PauseMode | None:
        return self.core.pause_mode

    @property
    def inconsistent(self) -> EngineInconsistentError | None:
        return self.core.inconsistent

    @property
    def timeline(self) -> StepTimeline | None:
        return self.core.timeline

    @timeline.setter
    def timeline(self, timeline: StepTimeline | None) -> None:
        self.core.timeline = timeline

    @property
    def compile_verdicts(self) -> dict[str, str | None] | None:
        return self.core.compile_verdicts

    @compile_verdicts.setter
    def compile_verdicts(self, verdicts: dict[str, str | None] | None) -> None:
        self.core.compile_verdicts = verdicts

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        return self.core.default_sampling_params(**fields)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        disaggregation: str | None = None,
    ) -> list[str]:
        return self.core.add_request(
            request_id, prompt_token_ids, params, arrival_time, lora_request, disaggregation
        )

    def abort_request(self, seq_id: str) -> bool:
        return self.core.abort_request(seq_id)

    def finish_request(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> bool:
        return self.core.finish_request(seq_id, status, stop_reason)

    def abort_unfinished(self) -> list[str]:
        return self.core.abort_unfinished()

    def is_compiling(self, seq_id: str) -> bool:
        return self.core.is_compiling(seq_id)

    def waiting(self) -> list[Sequence]:
        return self.core.waiting()

    def step(self) -> StepOutputs:
        return self.core.step()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def has_work(self) -> bool:
        return self.core.has_work()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def pause(self, mode: PauseMode) -> list[str]:
        return self.core.pause(mode)

    def resume(self) -> None:
        self.core.resume()

    def update_gate(self) -> None:
        self.core.update_gate()

    def quiesce(self) -> None:
        self.core.quiesce()

    def check_usable(self, repairing: bool = False) -> None:
        self.core.check_usable(repairing)

    def take_step_id(self) -> int:
        return self.core.take_step_id()

    def failures_named(self, what: str) -> AbstractContextManager[None]:
        return self.core.failures_named(what)

    def mark_inconsistent(self, error: EngineInconsistentError) -> None:
        self.core.mark_inconsistent(error)

    def note_consistent(self) -> None:
        self.core.note_consistent()

    def diagnose_stall(self) -> EngineDeadError | None:
        return self.core.diagnose_stall()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def drop_cached_blocks(self) -> int:
        """Drop every unreferenced cached block; how many were dropped."""
        return self.core.drop_cached_blocks()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (running requests keep theirs)."""
        return self.core.num_cached_blocks

    def advance_kv_epoch(self, flush: bool = True) -> None:
        self.core.advance_kv_epoch(flush)

    def reconfigure(self, **changes: Any) -> None:
        self.core.reconfigure(**changes)

    def shutdown(self) -> None:
        self.core.shutdown()

    # -- LoRA adapters (`tp_engine.features.lora.control`) --------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return lora_control.add_lora(self.lora, lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return lora_control.remove_lora(self.lora, lora_int_id)

    def list_loras(self) -> set[int]:
        return lora_control.list_loras(self.lora)

    # -- sleep mode (`tp_engine.features.weights_and_sleep.sleep`) -----------------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> list[str]:
        """Release the weights (level 1: kept on the host; 2: discarded) and the KV cache on
        every rank; aborts the unfinished requests (returns their ids)."""
        return self.sleep_state.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore "weights", "kv_cache" or both (None) on every rank."""
        self.sleep_state.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_state.is_sleeping

    def note_weights_loaded(self) -> None:
        """A full weight update wrote every parameter: serve again after sleep(level=2)."""
        self.sleep_state.note_weights_loaded()

    # -- weight updates (`tp_engine.features.weights_and_sleep.weight_updates`) ---------------------------------------------

    def load_weights(self, weights: Any, **kwargs: Any) -> int:
        return weight_updates.load_weights(self, weights, **kwargs)

    def update_weights_from_disk(self, model_path: str | Path, **kwargs: Any) -> None:
        weight_updates.update_weights_from_disk(self, model_path, **kwargs)

    def init_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        weight_updates.init_weights_update_group(self, *args, **kwargs)

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> None:
        weight_updates.update_weights_from_distributed(self, *args, **kwargs)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        weight_updates.destroy_weights_update_group(self, group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return weight_updates.get_weights_by_name(self, name, truncate_size)


def _token_id_of(tokenizer: Any) -> Callable[[str], int | None]:
    """The tokenizer's id of a single token's text, None if it is not one."""

    def token_id(text: str) -> int | None:
        tid = tokenizer.convert_tokens_to_ids(text)
        return None if tid is None or tid == tokenizer.unk_token_id else int(tid)

    return token_id


def _check_pooling_config(spec: ModelSpec, config: EngineConfig) -> None:
    """A pooling model computes prompts only: nothing to draft or verify. Pipeline parallelism
    serves generation only (the pooling heads' rows would need their own way to rank 0)."""
    if spec.is_pooling and config.pipeline_parallel_size > 1:
        raise ValueError(
            f"pooling models ({spec.task!r}) are not supported with pipeline_parallel_size="
            f"{config.pipeline_parallel_size} yet"
        )
    if spec.is_pooling and config.speculative_config is not None:
        raise ValueError(
            f"speculative decoding cannot run with a pooling model (it serves {spec.task!r} "
            "and generates no tokens); leave speculative_config unset"
        )


def check_draft_model(draft_dir: str, vocab_size: int, tokenizer: Any) -> None:
    """Refuse a draft model whose vocabulary is not the target's (its drafts would be other
    tokens): the same number of logits rows and the same tokenizer vocabulary."""
    from transformers import AutoTokenizer

    path = Path(draft_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config: the draft model {draft_dir!r} has no config.json")
    draft_vocab = int(load_hf_config(path).vocab_size)
    if draft_vocab != vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft_vocab} logits rows) "
            f"differs from the target's ({vocab_size}); a draft must share the target's "
            "tokenizer and vocabulary (e.g. Qwen3-0.6B for any larger Qwen3)"
        )
    if AutoTokenizer.from_pretrained(str(path)).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "speculative_config: the draft model's tokenizer differs from the target's; a draft "
            "must share the target's vocabulary"
        )


def _demo_model_dir() -> Path:
    from tp_engine.demo import demo_checkpoint_dir

    return demo_checkpoint_dir()
