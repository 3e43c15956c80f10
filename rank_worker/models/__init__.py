"""The model a rank runs: the Qwen3 dense and MoE decoders (`qwen3`, `qwen3_moe`) built from the
parallel `layers`, the class chosen from config.json (`architectures`), what a checkpoint is
served as (`model_spec`) and the output `heads`, the one name-to-shard map (`weight_map`) that
checkpoint loading (`loader`) and run-time weight updates share, and FP8 checkpoints
(`quantization`)."""
