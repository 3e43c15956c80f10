"""The engine core: rank 0's control plane, which drives an executor and holds no model.

It owns every request's state (CPU, mutable): `EngineCore` (`engine_core`) holds as members
the intake and n > 1 fan-out (`intake`), the scheduler (`scheduler`: `request_queue`,
`running_batch`, `block_allocation`, `verify_entries`, `step_planner`, `scheduler_update`),
the KV manager (`kv`: block pool and prefix cache behind `kv.base.KVTier`), the step pipeline
(`pipeline`: schedule → launch → sample → apply) and the plans' runner (`plan_runner`).
Features see it through `hooks.CoreAccess` and plug in through `hooks.CoreHooks`. A step leaves it as a `StepPlan` (`plan_builder`) handed to an executor
(`tp_engine.executor.base.Executor`); what comes back is the step's logits rows.

Nothing here imports `rank_worker` (tests/test_core_standin.py checks it in a subprocess), so
the core runs against a stand-in executor without a model, and against executors it does not
own. Importing this package loads nothing but its docstring.
"""
