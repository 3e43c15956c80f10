"""The offline API: `LLM(model, tensor_parallel_size=N).generate(prompts, params)`.

With `pipeline_parallel_size=P` the engine runs on N x P ranks (`rank_worker.pp`): everything
below holds with N x P in place of N.

Three ways to run, one engine:

- plain Python, N = 1: everything happens in this process;
- plain Python, N > 1: this process becomes rank 0 and starts ranks 1..N-1 as child processes
  (`python -m rank_worker.dist.worker`) that rendezvous with it on 127.0.0.1;
- under torchrun (RANK and WORLD_SIZE set): every rank constructs `LLM`; on rank 0 it returns
  the engine, on the other ranks it serves rank 0 until shutdown and then exits the process.
  Every rank watches the torchrun agent (`rank_worker.dist.launcher_watch`): once it is gone, rank 0's
  `generate` raises `EngineDeadError` and the process exits within `RANK0_GRACE_S` whatever
  the script does, and the workers follow.

Generation as in vLLM's offline API: `sampling_params=None` means the checkpoint's
generation-config defaults (`get_default_sampling_params`); a request with `n > 1` returns n
completions whose samples share the prompt's KV blocks; `chat` renders conversations with the
tokenizer's chat template. Detokenization, stop strings and logprob dicts happen on the
caller's side of the engine (`request_run`); prompts are made token ids by `prompts`.
"""

from __future__ import annotations

import atexit
import itertools
import logging
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch

from rank_worker.dist import bringup
from rank_worker.dist.launcher_watch import RANK0_GRACE_S, LauncherWatch
from tp_engine.config import EngineConfig
from tp_engine.engine import LLMEngine
from tp_engine.features.weights_and_sleep import weight_updates
from tp_engine.frontend.llm_pooling import PoolingMethods
from tp_engine.frontend.metrics_reader import Metric, engine_metrics
from tp_engine.frontend.outputs import RequestOutput
from tp_engine.frontend.per_prompt import per_prompt
from tp_engine.frontend.prompts import (
    ChatMessage,
    PromptType,
    as_prompt_list,
    prompt_text,
    prompt_token_ids,
)
from tp_engine.frontend.request_run import Sample, request_output, run_samples
from tp_engine.lora_request import LoRARequest
from tp_engine.pooling_params import PoolingParams
from tp_engine.sampling_params import SamplingParams

# How long shutdown waits for spawned workers to exit before killing them.
_WORKER_EXIT_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


