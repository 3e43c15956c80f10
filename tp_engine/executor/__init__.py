"""Executors: what runs the engine core's plans on the ranks.

`base.Executor` is the interface the core drives (run a plan, a control call on every rank,
shut down); `tp.TPExecutor` is the tensor-parallel one, rank 0's `ModelRunner` plus the plan
ring to the other ranks, built by the bring-up (`tp_engine.engine`). `control` is rank 0's half
of control calls. This is the one place on rank 0's side that imports `rank_worker`.
"""
