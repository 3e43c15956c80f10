"""OpenAI-compatible HTTP server for Qwen3 on N tensor-parallel ranks.

    torchrun --nproc-per-node 4 launch/serve.py --model /path/to/Qwen3-8B
    python launch/serve.py                                # demo model, one rank, port 8000
    python launch/serve.py --tensor-parallel-size 2       # this process + 1 worker process

Then, e.g.:

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tp-engine-demo", "prompt": "Hello", "max_tokens": 16}'

Flags use vLLM's names (`--help` lists them). SIGINT/SIGTERM to rank 0 (or Ctrl-C) drains
in-flight requests for `--shutdown-timeout` seconds, stops every process and exits 0. The
server itself lives in `tp_engine.server`.
"""

from __future__ import annotations

from tp_engine.server.rank0.main import main

if __name__ == "__main__":
    raise SystemExit(main())
