"""The tensor-parallel executor: rank 0's `ModelRunner` plus the plan ring to the other ranks.

Ownership: built by the bring-up (`tp_engine.engine.LLMEngine`), which hands it to the core.
It owns the plan channel (`shm_ipc.PlanBroadcaster`, one writer, `tp.size - 1` readers: the ring
on rank 0's node, TCP to the ranks on others), rank
0's runner (weights, KV cache, CUDA graphs) and the `StepExecutor` that runs plans and control
calls on this rank. A plan or a call is published on the ring first and then run here: every
rank runs the same messages in the same order, so their collectives meet.

Start-up mirrors `rank_worker.dist.worker.run_worker` on the other ranks (`rank_worker.dist.bootstrap`
has the order): the bootstrap message, every reader attached, then each rank loads its shard,
measures its memory and allocates the KV cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from rank_worker.control.protocol import ControlResult
from rank_worker.dist.bootstrap import Bootstrap
from rank_worker.dist.step import StepExecutor
from rank_worker.fault_injection import Fault
from rank_worker.kv.pd_agent import KVAgent, start_kv_agent
from rank_worker.runner.model_runner import ModelRunner
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo
from shm_ipc import ChannelError, ControlCall, PlanBroadcaster, StepPlan
from tp_engine.common.failures import EngineDeadError, FailureGuard, check_ranks, diagnose_stall
from tp_engine.common.step_timeline import StepTimeline, gpu_phase_or_null, phase_or_null
from tp_engine.executor.base import StepResult

logger = logging.getLogger(__name__)

__all__ = ["TPExecutor"]


class TPExecutor:
    """`tp_engine.executor.base.Executor` over `tp.size` ranks of one process group."""

    def __init__(
        self,
        runner: ModelRunner,
        step_executor: StepExecutor,
        channel: PlanBroadcaster | None,
        num_kv_blocks: int,
        kv_agent: KVAgent | None = None,
    ) -> None:
        self.runner = runner
        self.step_executor = step_executor
        self.channel = channel  # None with one rank
        self.num_kv_blocks = num_kv_blocks
        self.device: torch.device = runner.device
        pool = runner.host_pool
        self.num_host_blocks = 0 if pool is None else pool.num_host_blocks
        # Rank 0's end of prefill/decode disaggregation (`--disaggregation-mode`); None: off.
        self.kv_agent = kv_agent

    @classmethod
    def start(
        cls,
        model_dir: Path,
        runner_config: RunnerConfig,
        tp: TPInfo,
        fault: Fault | None,
        sampler_profile: Callable | None,
    ) -> TPExecutor:
        """Start every rank on `model_dir` and size the KV cache; `sampler_profile`: what the
        memory profile runs to leave room for sampling (None: a model that samples nothing)."""
        channel = None
        try:
            if tp.size > 1:
                # Ranks on other nodes get the plans over TCP (`shm_ipc.remote`).
                channel = PlanBroadcaster(
                    num_readers=tp.size - 1, remote_readers=tp.remote_ranks, nodes=tp.nodes
                )
                Bootstrap(str(model_dir), runner_config, channel.handle).send(tp)
                channel.wait_for_readers()
            with FailureGuard(channel, "start-up"):
                runner = ModelRunner(model_dir, runner_config, tp, tp.device)
                num_kv_blocks = runner.determine_num_kv_blocks(sampler_profile)
                runner.init_kv_cache(num_kv_blocks)
                kv_agent = start_kv_agent(runner, tp.rank)
            step_executor = StepExecutor(runner, tp, fault)
        except BaseException:
            if channel is not None:
                channel.close()  # the workers see CLOSE and exit non-zero
            raise
        return cls(runner, step_executor, channel, num_kv_blocks, kv_agent)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.graph_runner is not None

    def execute(
        self, plan: StepPlan, sampled: torch.Tensor | None, timeline: StepTimeline | None
    ) -> StepResult:
        step_id = plan.step_id
        if self.channel is not None:
            with phase_or_null(timeline, "broadcast", step_id):
                self.channel.publish(plan)
                # A worker that died since the last step would leave rank 0 waiting in the
                # forward's first collective; find out now, with its rank and report.
                self.channel.check_readers()
        with (
            phase_or_null(timeline, "forward", step_id),
            gpu_phase_or_null(timeline, "gpu_forward", step_id),
        ):
            logits = self.step_executor.run(plan, sampled)
        assert logits is not None  # rank 0 always gets the gathered logits
        eagle3 = self.runner.eagle3
        return StepResult(logits, None if eagle3 is None else eagle3.take_hidden_states())

    def control(self, call: ControlCall) -> ControlResult:
        if self.channel is not None:
            self.channel.publish(call)
            # As before a step: a worker that died since would leave rank 0 waiting in the
            # call's first gather; find out now, with its rank and report.
            self.channel.check_readers()
        return self.step_executor.control(call)

    def guard(self, what: str) -> FailureGuard:
        return FailureGuard(self.channel, what)

    def diagnose_stall(self, step_id: int) -> EngineDeadError | None:
        return diagnose_stall(self.channel, step_id)

    def check_ranks(self) -> EngineDeadError | None:
        return check_ranks(self.channel)

    def shutdown(self, exit_step_id: int | None) -> None:
        try:
            if self.channel is not None:
                channel, self.channel = self.channel, None
                try:
                    if exit_step_id is not None:
                        channel.publish(StepPlan.exit(exit_step_id))
                except ChannelError as exc:
                    logger.warning("workers could not be told to exit: %s", exc)
                finally:
                    channel.close()
        finally:
            if self.kv_agent is not None:
                self.kv_agent.close()
            self.runner.release()
