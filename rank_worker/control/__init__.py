"""Control calls on every rank: the op table and two-phase protocol (`protocol`), the ops of
weight updates (`weight_ops`, with a trainer's group in `weight_group`), of LoRA (`lora_ops`)
and of sleep mode (`sleep_ops`)."""
