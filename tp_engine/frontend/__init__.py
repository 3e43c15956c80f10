"""The front ends' shared parts, on the user's side of the engine: the offline API (`LLM`, its
pooling methods and output shapes, per-prompt arguments, `get_metrics`), and the incremental
detokenizer with stop strings, which `LLM.generate` and the server's API process both run.
Nothing here holds request state the engine owns: it turns the engine's step outputs into what
a user reads."""
