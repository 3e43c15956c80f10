"""What every rank runs, in rooms whose imports run one way: `dist` (bring-up and the worker loop)
→ `control` (control calls) → `runner` (the ModelRunner) → `spec` (EAGLE-3 heads) → `inputs`
(a step's inputs), `kv` (the KV cache and its tiers' copies), `lora` → `models` (Qwen3 and its
parallel layers) → `attention`. Beside them, shared by every room: `tp` (TP facts and the
collectives), `runner_config` (what rank 0 sends every rank) and `fault_injection`. Holds no
request state."""
