"""Running the offline API's requests to their ends, on the caller's side of the engine.

`LLM` adds its requests to the engine and hands this module one `Sample` per engine sequence;
`run_samples` steps the engine until every sample finished, feeding each sample's new tokens to
its incremental detokenizer (stop strings end a sequence here, not in the engine), and
`request_output` turns a request's samples into vLLM's `RequestOutput` (decoded text, logprob
dicts). The samples are this module's: the engine owns the sequences, a sample only collects
what the engine reported of one (`tp_engine.core.outputs.SequenceOutput`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from tp_engine.common.failures import EngineDeadError
from tp_engine.core.outputs import SequenceOutput
from tp_engine.core.sequence import SequenceStatus, TokenLogprobs
from tp_engine.executor.control import EngineInconsistentError
from tp_engine.frontend.detokenizer import IncrementalDetokenizer
from tp_engine.frontend.outputs import CompletionOutput, RequestOutput, logprob_dicts
from tp_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tp_engine.engine import LLMEngine


class Sample:
    """One sequence's outputs as `generate` collects them."""

    def __init__(self, params: SamplingParams, detok: IncrementalDetokenizer | None) -> None:
        self.params = params
        # Feeds the stop strings (None without stop strings).
        self.detok = detok
        self.index = 0
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # A pooling request's result (`SequenceOutput.pooled`).
        self.pooled: torch.Tensor | None = None

    @classmethod
    def for_params(cls, params: SamplingParams, tokenizer: Any) -> Sample:
        """A sample of a request with these params: with a detokenizer when it has stop
        strings."""
        if not params.stop:
            return cls(params, None)
        detok = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            min_tokens=params.min_tokens,
        )
        return cls(params, detok)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_on_token(self) -> bool:
        """Whether the engine ended it on EOS or a stop token id (its last token)."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)

    def add(self, out: SequenceOutput) -> None:
        self.index = out.index
        self.token_ids += out.new_token_ids
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.num_cached_tokens is not None:
            self.num_cached_tokens = out.num_cached_tokens
        self.finish_reason = out.finish_reason
        self.stop_reason = out.stop_reason
        if out.pooled is not None:
            self.pooled = out.pooled

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` output tokens (and their logprobs)."""
        del self.token_ids[num_tokens:]
        if self.logprobs is not None:
            del self.logprobs[num_tokens:]

    def stopped_by(self, stop_string: str) -> None:
        self.finish_reason = "stop"
        self.stop_reason = stop_string


def run_samples(
    engine: LLMEngine,
    samples: dict[str, Sample],
    use_tqdm: bool,
    launcher_gone: Callable[[], str | None],
    on_dead: Callable[[], None],
) -> None:
    """Step the engine until every sample (by sequence id) finished, collecting the engine's
    outputs. `launcher_gone` is the message once torchrun's agent is gone, else None. On an
    error the unfinished sequences are aborted, unless the engine is dead (`EngineDeadError`:
    nothing is left to abort; `on_dead` releases the ranks). A failed weight update
    (`EngineInconsistentError`, an `EngineDeadError`) leaves the engine alive: aborted."""
    bar = tqdm(
        total=len(samples), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
    )
    prefill_tokens = decode_tokens = 0
    start = time.perf_counter()
    remaining = set(samples)
    try:
        if engine.inconsistent is not None:
            # A failed weight update: the ranks may disagree until a full load repairs
            # them; the engine itself is alive (no release).
            raise engine.inconsistent
        if engine.pause_mode is not None:
            # Nothing would be admitted: refuse rather than step forever.
            raise RuntimeError(f"the engine is paused ({engine.pause_mode.value}): resume it first")
        if engine.is_sleeping():
            raise RuntimeError("the engine is asleep: wake_up() first")
        while remaining:
            if (gone := launcher_gone()) is not None:
                raise EngineDeadError(gone)
            step = engine.step()
            prefill_tokens += step.num_prefill_tokens
            decode_tokens += step.num_decode_tokens
            done = 0
            for out in step.outputs:
                sample = samples.get(out.seq_id)
                if sample is None or sample.finished:
                    continue
                sample.add(out)
                if sample.detok is not None and _stop_string_seen(engine, out.seq_id, sample):
                    sample.stopped_by(sample.detok.stop_string)  # type: ignore[arg-type]
                if sample.finished:
                    remaining.discard(out.seq_id)
                    done += 1
            if done:
                bar.update(done)
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(
                    f"prefill {prefill_tokens / elapsed:.0f} tok/s, "
                    f"decode {decode_tokens / elapsed:.0f} tok/s"
                )
    except EngineInconsistentError:
        for seq_id in remaining:
            engine.abort_request(seq_id)
        raise
    except EngineDeadError:
        on_dead()
        raise
    except BaseException:
        for seq_id in remaining:
            engine.abort_request(seq_id)
        raise
    finally:
        bar.close()


def _stop_string_seen(engine: LLMEngine, seq_id: str, sample: Sample) -> bool:
    """Feed the sample's new tokens to its incremental detokenizer (no full decode per
    step); True if its text now holds a stop string, and then the engine ends it.

    Checked even when the engine finished the sequence on this very token (EOS or
    max_tokens on the token that completes a stop string): the stop string still wins.
    """
    detok = sample.detok
    assert detok is not None
    new_ids = sample.token_ids[len(detok.token_ids) :]
    detok.update(new_ids, engine_stopped=sample.stopped_on_token, finished=sample.finished)
    if detok.stop_string is None:
        return False
    # A stop string completed within a speculative step: the tokens after it never were.
    sample.truncate(len(detok.token_ids))
    engine.finish_request(seq_id, SequenceStatus.FINISHED_STOPPED, detok.stop_string)
    return True


def request_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    samples: list[Sample],
    tokenizer: Any,
) -> RequestOutput:
    """A finished request's `RequestOutput`: its samples' completions, in order."""
    first = samples[0]
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=[_completion(sample, tokenizer) for sample in samples],
        finished=True,
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=(
            logprob_dicts(first.prompt_logprobs, tokenizer)
            if first.prompt_logprobs is not None
            else None
        ),
    )


def _completion(sample: Sample, tokenizer: Any) -> CompletionOutput:
    logprobs = None
    if sample.logprobs is not None:
        logprobs = [d for d in logprob_dicts(sample.logprobs, tokenizer) if d is not None]
    return CompletionOutput(
        index=sample.index,
        text=final_text(sample, tokenizer),
        token_ids=sample.token_ids,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        cumulative_logprob=(
            sum(e.logprobs[0] for e in sample.logprobs) if sample.logprobs is not None else None
        ),
        logprobs=logprobs,
    )


def final_text(sample: Sample, tokenizer: Any) -> str:
    """The final text: cut before a stop string, and without the EOS or stop token id that
    ended the sequence (vLLM)."""
    if sample.detok is not None and sample.detok.finished:
        return sample.detok.text
    ids = sample.token_ids[:-1] if sample.stopped_on_token else sample.token_ids
    return tokenizer.decode(ids, skip_special_tokens=sample.params.skip_special_tokens)
