"""The engine's features, one package each, plugged into the engine core
(`tp_engine.core.hooks`: `CoreHooks` where they plug in, `CoreAccess` what they may call) by
the bring-up (`tp_engine.engine`), which builds the core first.

    lora/               adapters' registry of device slots and pins, their control calls
    speculative/        proposers (n-gram, draft model, EAGLE-3), verification, counters
    structured/         grammar compilation and per-sequence matchers
    pooling/            embed / classify / score requests, their params and outputs
    weights_and_sleep/  run-time weight updates, sleep mode (pause is the core's)

Each reaches the ranks only through control calls and the StepPlan; none reaches into the
core's scheduler or KV manager, and a feature's per-row state is its own (plans carry it through
`CoreHooks.plan_sections`).
"""
