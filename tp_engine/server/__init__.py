"""The OpenAI-compatible HTTP server (`launch/serve.py`, `tp-engine serve`): two processes.

    HTTP client ─► API process (`api`: FastAPI/uvicorn; prompts, detokenizer, metrics)
                      │ ZeroMQ ipc, msgspec (`messages`): Add / Abort ▼   Outputs / Drain / Dead ▲
    rank 0 ───────► `rank0.engine_loop`: LLMEngine.step() one at a time ─► ranks 1..N-1

| package or module | what it is |
| --- | --- |
| `rank0/` | rank 0's process: start-up and clean-up of every process (`main`), the serving loop (`engine_loop`), the admin operations it runs between steps (`control_ops`), the watchdog, and `--data-parallel-size`'s replicas behind sglang-router (`replicas`, `router_process`) |
| `api/` | the API process (`app`: the FastAPI app and the process entry): the request guards, prompts and sampling parameters, completions and chat (`serving`, `streaming`, `generation`), Qwen3's reasoning and tool calls (`chat_output`, `chat_parsers`, `tool_calls`, `forced_tool_calls`), structured-output constraints, the pooling routes (`pooling_*`), the admin, LoRA, SGLang and router-facing routes, metrics and OpenAI's error envelope |
| `messages` | the typed messages between the two processes (msgspec Structs, `shm_ipc.wire`'s codec; never pickle) |
| `ipc` | the two ZeroMQ pipes and their private directory |
| `args` | the server's flags (the engine's come from `tp_engine.config.flags`) |

`api` never imports `rank0`; `rank0` starts the API process as `python -m
tp_engine.server.api.app` and imports from `api` only what its flags name (the request limits
and their checks in `guards`, the parsers' names in `chat_parsers`). Nothing in `tp_engine`
outside this package imports it: the offline API never needs FastAPI.
"""
