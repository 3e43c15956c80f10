"""The API process: FastAPI + uvicorn (`app`), started by rank 0 as
`python -m tp_engine.server.api.app`. Every request is checked here (`guards`, `protocol`,
`prompts`, `constraints`, with its CPU work off the event loop: `request_work`), sent to rank 0
as a message, and its tokens come back as deltas that this process detokenizes, parses (Qwen3's
reasoning and tool calls) and shapes as OpenAI's, vLLM's or SGLang's responses."""
