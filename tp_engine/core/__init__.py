"""The engine core: rank 0's control plane, which drives an executor and holds no model.

It owns every request's state (CPU, mutable): intake and n > 1 fan-out (`intake`), the
scheduler (`scheduler`, over the `running_batch` rows), the KV manager (`kv`: block pool and
prefix cache behind `kv.base.KVTier`) and the step pipeline (`pipeline`: schedule → launch →
sample → apply). A step leaves it as a `StepPlan` (`plan_builder`) handed to an executor
(`tp_engine.executor.base.Executor`); what comes back is the step's logits rows.

Nothing here imports `rank_worker` (tests/test_core_standin.py checks it in a subprocess), so
the core runs against a stand-in executor without a model, and against executors it does not
own. Importing this package loads nothing but its docstring.
"""
