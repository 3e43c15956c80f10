"""OpenAI-compatible server entry point (not built yet; `launch/generate.py` runs the engine)."""

from __future__ import annotations

import sys


def main() -> int:
    print(
        "tp-engine: the OpenAI-compatible HTTP server is not built yet. The engine itself is: "
        "`python launch/generate.py [--model DIR] [--tensor-parallel-size N]` runs it offline "
        "(also under torchrun).",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