class LLM(PoolingMethods):
    """Generate completions for a batch of prompts with a tensor-parallel engine; or, for a
    pooling model, embed, classify and score them (`tp_engine.frontend.llm_pooling`)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tensor_parallel_size: int | None = None,
        pipeline_parallel_size: int = 1,
        dist_backend: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        launcher = bringup.torchrun_launcher()  # first: see rank_worker.dist.bringup
        tp_size = bringup.tensor_parallel_size(tensor_parallel_size, pipeline_parallel_size)
        # Validate every argument before any process is started.
        config = EngineConfig(
            model=model,
            tensor_parallel_size=tp_size,
            pipeline_parallel_size=pipeline_parallel_size,
            **engine_kwargs,
        )
        self._ranks: bringup.Ranks | None = None
        self._launcher_watch: LauncherWatch | None = None
        # Set (from the launcher watch's thread) once torchrun's agent is gone.
        self._launcher_gone: str | None = None
        if launcher is not None and bringup.torchrun_rank() == 0:
            self._launcher_watch = LauncherWatch(
                launcher, "the launcher", self._on_launcher_gone, grace_s=RANK0_GRACE_S
            ).start()
        self._ranks = ranks = bringup.start(config.world_size, dist_backend, launcher)
        if not ranks.tp.is_first:
            raise SystemExit(bringup.serve_as_worker(ranks))

        try:
            self.engine = LLMEngine(config, ranks.tp, ranks.fault)
        except BaseException:
            self._release(dead=True)
            raise
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._closed = False
        atexit.register(self.shutdown)

    # -- generation ------------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges since start, vLLM's names (`metrics_reader`): e.g.
        `vllm:spec_decode_num_accepted_tokens`, `vllm:prefix_cache_hits`."""
        return engine_metrics(self.engine.stats(), {"model_name": str(self.engine.model_dir)})

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults overridden by the checkpoint's generation_config.json."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | SequenceOf[PromptType],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        A prompt is a string, a list of token ids, or `{"prompt_token_ids": [...]}` (or
        `{"prompt": "..."}`, or both). `sampling_params` None takes the checkpoint's defaults.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model; needs `enable_lora=True`). A bad prompt, parameter or adapter raises ValueError
        before anything runs.
        """
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        prompt_list = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        n = len(prompt_list)
        params_list = per_prompt(
            sampling_params, SamplingParams, n, "sampling params", SamplingParams()
        )
        loras = per_prompt(lora_request, LoRARequest, n, "LoRA requests")
        requests = [
            (self._prompt_ids(p), prompt_text(p), sp)
            for p, sp in zip(prompt_list, params_list, strict=True)
        ]

        for _, _, params in requests:
            if params.structured_outputs is not None:
                # Parsed here, as the API process does for the server: the engine compiles.
                params.structured_outputs.check()
        groups: list[tuple[str, list[str]]] = []
        try:
            for (token_ids, _, params), lora in zip(requests, loras, strict=True):
                request_id = f"gen-{next(self._ids)}"
                seq_ids = self.engine.add_request(request_id, token_ids, params, lora_request=lora)
                groups.append((request_id, seq_ids))
        except Exception:
            for _, seq_ids in groups:
                for seq_id in seq_ids:
                    self.engine.abort_request(seq_id)
            raise
        samples = {
            seq_id: Sample.for_params(params, self.tokenizer)
            for (_, seq_ids), (_, _, params) in zip(groups, requests, strict=True)
            for seq_id in seq_ids
        }
        self._run(samples, use_tqdm)
        return [
            request_output(
                request_id, prompt, token_ids, [samples[i] for i in seq_ids], self.tokenizer
            )
            for (request_id, seq_ids), (token_ids, prompt, _) in zip(groups, requests, strict=True)
        ]

    def chat(
        self,
        messages: SequenceOf[ChatMessage] | SequenceOf[SequenceOf[ChatMessage]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of `{"role", "content"}` messages) or a
        list of conversations, rendered with the checkpoint's chat template (or
        `chat_template`). The rendered text is the output's `prompt`; its tokens are encoded
        without adding special tokens, since the template writes them (as vLLM does).

        `tools` (OpenAI's function definitions), `documents` and `chat_template_kwargs` (e.g.
        `{"enable_thinking": False}`) go to the template, as the server passes them. Sampling
        params with a `thinking_token_budget` get the tokenizer's `<think>` / `</think>` ids
        and each prompt's thinking state filled in (`tp_engine.common.thinking`).
        `lora_request`: as for `generate`, one or one per conversation."""
        from tp_engine.common import thinking

        if not messages:
            raise ValueError("no messages given")
        first = messages[0]
        conversations = [messages] if isinstance(first, dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conversation),
                tools=tools,
                documents=documents,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if sampling_params is not None and any(map(thinking.needs_think_tokens, sampling_params)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} chats")
            think = thinking.think_tokens(self.tokenizer)
            sampling_params = [
                thinking.with_think_tokens(params, think, prompt["prompt_token_ids"])
                for params, prompt in zip(sampling_params, prompts, strict=True)
            ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, samples: dict[str, Sample], use_tqdm: bool) -> None:
        """Step the engine until every sample finished (`request_run.run_samples`)."""
        run_samples(
            self.engine, samples, use_tqdm, lambda: self._launcher_gone, lambda: self._release(True)
        )

    def _prompt_ids(self, prompt: PromptType) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer)

    def _prompt_id_lists(self, prompts: PromptType | SequenceOf[PromptType]) -> list[list[int]]:
        return [self._prompt_ids(p) for p in as_prompt_list(prompts)]

    def _run_pooling(
        self, prompt_ids: list[list[int]], params: list[PoolingParams], use_tqdm: bool
    ) -> list[tuple[str, torch.Tensor]]:
        """Run pooling requests to their ends: (request id, result) in the order given."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        request_ids: list[str] = []
        try:
            for token_ids, p in zip(prompt_ids, params, strict=True):
                request_id = f"pool-{next(self._ids)}"
                request_ids += self.engine.add_request(request_id, token_ids, p)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        samples = {rid: Sample(SamplingParams(max_tokens=0), None) for rid in request_ids}
        self._run(samples, use_tqdm)
        results = []
        for rid in request_ids:
            pooled = samples[rid].pooled
            if pooled is None:
                raise RuntimeError(f"pooling request {rid!r} ended without a result")
            results.append((rid, pooled))
        return results

    # -- sleep mode (`tp_engine.features.weights_and_sleep.sleep`) -----------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Give back the device memory of the weights and the KV cache on every rank (vLLM's
        `LLM.sleep`). Level 1 keeps the weights in host memory, level 2 discards them (load
        new ones before generating). Unfinished requests are aborted and the prefix cache is
        flushed."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: `tags` among "weights" and "kv_cache", None for both."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while any tag sleeps."""
        return self.engine.is_sleeping()

    # -- lifetime --------------------------------------------------------------------------------

    # -- weight updates (the engine's; `tp_engine.features.weights_and_sleep.weight_updates` documents them) -------------

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        bucket_bytes: int = weight_updates.DEFAULT_BUCKET_BYTES,
    ) -> int:
        """Write full Hugging Face-named tensors (any float dtype, any subset) on every rank;
        returns how many. Raises `ControlRefusedError` (nothing changed) for a bad batch."""
        return self.engine.load_weights(
            weights, weight_version=weight_version, flush_cache=flush_cache,
            bucket_bytes=bucket_bytes,
        )  # fmt: skip

    def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None, flush_cache: bool = True
    ) -> None:
        """Reload every weight from a safetensors checkpoint of this model's shapes."""
        self.engine.update_weights_from_disk(
            model_path, weight_version=weight_version, flush_cache=flush_cache
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = weight_updates.DEFAULT_GROUP_NAME,
        backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Join a trainer's process group (the trainer is its rank 0; rank r is
        `rank_offset + r`)."""
        self.engine.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend, **kwargs
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[Any],
        shapes: list[list[int]],
        *,
        group_name: str = weight_updates.DEFAULT_GROUP_NAME,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Receive the named full tensors by broadcast from the trainer, in order."""
        self.engine.update_weights_from_distributed(
            names, dtypes, shapes, group_name=group_name, weight_version=weight_version,
            flush_cache=flush_cache,
        )  # fmt: skip

    def destroy_weights_update_group(
        self, group_name: str = weight_updates.DEFAULT_GROUP_NAME
    ) -> None:
        self.engine.destroy_weights_update_group(group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of checkpoint tensor `name`, flattened, gathered
        from every rank's shard (the full tensor's, at any TP size)."""
        return self.engine.get_weights_by_name(name, truncate_size)

    def reset_prefix_cache(self) -> bool:
        """Drop unreferenced cached blocks; True when nothing stays cached."""
        return self.engine.reset_prefix_cache()

    @property
    def weight_version(self) -> str:
        """The label of the weights in use: "default", then the last update's
        `weight_version`."""
        return self.engine.weight_version

    def shutdown(self) -> None:
        """Stop the workers and free the channel. Idempotent; also runs at interpreter exit."""
        if getattr(self, "_closed", True):
            return
        self._release(dead=False)

    def _on_launcher_gone(self, message: str) -> None:
        self._launcher_gone = message
        logger.error(
            "%s: generate() fails from now on; this process exits within %g s",
            message,
            RANK0_GRACE_S,
        )

    def _release(self, dead: bool) -> None:
        self._closed = True
        if self._launcher_watch is not None:
            self._launcher_watch.stop()  # no effect once the launcher is gone: the exit stands
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if self._ranks is not None:
            # Also after a failure: the peers are gone (killed), and a later LLM in this
            # process needs a fresh group.
            self._ranks.release(dead, _WORKER_EXIT_TIMEOUT_S)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
