"""Run-time weight updates (`weight_updates`: an iterator, a disk checkpoint, a trainer's
process group; each advances the prefix cache's epoch) and sleep mode's engine side (`sleep`:
release and restore the weights and the KV cache on every rank). Both are control calls; pause
and quiesce are the engine core's own operations."""
