"""`tp-engine serve [MODEL] [flags]`: vLLM's command form for the same server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tp_engine import cli


def test_positional_model_becomes_the_model_flag() -> None:
    assert cli.serve_argv(["/ckpt/Qwen3-8B", "--port", "9000"]) == [
        "--model",
        "/ckpt/Qwen3-8B",
        "--port",
        "9000",
    ]
    assert cli.serve_argv(["--model", "/ckpt", "--port", "1"]) == [
        "--model",
        "/ckpt",
        "--port",
        "1",
    ]
    assert cli.serve_argv([]) == []  # the demo model
    with pytest.raises(SystemExit, match="given twice"):
        cli.serve_argv(["/a", "--model", "/b"])
    with pytest.raises(SystemExit, match="given twice"):
        cli.serve_argv(["/a", "--model=/b"])


def test_serve_reaches_the_server_with_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr("tp_engine.server.rank0.main.main", lambda argv: seen.append(argv) or 7)
    assert cli.main(["serve", "/ckpt", "--tensor-parallel-size", "2"]) == 7
    assert seen == [["--model", "/ckpt", "--tensor-parallel-size", "2"]]


def test_unknown_command_and_bare_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate"]) == 2
    assert "unknown command 'generate'" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert "tp-engine serve [MODEL]" in capsys.readouterr().out


def test_installed_console_script_runs_the_servers_help() -> None:
    # The script pip writes beside the interpreter from [project.scripts].
    script = Path(sys.executable).parent / "tp-engine"
    assert script.exists(), f"{script}: reinstall the package (pip install -e .) for the script"
    out = subprocess.run(
        [str(script), "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--tensor-parallel-size", "--served-model-name", "--api-key"):
        assert flag in out.stdout
