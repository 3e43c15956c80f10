"""Which flag (or environment variable) offers each route that a server may be started without,
so that the 404 of a server without it says how to turn it on (`http_errors`)."""

from __future__ import annotations

WEIGHT_UPDATES_FLAG = "--enable-weight-updates"
SLEEP_MODE_FLAG = "--enable-sleep-mode"
# path -> the flag that offers it (for the 404 of a server started without it).
FLAGGED_ROUTES: dict[str, str] = {
    **dict.fromkeys(
        ("/update_weights_from_disk", "/init_weights_update_group",
         "/update_weights_from_distributed", "/destroy_weights_update_group",
         "/get_weights_by_name", "/get_weight_version", "/flush_cache", "/reset_prefix_cache",
         "/pause_generation", "/continue_generation", "/pause", "/resume", "/is_paused"),
        WEIGHT_UPDATES_FLAG,
    ),
    **dict.fromkeys(
        ("/sleep", "/wake_up", "/is_sleeping", "/release_memory_occupation",
         "/resume_memory_occupation"),
        SLEEP_MODE_FLAG,
    ),
    **dict.fromkeys(
        ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
        "--enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    ),
    "/update_weights_from_tensor": (
        "--enable-weight-updates and --enable-weight-updates-from-tensor"
    ),
}  # fmt: skip
