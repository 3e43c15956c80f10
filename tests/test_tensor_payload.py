"""`tp_engine.features.weights_and_sleep.tensor_payload`: SGLang's serialized named tensors are read, and nothing else is.

Payloads are made with SGLang's own serializer (`MultiprocessingSerializer` from the sglang wheel,
`tests.sglang_helper`) and its `FlattenedTensorBucket` (slime's load format), read in another
process (as rank 0 reads what a trainer process shares); anything that names a global other than
torch's rebuild functions is refused before it runs. Also: a route offered only behind a flag
names the flag in its 404.
"""

from __future__ import annotations

import ast
import base64
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing

from tests.server_harness import REPO_ROOT
from tests.sglang_helper import flattened_payload, sglang_serialize
from tp_engine.features.weights_and_sleep.tensor_payload import (
    TensorPayloadError,
    decode_named_tensors,
)


@pytest.fixture
def file_system_sharing():
    """CPU tensors shared by file name, which an unrelated process can open (the default
    "file_descriptor" strategy hands fds over a socket to the sender's children only)."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


def read_elsewhere(payload: str, load_format: str | None = None) -> list:
    """Decode in a fresh process; [(name, dtype, values)]."""
    code = (
        "import sys; from tp_engine.features.weights_and_sleep.tensor_payload import decode_named_tensors as d\n"
        f"out = d(sys.stdin.read(), {load_format!r})\n"
        "print(repr([(n, str(t.dtype), t.float().tolist()) for n, t in out]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, text=True,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout)


def test_named_pairs_from_another_process(file_system_sharing):
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    payload = sglang_serialize([("w", w), ("b", b)])
    assert read_elsewhere(payload) == [
        ("w", "torch.float32", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]),
        ("b", "torch.bfloat16", [0.5, -1.0]),
    ]


def test_flattened_bucket_as_slime_sends_it(file_system_sharing):
    named = [
        ("a", torch.arange(4, dtype=torch.float32)),
        ("c", torch.ones(2, 2, dtype=torch.float16)),
    ]
    payload = flattened_payload(named)
    out = read_elsewhere(payload, "flattened_bucket")
    assert out == [
        ("a", "torch.float32", [0.0, 1.0, 2.0, 3.0]),
        ("c", "torch.float16", [[1.0, 1.0], [1.0, 1.0]]),
    ]


class _Runs:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize(
    "payload",
    [
        [("x", _Runs(os.system, "touch /tmp/tp-engine-pwned"))],
        [("x", _Runs(eval, "1 + 1"))],
        _Runs(os.system, "true"),
    ],
    ids=["os.system", "eval", "bare"],
)
def test_anything_but_torch_rebuilds_is_refused(payload, tmp_path):
    raw = pickle.dumps(payload)
    with pytest.raises(TensorPayloadError, match="not a torch tensor rebuild function"):
        decode_named_tensors(base64.b64encode(raw).decode())
    assert not Path("/tmp/tp-engine-pwned").exists()


def test_torch_load_and_fd_passing_are_refused():
    # A plain pickle of a tensor rebuilds through torch.load (unrestricted): refused.
    with pytest.raises(TensorPayloadError, match=r"torch\._utils\._rebuild_tensor_v2"):
        decode_named_tensors(pickle.dumps([("w", torch.ones(2))]))
    # The default sharing strategy passes a file descriptor through the sender's socket.
    from multiprocessing.reduction import ForkingPickler

    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("w", torch.ones(2))])
    with pytest.raises(TensorPayloadError, match=r"rebuild_storage_fd"):
        decode_named_tensors(buf.getvalue())


def test_malformed_payloads_are_refused(file_system_sharing):
    for payload, fmt, match in [
        ("not base64!", None, "base64"),
        (base64.b64encode(b"\x80\x04junk").decode(), None, "cannot be read"),
        (sglang_serialize({"w": torch.ones(2)}), None, "pairs"),
        (sglang_serialize([("w", torch.ones(2))]), "flattened_bucket", "flattened bucket"),
        (sglang_serialize([("w", torch.ones(2))]), "safetensors", "load_format"),
    ]:
        with pytest.raises(TensorPayloadError, match=match):
            decode_named_tensors(payload, fmt)


def test_a_flagged_route_names_its_flag_in_the_404():
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from tp_engine.server.api.http_errors import install_handlers

    app = FastAPI()
    install_handlers(app)
    client = TestClient(app)
    for path, flag in [("/sleep", "--enable-sleep-mode"),
                       ("/update_weights_from_disk", "--enable-weight-updates"),
                       ("/update_weights_from_tensor", "--enable-weight-updates-from-tensor"),
                       ("/v1/load_lora_adapter", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")]:  # fmt: skip
        r = client.post(path)
        assert r.status_code == 404 and flag in r.json()["error"]["message"], r.json()
    assert client.post("/nowhere").json()["error"]["message"] == "no route POST /nowhere"
