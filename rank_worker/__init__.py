"""Per-rank execution: process-group setup and TP facts (`tp`), the Qwen3 model and its
parallel layers, weight loading, the KV cache, attention backends, the sampler and the
`ModelRunner` that turns one StepPlan into one forward pass. Holds no request state."""
