"""The API process holds no model code: no torch, triton, kernels or rank_worker module.

A fresh interpreter starts up as the API process does (`tp_engine.server.api.app.start_up`:
pipes, Hello, the tokenizer, the chat parsers, the app with every optional route of its Hello,
uvicorn's socket) while this test plays rank 0; then it sends a request with an output
constraint, which rank 0 (this test) refuses, so that the constraint's path runs there too. Its
`sys.modules` must hold none of those packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tp_engine.core.outputs import EngineStats
from tp_engine.server.ipc import EnginePipes, RunDir
from tp_engine.server.messages import AddRequest, EngineOutputs, Exit, Hello, Rejected

ROOT = Path(__file__).resolve().parents[1]
BANNED = ("torch", "triton", "kernels", "rank_worker")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

CHILD = (
    f"SCHEMA, BANNED = {SCHEMA!r}, {BANNED!r}\n"
    + """
import json, sys
from fastapi.testclient import TestClient
from tp_engine.server.api import app

ready = app.start_up(app.parse_args(sys.argv[1:]))
assert ready is not None, "start-up failed"
ready.sock.close()
if "generate" in ready.client.hello.supported_tasks:
    with TestClient(ready.app, base_url="http://localhost") as http:
        body = {"model": "m", "prompt": "Hi", "max_tokens": 4, "guided_json": SCHEMA}
        resp = http.post("/v1/completions", json=body)
        print("STATUS " + json.dumps([resp.status_code, resp.json()]), flush=True)
print("LOADED " + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in BANNED)))
"""
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tp_engine.testing.tokenizers import build_qwen3_tokenizer

    path = tmp_path_factory.mktemp("qwen3-tokenizer")
    build_qwen3_tokenizer(path)
    return path


def hello(tokenizer_dir: Path, tasks: list[str]) -> Hello:
    return Hello(
        model_dir=str(tokenizer_dir), served_model_names=["m"], max_model_len=256,
        vocab_size=151_936, generation_defaults={}, api_key=None, tensor_parallel_size=1,
        reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True,
        enable_weight_updates=True, enable_sleep_mode=True,
        enable_weight_updates_from_tensor=True, enable_lora=True, supported_tasks=tasks,
        pooled_size=64, class_labels=[],
    )  # fmt: skip


def start_api_process(hello_msg: Hello) -> tuple[list[str], list[AddRequest]]:
    """Run the child as the API process, answering as rank 0; its output lines and the
    requests it sent."""
    run = RunDir.create()
    pipes = EnginePipes(run)
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    args = ["--run-dir", run.path, "--parent-pid", str(os.getpid()), "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], env=env, stdout=subprocess.PIPE, text=True
    )
    adds: list[AddRequest] = []
    try:
        assert pipes.send_once_connected(hello_msg, lambda: proc.poll() is None, timeout_s=120)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if not pipes.poll(0.05):
                continue
            msg = pipes.recv_nowait()
            if isinstance(msg, AddRequest):  # rank 0's answer to an invalid constraint
                adds.append(msg)
                refusal = Rejected(
                    msg.request_id, 400, "guided_json is not valid: no", "guided_json"
                )
                pipes.send(EngineOutputs([], [refusal], [], EngineStats(0, 0, 0.0, 0, 0, 0)))
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            pipes.send(Exit(1))
            proc.kill()
            proc.wait()
        pipes.close()
        run.remove()
    assert proc.returncode == 0, out
    return out.splitlines(), adds


def line(lines: list[str], tag: str):
    found = [ln[len(tag) + 1 :] for ln in lines if ln.startswith(tag + " ")]
    assert found, lines
    return json.loads(found[-1])


@pytest.mark.parametrize("tasks", [["generate"], ["embed", "score"]], ids=["generate", "embed"])
def test_the_api_process_loads_no_model_code(tokenizer_dir, tasks):
    lines, adds = start_api_process(hello(tokenizer_dir, tasks))
    assert line(lines, "LOADED") == []
    if tasks == ["generate"]:
        # The constraint went to rank 0 to be parsed, and its 400 came back naming the field.
        assert [a.constraint_checks for a in adds] == [{"guided_json": {"json": SCHEMA}}]
        status, body = line(lines, "STATUS")
        assert status == 400 and body["error"]["param"] == "guided_json", body
        assert body["error"]["message"] == "guided_json is not valid: no"


def test_the_tokenizer_is_the_one_auto_tokenizer_loads(tokenizer_dir, tmp_path):
    """The API process loads the checkpoint's declared class itself (AutoTokenizer imports
    torch): the same tokenizer, for Qwen3's and the test kit's small BPE."""
    from transformers import AutoTokenizer

    from tp_engine.server.api.tokenizer_load import declared_class, load_tokenizer
    from tp_engine.testing import build_tokenizer

    build_tokenizer(tmp_path)
    text = "Hello <think>x</think> world <|im_end|>"
    for path in (str(tokenizer_dir), str(tmp_path)):
        assert declared_class(path) is not None
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert type(ours) is type(auto)
        assert ours.get_vocab() == auto.get_vocab()
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.chat_template == auto.chat_template
        assert (ours.eos_token, ours.pad_token) == (auto.eos_token, auto.pad_token)
    # No declared class: AutoTokenizer decides, as before.
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": None}))
    assert declared_class(str(tmp_path)) is None
