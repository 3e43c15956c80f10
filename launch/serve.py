"""OpenAI-compatible server entry point (not built yet)."""

from __future__ import annotations

import sys


def main() -> int:
    print(
        "tp-engine: the OpenAI-compatible server is not built yet; the control plane is. "
        "Run `python -m pytest -q` to exercise it.",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
