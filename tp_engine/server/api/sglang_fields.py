"""What SGLang's `/generate` request (`GenerateReqInput`, SGLang 0.5.23) carries beyond the fields
`sglang_routes.GenerateRequest` acts on, and what this server does with each.

sglang-router re-serializes every body it forwards, so a request through it carries many of
these at their defaults (`"model": null`, `"log_metrics": true`, `"bootstrap_room": null`,
...): each must pass. As SGLang itself does with them:

- `IGNORED`: no effect on the tokens here at any value (logging, metrics labels, tracing,
  routing hints a router has already used, the prefill/decode bootstrap fields outside PD mode,
  scheduling hints this engine has no use for);
- `UNSUPPORTED`: a feature this server does not have (multimodal inputs, hidden states,
  sessions, per-request LoRA by path, ...): accepted at its default, refused with a 400 naming
  it otherwise, rather than silently answering something else;
- anything else is not SGLang's either: refused by name, as SGLang refuses it.
"""

from __future__ import annotations

from typing import Any

IGNORED = frozenset({
    "model", "log_metrics", "no_logs", "custom_labels", "external_trace_header",
    "received_time", "routing_key", "conversation_id", "extra_key", "priority",
    "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank", "http_worker_ipc",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size",
})  # fmt: skip

# name -> its default in SGLang's GenerateReqInput (what "not asked for" looks like).
UNSUPPORTED: dict[str, Any] = {
    "session_id": None, "input_embeds": None, "image_data": None, "video_data": None,
    "audio_data": None, "mm_hashes": None, "use_audio_in_video": False, "video_config": None,
    "watermark": None, "token_ids_logprob": None, "return_sampling_mask": None,
    "sampling_logprobs_mode": None, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None,
    "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "positional_embed_overrides": None, "background": False, "require_reasoning": False,
    "max_thinking_tokens": None, "return_bytes": False, "return_entropy": False,
    "return_prompt_token_ids": False, "need_wait_for_mm_inputs": None,
    "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None, "token_indices_to_pool": None, "cache_salt": None,
    "kv_hints": None,
}  # fmt: skip


def refused_extra(extra: dict[str, Any]) -> str | None:
    """Why a request's fields beyond the ones acted on cannot be served (None: they can)."""
    for name, value in extra.items():
        if name in IGNORED:
            continue
        if name in UNSUPPORTED:
            if value in (UNSUPPORTED[name], None):  # None: a client's "not set", any default
                continue
            return f"{name} is not supported by this server"
        return f"{name}: not a field of SGLang's /generate request"
    return None
