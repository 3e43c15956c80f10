"""The test harness's own checks: a leak check scoped to a run's processes sees that run's
/dev/shm segments and no other run's (a second pytest worker's segments are not our leaks)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from tests.server_harness import shm_entries


def test_shm_entries_keeps_only_the_given_processes_segments():
    mine, other = os.getpid(), os.getppid()
    tag = secrets.token_hex(4)
    names = [f"tpe-{mine}-{tag}", f"tpe-{other}-{tag}", f"tpe-{mine}0-{tag}"]
    paths = [Path("/dev/shm", name) for name in names]
    try:
        for path in paths:
            path.touch()
        assert set(names) <= shm_entries()
        # `tpe-<mine>0-...` is another pid's (the prefix ends at the dash), not ours.
        assert shm_entries([mine]) & set(names) == {names[0]}
        assert shm_entries([mine, other]) & set(names) == set(names[:2])
        assert not shm_entries([]) & set(names)
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
