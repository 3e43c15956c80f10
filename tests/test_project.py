"""Project-level facts the rest of the suite relies on."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_kernels_is_this_projects_package_not_hugging_faces():
    # Hugging Face publishes an unrelated library also called `kernels`; if it were installed
    # and shadowed ours, kernel tests would silently test the wrong code.
    import kernels

    assert Path(kernels.__file__).resolve().parent == REPO_ROOT / "kernels"


def test_control_plane_imports_no_cuda_or_process_groups():
    import subprocess
    import sys

    code = (
        "import sys; import tp_engine.scheduler, tp_engine.plan_builder;"
        "bad = [m for m in sys.modules if m.startswith(('torch', 'triton', 'rank_worker'))];"
        "print(','.join(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
