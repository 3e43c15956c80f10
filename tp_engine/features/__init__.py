"""The engine's features, one package each, plugged into the engine core
(`tp_engine.core.hooks`, the core's public methods) by the bring-up (`tp_engine.engine`).

    lora/               adapters' registry of device slots and pins, their control calls
    speculative/        proposers (n-gram, draft model, EAGLE-3), verification, counters
    structured/         grammar compilation and per-sequence matchers
    pooling/            embed / classify / score requests, their params and outputs
    weights_and_sleep/  run-time weight updates, sleep mode (pause is the core's)

Each reaches the ranks only through control calls and the StepPlan; none reaches into the
core's scheduler or KV manager.
"""
