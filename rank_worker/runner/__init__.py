"""The `ModelRunner`: one StepPlan in, one forward pass out; its KV sizing and warm-ups, the
target's CUDA graphs (`cuda_graphs`) and sleep mode's release and restore of weight and KV
memory (`device_sleep`)."""
