"""The commands of the README and of every page under `docs/`, run as written on a fresh
checkout: every fenced `bash` and `python` block of each page is either run against the demo
servers of the README's "Try it on the demo model" section, or carries a reason why it cannot
run here (a real checkpoint, several GPUs, minutes of benchmarking), so a new command without
either, on any page, fails this test.

How a block is run, as a reader would run it from the repository root:
- the pages are read in order, the README first, then `docs/*.md` by name;
- the README's Try-it section's `python launch/serve.py ...` lines are the servers: "demo" (no
  `--model`), "embed" and "rerank" (by their served names); each is started once, in a scratch
  directory (where `launch/demo_assets.py` writes `./demo-assets`), with `--port 0` added;
- a block naming a served model (`tp-engine-demo`, a demo adapter, `Qwen3-Embedding-0.6B`,
  `Qwen3-Reranker-0.6B`) runs against that server, port 8000 replaced by the real one; `curl`
  gets `--fail-with-body -sS`, so an HTTP error fails the command;
- `python` means this interpreter (the README's readers have activated the venv).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server_harness import REPO_ROOT, Server

README = REPO_ROOT / "README.md"
# Every page whose commands are run or excused: the front door first (its Try-it section writes
# the demo assets the other pages' commands use), then each feature's page.
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
TRY_IT = "Try it on the demo model"
# Which server a block runs against, by the model names it uses (first match wins).
SERVER_OF = [
    (re.compile(r"Qwen3-Embedding-0\.6B"), "embed"),
    (re.compile(r"Qwen3-Reranker-0\.6B"), "rerank"),
    (re.compile(r"tp-engine-demo|\"model\": \"(sql|chat|math)\"|/v1/models|lora_adapter"), "demo"),
]
# Why a command cannot run here, by what it contains (first match wins). A walkthrough needing its
# own checkpoint is skipped whole (its later commands depend on its first); other bash blocks
# are judged command by command, so the demo commands beside a GPU one still run.
WALKTHROUGH = (
    re.compile(r"\bckpt\b|/adapters/"),
    "needs a real checkpoint, adapters or a trainer (`ckpt`, `/adapters/...`); the Try-it "
    "section runs the same walkthrough on the demo model",
)
REASONS = [
    (re.compile(r"/path/to/|/models/"), "needs a real checkpoint (a path to fill in)"),
    (re.compile(r"pip install"), "installs packages: CI's fresh environment does it"),
    (re.compile(r"-m pytest"), "the test suite itself"),
    (
        re.compile(r"launch/(bench|bench_serving|bench_control_plane|bench_hot_path|plot)\.py"),
        "a benchmark: minutes of CPU (tests/test_bench.py runs small ones)",
    ),
    (
        re.compile(r"--nnodes"),
        "one of several nodes: tests/test_multinode.py runs docs/multi-node.md's commands, the "
        "second node in its own namespaces",
    ),
    (
        re.compile(r"--disaggregation-mode|--pd-disaggregation"),
        "a prefill or decode server, or the router in PD mode: tests/test_pd_router.py runs "
        "docs/disaggregation.md's commands",
    ),
    (
        re.compile(r"--data-parallel-size"),
        "replicas behind sglang-router: minutes; tests/test_data_parallel.py runs them",
    ),
    (
        re.compile(r"^python launch/serve\.py(\s|$)", re.M),
        "a server: the Try-it section starts the demo servers the quick commands run against",
    ),
]


@dataclass
class Block:
    lang: str
    code: str
    section: str  # the "## " heading it is under
    page: Path  # the file it is in

    @property
    def commands(self) -> list[str]:
        """A bash block's commands: continued lines joined, quotes spanning lines kept."""
        if self.lang != "bash":
            return [self.code]
        out: list[str] = []
        pending = ""
        for line in self.code.splitlines():
            if not pending and not line.strip():
                continue
            pending = f"{pending}\n{line}" if pending else line
            if pending.endswith("\\"):
                continue
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if words:  # a comment line alone is no command to run
                out.append(pending)
            pending = ""
        assert not pending, f"unterminated command in {self.page.name}: {pending}"
        return out


def page_blocks(page: Path) -> list[Block]:
    """A page's fenced `bash` and `python` blocks, in order, each with its "## " section."""
    blocks, section = [], ""
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
    text = page.read_text()
    pos = 0
    for match in fence.finditer(text):
        for heading in re.findall(r"^## (.+)$", text[pos : match.start()], re.M):
            section = heading
        pos = match.end()
        if match.group(1) in ("bash", "python"):
            blocks.append(Block(match.group(1), match.group(2), section, page))
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def reason_for(text: str) -> str | None:
    return next((why for pattern, why in REASONS if pattern.search(text)), None)


