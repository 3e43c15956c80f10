"""What several of rank 0's packages share, importing none of them: `failures` (a failed step
named by the rank at fault: the core, the executor, the bring-up and the server's control ops
raise its `EngineDeadError`), `step_timeline` (rank 0's per-step phases, recorded by the core's
pipeline and the executor), `transfers` (host <-> GPU copies that never wait for the GPU: the
pipeline and the sampler) and `thinking` (Qwen3's think block by token ids: intake, the grammar
gate and its grammars, the sampler's think budget, `LLM.chat` and the API process's chat
parsing).

A leaf: nothing here imports another package of `tp_engine`, so every package may import it.
Importing this package loads nothing but its docstring.
"""
