"""Multi-LoRA on each rank: PEFT adapters, their slot stacks beside the linear layers, loading."""