def server_for(code: str) -> str | None:
    return next((name for pattern, name in SERVER_OF if pattern.search(code)), None)


def on_port(text: str, port: int | None) -> str:
    if port is None:
        return text
    return re.sub(r"(127\.0\.0\.1|localhost):8000", f"127.0.0.1:{port}", text)


def as_here(command: str, port: int | None) -> str:
    """A shell command with `python` as this interpreter, curl failing on an HTTP error, the
    real port."""
    command = re.sub(r"(^|\s)python(\s)", rf"\g<1>{sys.executable}\g<2>", command)
    command = re.sub(r"(^|\s)curl(\s)", r"\1curl --fail-with-body -sS\2", command)
    return on_port(command, port)


def run_block(block: Block, cwd: Path, port: int | None) -> None:
    if block.lang == "python":
        script = cwd / "snippet.py"
        script.write_text(on_port(block.code, port))
        commands = [f"{sys.executable} {script}"]
    else:
        commands = [as_here(c, port) for c in block.commands]
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, (
            f"{command}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
        )


def plan() -> tuple[dict[str, str], list[tuple[str | None, Block]], list[tuple[str, str]]]:
    """(server name -> its serve line, what runs (a python block or one bash command) with
    its server, what does not run with its reason)."""
    servers: dict[str, str] = {}
    to_run: list[tuple[str | None, Block]] = []
    skipped: list[tuple[str, str]] = []
    for block in all_blocks():
        if block.page == README and block.section == TRY_IT:
            serve = [c for c in block.commands if "launch/serve.py" in c]
            if serve:
                assert len(serve) == len(block.commands) == 1, block.code
                name = server_for(serve[0]) or ("demo" if "--model" not in serve[0] else None)
                assert name is not None and name not in servers, serve[0]
                servers[name] = serve[0]
            else:
                to_run.append((server_for(block.code), block))
            continue
        if WALKTHROUGH[0].search(block.code):
            skipped.append((block.code, WALKTHROUGH[1]))
            continue
        units = (
            [block]
            if block.lang == "python"
            else [Block("bash", c, block.section, block.page) for c in block.commands]
        )
        for unit in units:
            why = reason_for(unit.code)
            if why is None:
                to_run.append((server_for(unit.code), unit))
            else:
                skipped.append((unit.code, why))
    return servers, to_run, skipped


def test_every_command_of_every_page_is_planned():
    """Each page's every command is a demo server, runs, or says why not (without running)."""
    servers, to_run, skipped = plan()
    assert set(servers) == {"demo", "embed", "rerank"}
    # Each server is asked by some block, and every block runs somewhere or says why not.
    assert {name for name, _ in to_run if name} == set(servers)
    local = [b for name, b in to_run if name is None]
    assert "python launch/demo_assets.py" in local[0].code  # first: the assets the servers use
    planned = [*servers.values(), *(b.code for _, b in to_run), *(code for code, _ in skipped)]
    missing = [
        (page.name, command)
        for page in PAGES
        for block in page_blocks(page)
        for command in block.commands
        if not any(command in code for code in planned)
    ]
    assert missing == []
    pages_run = {b.page for _, b in to_run}
    assert README in pages_run and len(pages_run) > 1  # the docs' demo commands run too


@pytest.mark.slow
def test_every_command_of_every_page_runs_or_says_why_not(tmp_path):
    servers, to_run, skipped = plan()
    for code, why in skipped:
        print(f"not run ({why}):\n{code}")
    (tmp_path / "launch").symlink_to(REPO_ROOT / "launch")
    local = [b for name, b in to_run if name is None]
    for block in local:
        run_block(block, tmp_path, None)
    for name, serve_line in servers.items():
        line = as_here(serve_line, None).replace("\\\n", " ")
        log = tmp_path / f"{name}.log"
        cmd = ["bash", "-c", f"cd {tmp_path} && exec env {line} --port 0"]
        server = Server(cmd, dict(os.environ), log)
        try:
            server.wait_ready()
            for block in (b for n, b in to_run if n == name):
                run_block(block, tmp_path, server.port)
        finally:
            server.stop()
        assert "Traceback" not in server.log(), server.log_tail()
