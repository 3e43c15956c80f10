"""`launch/serve.py --help` and the flags vLLM users expect: every flag explains itself and
shows its default, the environment variables are listed, and `--chat-template` / `--tokenizer`
check what they are given before anything starts."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from tests.server_harness import REPO_ROOT
from tp_engine.server.args import build_parser, engine_config, server_args

ENVIRONMENT = ("TP_ENGINE_API_KEY", "TP_ENGINE_CACHE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and a.help is not argparse.SUPPRESS and a.dest != "help"
    ]


def test_every_flag_has_help_and_shows_its_default(monkeypatch):
    monkeypatch.setenv("TP_ENGINE_API_KEY", "sk-secret-from-env")
    parser = build_parser()
    formatter = parser._get_formatter()
    missing = [a.option_strings[0] for a in flags(parser) if not (a.help or "").strip()]
    assert missing == []
    for action in flags(parser):
        shown = formatter._get_help_string(action) or ""
        assert "default" in shown.lower(), (action.option_strings[0], shown)
    text = parser.format_help()
    assert "sk-secret-from-env" not in text  # a key read from the environment is not shown
    for name in ENVIRONMENT:
        assert name in text.split("environment variables:")[1], name


def test_chat_template_from_a_file_or_inline(tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for value in (str(path), template):
        args = build_parser().parse_args(["--chat-template", value])
        assert server_args(args).chat_template == template
    assert server_args(build_parser().parse_args([])).chat_template is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("missing/template.jinja", "looks like a file path"),
        ("{% for m in messages %}", "does not parse"),
    ],
)
def test_bad_chat_templates_fail_the_start(value, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--chat-template", value])
    assert message in capsys.readouterr().err


def test_tokenizer_is_a_directory(tmp_path):
    from tp_engine.testing import build_tokenizer

    build_tokenizer(tmp_path / "tok").save_pretrained(tmp_path / "tok")
    args = build_parser().parse_args(["--tokenizer", str(tmp_path / "tok")])
    assert engine_config(args, 1).tokenizer == str(tmp_path / "tok")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tokenizer", str(tmp_path)])


@pytest.mark.parametrize("script", ["launch/generate.py", "launch/bench.py", "launch/serve.py"])
def test_each_script_explains_every_flag(script):
    """launch/generate.py and launch/bench.py declare engine flags too: same rule, read from
    the `--help` a user sees (each option's entry holds its help and its default)."""
    out = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    options = out.stdout.split("options:")[1].split("environment variables:")[0]
    entries = re.split(r"\n(?=  -)", options)
    entries = [e for e in entries if e.lstrip().startswith("-") and not e.lstrip().startswith("-h")]
    assert len(entries) > 10
    for entry in entries:
        assert "default" in entry.lower(), entry
    if script == "launch/serve.py":
        assert "--chat-template" in options and "--tokenizer" in options
    # Every script offers the engine's whole flag table (`tp_engine.config.flags`).
    from tp_engine.config.flags import ENGINE_FLAGS

    assert [flag.option for flag in ENGINE_FLAGS if flag.option not in out.stdout] == []
