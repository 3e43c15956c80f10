"""The OpenAI-compatible HTTP server (`launch/serve.py`).

    HTTP client ─► API process (api_server: FastAPI/uvicorn; prompts, detokenizer, metrics)
                      │ ZeroMQ ipc, msgpack (messages): Add / Abort ▼   Outputs / Drain / Dead ▲
    rank 0 ───────► engine_loop: LLMEngine.step() one at a time ─► ranks 1..N-1 (worker loop)

Modules, by process:

- rank 0: `launcher` (what each rank runs, start-up and clean-up), `args` (vLLM's flags),
  `engine_loop` (the loop, graceful drain), `watchdog`;
- between them: `messages` (the typed msgpack messages), `ipc` (the sockets and their private
  directory);
- API process: `api_server` (app, routes, process entry), `engine_client` (routing rank 0's
  messages to requests), `serving` (completions and chat), `streaming` (their SSE chunks),
  `generation` (one request's engine sequences), `prompts` (validation, prompts and
  SamplingParams), `detokenizer` (incremental text and stop strings), `logprobs` (their JSON
  shapes), `protocol` (request bodies), `responses` (response bodies, disconnects), `errors`
  (OpenAI's error envelope), `metrics` (Prometheus, vLLM's names), `chat_parsers` (which
  reasoning and tool-call parsers run, and their marker tokens), `chat_output` (a chat choice
  split into reasoning, content and tool calls by token ids), `tool_calls` (tools and
  tool_choice, Hermes blocks to OpenAI tool calls, streamed arguments), `constraints` (the
  request's structured-output constraint, from whichever field carried it), `forced_tool_calls`
  (tool_choice "required" or named: the schema built from the tools, the answer as calls).

Nothing here is imported by `tp_engine` itself: the offline API never needs FastAPI.
"""
