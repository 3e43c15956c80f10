"""LoRA adapters on rank 0: `registry` (the registry of device slots, pins and
per-load prefix-cache tags behind the scheduler's gate) and `control` (its LOAD_LORA /
UNLOAD_LORA control calls between steps, and `plug_in`, which registers its core hooks). A
request names its adapter with `tp_engine.lora_request.LoRARequest`."""
