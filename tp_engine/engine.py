"""Rank 0's engine: requests in, one step at a time, tokens out.

`LLMEngine` owns the control plane (Scheduler, BlockManager), this rank's ModelRunner, the plan
channel to the other ranks and the sampler. One `step()`:

    schedule → build StepPlan → publish to ranks 1..N-1 → forward on rank 0 (the collectives
    keep every rank in lock-step) → sample from the gathered logits → Scheduler.update

Start-up mirrors `rank_worker.worker.run_worker` on the other ranks (see its docstring for the
order). A failure on another rank surfaces here as `EngineDeadError` naming that rank and step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rank_worker.faults import maybe_inject
from rank_worker.model_runner import ModelRunner, load_hf_config
from rank_worker.runner_config import RunnerConfig
from rank_worker.sampler import sample
from rank_worker.tp import TPInfo, broadcast_bytes
from rank_worker.worker import Bootstrap, default_device
from shm_ipc import ChannelError, PlanBroadcaster, StepPlan
from tp_engine.block_manager import BlockManager
from tp_engine.config import EngineConfig
from tp_engine.plan_builder import build_step_plan
from tp_engine.sampling_params import SamplingParams
from tp_engine.scheduler import Scheduler
from tp_engine.sequence import Sequence

logger = logging.getLogger(__name__)

# How long rank 0 keeps listening for a worker's error report after a step failed.
_ERROR_REPORT_WAIT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine cannot step any more: a rank failed or died. `rank` names it when known."""

    def __init__(self, message: str, rank: int | None = None, step_id: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.step_id = step_id


@dataclass
class StepResult:
    """What one step did, for outputs and throughput figures."""

    finished: list[Sequence]
    # Sequences that received a token this step (finished ones included).
    sampled: list[Sequence]
    num_prefill_tokens: int
    num_decode_tokens: int


def runner_config_for(config: EngineConfig) -> RunnerConfig:
    if config.max_model_len is None:
        raise ValueError("max_model_len is not resolved yet; call with_model_defaults first")
    return RunnerConfig(
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.resolved_max_num_batched_tokens,
        dtype=config.dtype,
        seed=config.seed,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        enforce_eager=config.enforce_eager,
        attention_backend=config.attention_backend,
    )


def eos_token_ids(tokenizer: Any, model_dir: Path) -> set[int]:
    """EOS ids from the tokenizer and from generation_config.json (int or list), as vLLM does."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(i) for i in eos)
    return ids


class LLMEngine:
    """The engine on rank 0 of a process group of `tp.size` ranks."""

    def __init__(self, config: EngineConfig, tp: TPInfo, device: torch.device | None = None):
        from transformers import AutoTokenizer  # deferred: slow to import

        if not tp.is_first:
            raise ValueError("LLMEngine runs on rank 0; other ranks run rank_worker.run_worker")
        if config.tensor_parallel_size != tp.size:
            raise ValueError(
                f"tensor_parallel_size ({config.tensor_parallel_size}) does not match the "
                f"process group's size ({tp.size})"
            )
        model_dir = Path(config.model) if config.model else _demo_model_dir()
        hf_config = load_hf_config(model_dir)
        self.config = config.with_model_defaults(hf_config.max_position_embeddings)
        self._launch_config = self.config
        self.model_dir = model_dir
        self.tp = tp
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = int(hf_config.vocab_size)
        self.eos_token_ids = eos_token_ids(self.tokenizer, model_dir)
        runner_config = runner_config_for(self.config)

        self.channel: PlanBroadcaster | None = None
        self.step_id = 0
        self._dead: EngineDeadError | None = None
        try:
            if tp.size > 1:
                self.channel = PlanBroadcaster(num_readers=tp.size - 1)
                boot = Bootstrap(str(model_dir), runner_config, self.channel.handle)
                broadcast_bytes(boot.to_bytes(), tp)
                self.channel.wait_for_readers()
            with self._failures_named("start-up"):
                self.runner = ModelRunner(
                    model_dir, runner_config, tp, device or default_device(tp)
                )
                self.num_kv_blocks = self.runner.determine_num_kv_blocks()
                self.runner.init_kv_cache(self.num_kv_blocks)
        except BaseException:
            if self.channel is not None:
                self.channel.close()  # the workers see CLOSE and exit non-zero
            raise
        self.scheduler = self._build_scheduler(self.config)

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        """Queue a request; raises ValueError (RequestRejectedError) saying what is wrong."""
        _refuse_unsupported(params)
        if not isinstance(prompt_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids
        ):
            raise ValueError(f"request {request_id!r}: prompt token ids must be a list of integers")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        seq = Sequence(request_id, prompt_token_ids, params)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping --------------------------------------------------------------------------------

    def step(self) -> StepResult:
        if self._dead is not None:
            raise self._dead
        out = self.scheduler.schedule()
        if out.is_empty:
            return StepResult([], [], 0, 0)
        plan = build_step_plan(out, self.config.block_size, self.step_id)
        self.step_id += 1
        with self._failures_named(f"step {plan.step_id}"):
            if self.channel is not None:
                self.channel.publish(plan)
                # A worker that died since the last step would leave rank 0 waiting in the
                # forward's first collective; find out now, with its rank and report.
                self.channel.check_readers()
            maybe_inject(0, plan.step_id)
            logits = self.runner.execute(plan)
        assert logits is not None  # rank 0 always gets the gathered logits
        sampling = [seq for seq, s in zip(out.scheduled, out.samples, strict=True) if s]
        # Before update: a decode is a sequence with output whose one uncomputed token runs now.
        num_decode = sum(
            1 for seq in out.scheduled if seq.num_output_tokens and seq.num_uncomputed_tokens == 1
        )
        finished = self.scheduler.update(out, self._sample(logits, sampling))
        return StepResult(finished, sampling, out.num_batched_tokens - num_decode, num_decode)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        if not seqs:
            return []
        temperatures = torch.tensor(  # [B']
            [seq.sampling_params.temperature for seq in seqs], dtype=torch.float32
        )
        return sample(logits, temperatures).tolist()

    def _failures_named(self, what: str) -> _FailureGuard:
        return _FailureGuard(self, what)

    # -- configuration of rank-0-only knobs --------------------------------------------------------

    def reconfigure(self, **changes: Any) -> None:
        """Change scheduling knobs that only rank 0 uses (prefix caching, chunked prefill, token
        budget, sequence cap, or a pool smaller than the allocated one) between batches. Changes
        apply to the configuration the engine was launched with (earlier calls are forgotten),
        and the new block manager starts with an empty prefix cache.

        The workers are not involved: their caches keep the same shape and whatever the new
        block manager hands out is overwritten before it is read.
        """
        if self.scheduler.has_unfinished():
            raise RuntimeError("reconfigure needs an idle engine")
        allowed = {
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "max_num_batched_tokens",
            "max_num_seqs",
            "num_kv_blocks",
        }
        if set(changes) - allowed:
            raise ValueError(f"only {sorted(allowed)} can change at run time")
        num_blocks = changes.get("num_kv_blocks") or self.num_kv_blocks
        if num_blocks > self.num_kv_blocks:
            raise ValueError(
                f"num_kv_blocks {num_blocks} exceeds the allocated {self.num_kv_blocks}"
            )
        config = dataclasses.replace(self._launch_config, **changes)
        if config.max_num_seqs > self._launch_config.max_num_seqs:
            raise ValueError(
                f"max_num_seqs cannot grow past the launch value ({self._launch_config.max_num_seqs})"
            )
        launch_budget = self._launch_config.resolved_max_num_batched_tokens
        if config.resolved_max_num_batched_tokens > launch_budget:
            raise ValueError(
                f"the token budget cannot grow past the launch budget ({launch_budget})"
            )
        self.config = config
        self.scheduler = self._build_scheduler(config, num_blocks)

    def _build_scheduler(self, config: EngineConfig, num_blocks: int | None = None) -> Scheduler:
        bm = BlockManager(
            num_blocks or self.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        return Scheduler(config, bm, self.eos_token_ids)

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Tell the workers to exit and release the channel. Idempotent."""
        if self.channel is None:
            return
        channel, self.channel = self.channel, None
        try:
            if self._dead is None:
                channel.publish(StepPlan.exit(self.step_id))
        except ChannelError as exc:
            logger.warning("workers could not be told to exit: %s", exc)
        finally:
            channel.close()


class _FailureGuard:
    """Turns a failed step (or start-up) into EngineDeadError naming the rank at fault."""

    def __init__(self, engine: LLMEngine, what: str) -> None:
        self.engine = engine
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        if isinstance(exc, ValueError) and self.what == "start-up":
            # A configuration rank 0 refuses (every rank refuses the same): the caller's error,
            # not a broken rank, so it keeps its type and message.
            self.engine._dead = EngineDeadError(f"start-up failed: {exc}", rank=0)
            return False
        error = self._diagnose(exc)
        self.engine._dead = error
        raise error from exc

    def _diagnose(self, exc: Exception) -> EngineDeadError:
        if isinstance(exc, ChannelError):
            return EngineDeadError(str(exc), rank=exc.rank, step_id=exc.step_id)
        channel = self.engine.channel
        if channel is not None:
            # Another rank probably failed first and rank 0 only saw its collective break: wait
            # a little for that rank's own report, which says what really happened.
            deadline = time.monotonic() + _ERROR_REPORT_WAIT_S
            while time.monotonic() < deadline:
                try:
                    channel.check_readers()
                except ChannelError as reported:
                    return EngineDeadError(
                        str(reported), rank=reported.rank, step_id=reported.step_id
                    )
                time.sleep(0.05)
        return EngineDeadError(
            f"rank 0 failed during {self.what}: {type(exc).__name__}: {exc}", rank=0
        )


# Fields that the sampler does not implement yet, with the value that means "off".
_UNSUPPORTED_DEFAULTS = {
    "n": 1,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": None,
    "logprobs": None,
    "prompt_logprobs": None,
}


def _refuse_unsupported(params: SamplingParams) -> None:
    """Refuse, rather than silently ignore, sampling controls the sampler does not apply yet."""
    for name, off in _UNSUPPORTED_DEFAULTS.items():
        if getattr(params, name) != off:
            raise ValueError(
                f"SamplingParams.{name}={getattr(params, name)!r} is not supported yet (only "
                "greedy and temperature sampling are); leave it at its default"
            )


def _demo_model_dir() -> Path:
    from tp_engine.checkpoints import demo_checkpoint_dir

    return demo_checkpoint_dir()
