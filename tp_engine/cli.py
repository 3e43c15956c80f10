"""`tp-engine serve [MODEL] [flags]`: the OpenAI-compatible server, started as `vllm serve` starts
vLLM's. The same server as `launch/serve.py` and `python -m tp_engine.server`; MODEL is
`--model` (the demo model when neither is given), every flag is the server's
(`tp-engine serve --help`). Under torchrun, every rank runs the same command."""

from __future__ import annotations

import sys

USAGE = """usage: tp-engine serve [MODEL] [flags]

  serve   the OpenAI-compatible server (tp-engine serve --help lists its flags)
"""


def serve_argv(args: list[str]) -> list[str]:
    """The server's own arguments for `tp-engine serve ARGS`: a leading positional MODEL becomes
    `--model MODEL` (vLLM's form); naming the model both ways is refused."""
    if not args or args[0].startswith("-"):
        return list(args)
    model, rest = args[0], args[1:]
    if any(a == "--model" or a.startswith("--model=") for a in rest):
        raise SystemExit(f"tp-engine serve: the model is given twice ({model!r} and --model)")
    return ["--model", model, *rest]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "serve":
        print(f"tp-engine: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    from tp_engine.server.rank0.main import main as serve

    return serve(serve_argv(rest))


if __name__ == "__main__":
    raise SystemExit(main())
