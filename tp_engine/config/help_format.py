"""`--help` that shows every flag's default: the one formatter of `launch/serve.py`,
`launch/generate.py` and `launch/bench.py` (no dependency beyond argparse, so the offline
scripts need no server packages)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, "(default: X)", unless its help already says in words what
    the default is (a None that means "the checkpoint's", or a value read from the
    environment, which must not be printed); keeps the description's and epilog's layout."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)
