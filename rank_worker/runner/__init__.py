"""The `ModelRunner`: one StepPlan in, one forward pass out; what it works out before serving
(`startup`: dtypes, warm-up plans, KV sizing), the target's CUDA graphs (`cuda_graphs`) and sleep
mode's release and restore of weight and KV memory (`device_sleep`)."""
