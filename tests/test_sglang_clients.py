"""RL frameworks' own client code against a live TP 2 server (`--enable-weight-updates
--enable-sleep-mode`), unchanged:

- SGLang's trainer helper `init_custom_process_group` (from the sglang wheel, `sglang_helper`)
  as the trainer: the group forms with our ranks, and its broadcasts update the weights;
- slime's `SGLangEngine` requests (624b824, `slime/backends/sglang_utils/sglang_engine.py`),
  method, path and body as it sends them: pause → GET /flush_cache → update → continue, and
  release → resume ["weights"] → update → resume ["kv_cache", "cuda_graph"]; outputs equal
  transformers on the new weights;
- slime's colocated update: /update_weights_from_tensor with SGLang's serialized flattened
  bucket (one payload per TP rank), read through the restricted unpickler; `os.system` refused;
- a bogus group (nobody listening) is a 400 within its timeout while completions are served;
- SGLang's native /generate equals /v1/completions (greedy ids, logprobs), batch and streaming;
- the admin routes' methods: GET where SGLang takes GET, and a 404 that names the flag.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_harness import Server, parse_sse, torchrun_cmd
from tp_engine.server.rank0.replicas import free_port

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 33, 2, 9]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    os.environ.setdefault("TP_ENGINE_CACHE", str(tmp_path_factory.mktemp("cache")))
    from tp_engine.demo import demo_checkpoint_dir

    env = dict(os.environ)
    env.pop("TP_ENGINE_FAULT", None)
    log = tmp_path_factory.mktemp("log") / "server.log"
    args = ["--model", str(demo_checkpoint_dir()), "--port", "0", "--tensor-parallel-size", "2",
            "--enable-weight-updates", "--enable-sleep-mode", "--enable-weight-updates-from-tensor",
            "--max-model-len", "256",
            "--num-kv-blocks", "128"]  # fmt: skip
    srv = Server([*torchrun_cmd(2), *args], env, log).wait_ready()
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log(), srv.log_tail()


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory):
    from tp_engine.demo import DEMO_SHAPE
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(tmp_path_factory.mktemp("b"), **{**DEMO_SHAPE, "seed": 11})


def call(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    status, raw = server.request(method, path, data, headers)
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode()


def greedy(server: Server, prompt: list[int] = PROMPT, n: int = 6) -> list[int]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    status, resp = server.post("/v1/completions", body)
    assert status == 200, resp
    return resp["choices"][0]["token_ids"]


def sglang_trainer(port: int, world_size: int, group_name: str, checkpoint: str, q: Any) -> None:
    """The trainer, as slime's and SGLang's run it: SGLang's own helper forms the group, then
    `dist.broadcast(t, 0, group=pg)` sends each tensor (slime's call)."""
    try:
        import torch.distributed as dist
        from safetensors.torch import load_file

        from tests.sglang_helper import sglang_common

        helper = sglang_common().init_custom_process_group
        pg = helper(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size,
            rank=0, group_name=group_name,
        )  # fmt: skip
        q.put(("ready",))
        tensors = load_file(checkpoint + "/model.safetensors")
        for t in tensors.values():
            dist.broadcast(t.float().contiguous(), 0, group=pg)
        q.put(("sent",))
    except BaseException as exc:  # reported to the test
        q.put(("error", repr(exc)))


def slime_update_from_distributed(server: Server, checkpoint_b, group: str) -> None:
    """slime's UpdateWeightFromDistributed round: SGLang's helper on the trainer side, slime's
    engine requests (`connect_rollout_engines_from_distributed`, `update_weights`)."""
    import multiprocessing as mp

    from safetensors.torch import load_file

    tensors = load_file(str(checkpoint_b) + "/model.safetensors")
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    trainer = ctx.Process(target=sglang_trainer, args=(port, 3, group, str(checkpoint_b), q))
    trainer.start()
    try:
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 3, "group_name": group, "backend": "gloo"}  # fmt: skip
        status, reply = call(server, "POST", "/init_weights_update_group", init)
        assert (status, reply["success"]) == (200, True), reply
        assert q.get(timeout=60) == ("ready",)
        assert call(server, "POST", "/pause_generation", {}) == (
            200, {"message": "Generation paused successfully.", "status": "ok"},
        )  # fmt: skip
        assert call(server, "GET", "/flush_cache")[0] == 200  # slime flushes with GET
        update = {"names": list(tensors), "dtypes": ["float32"] * len(tensors),
                  "shapes": [list(t.shape) for t in tensors.values()], "group_name": group,
                  "flush_cache": False, "weight_version": "1"}  # fmt: skip
        status, reply = call(server, "POST", "/update_weights_from_distributed", update)
        assert (status, reply["success"]) == (200, True), reply
        assert q.get(timeout=60) == ("sent",)
        assert call(server, "POST", "/continue_generation", {})[0] == 200
        status, reply = call(server, "POST", "/destroy_weights_update_group", {"group_name": group})
        assert status == 200, reply
    finally:
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()


def test_sglang_helper_as_trainer_and_slime_round(server, checkpoint_b):
    from tests.tp_cases import hf_greedy

    slime_update_from_distributed(server, checkpoint_b, "slime-pp_0")
    assert greedy(server) == hf_greedy(checkpoint_b, [PROMPT], 6)[0]
    assert call(server, "GET", "/get_weight_version") == (200, {"weight_version": "1"})
    # The same group name again: the first one was left cleanly on every rank.
    slime_update_from_distributed(server, checkpoint_b, "slime-pp_0")


def test_slime_offload_onload_round(server, tmp_path):
    """slime's colocated round: release (flush with GET first) → resume ["weights"] → update
    from disk → resume ["kv_cache", "cuda_graph"]; then transformers' tokens on the new weights."""
    from tests.tp_cases import hf_greedy
    from tp_engine.demo import DEMO_SHAPE
    from tp_engine.testing import build_random_qwen3

    c = build_random_qwen3(tmp_path / "c", **{**DEMO_SHAPE, "seed": 23})
    assert call(server, "GET", "/flush_cache")[0] == 200
    status, reply = call(server, "POST", "/release_memory_occupation", {})
    assert (status, reply["success"]) == (200, True), reply
    status, reply = call(server, "POST", "/resume_memory_occupation", {"tags": ["weights"]})
    assert (status, reply["success"]) == (200, True), reply
    status, reply = call(server, "POST", "/update_weights_from_disk", {"model_path": str(c)})
    assert (status, reply["success"]) == (200, True), reply
    tags = {"tags": ["kv_cache", "cuda_graph"]}
    status, reply = call(server, "POST", "/resume_memory_occupation", tags)
    assert (status, reply["success"]) == (200, True), reply
    assert call(server, "GET", "/is_sleeping")[1] == {"is_sleeping": False}
    assert greedy(server) == hf_greedy(c, [PROMPT], 6)[0]
    status, info = call(server, "GET", "/get_server_info")
    assert status == 200 and info["enable_memory_saver"] is True


def test_slime_update_from_tensor(server, tmp_path):
    """slime's `update_weights_from_tensor` round (colocated): pause → GET /flush_cache → the
    flattened bucket of every tensor, one payload per engine rank → continue."""
    import torch.multiprocessing
    from safetensors.torch import load_file

    from tests.sglang_helper import flattened_payload, sglang_serialize
    from tests.tp_cases import hf_greedy
    from tp_engine.demo import DEMO_SHAPE
    from tp_engine.testing import build_random_qwen3

    d = build_random_qwen3(tmp_path / "d", **{**DEMO_SHAPE, "seed": 31})
    named = list(load_file(str(d) + "/model.safetensors").items())
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors, by file name
    try:
        payload = flattened_payload(named)
        assert call(server, "POST", "/pause_generation", {})[0] == 200
        assert call(server, "GET", "/flush_cache")[0] == 200
        body = {"serialized_named_tensors": [payload, payload], "load_format": "flattened_bucket",
                "weight_version": "7"}  # fmt: skip
        status, reply = call(server, "POST", "/update_weights_from_tensor", body)
        assert (status, reply["success"]) == (200, True), reply
        assert call(server, "POST", "/continue_generation", {})[0] == 200
        assert greedy(server) == hf_greedy(d, [PROMPT], 6)[0]
        assert call(server, "GET", "/get_weight_version")[1] == {"weight_version": "7"}

        class Runs:
            def __reduce__(self):
                return os.system, ("touch /tmp/tp-engine-pwned-by-http",)

        evil = {"serialized_named_tensors": [sglang_serialize([("x", Runs())])]}
        status, reply = call(server, "POST", "/update_weights_from_tensor", evil)
        assert status == 400 and "posix.system" in reply["message"], reply
        assert not os.path.exists("/tmp/tp-engine-pwned-by-http")
        assert greedy(server) == hf_greedy(d, [PROMPT], 6)[0]
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


def test_bogus_group_is_a_400_within_its_timeout_while_serving(server):
    port = free_port("127.0.0.1")  # nobody listens there
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 3, "group_name": "bogus", "backend": "gloo", "timeout": 4}  # fmt: skip
    result: dict[str, Any] = {}

    def join() -> None:
        start = time.monotonic()
        result["reply"] = call(server, "POST", "/init_weights_update_group", body)
        result["took"] = time.monotonic() - start

    thread = threading.Thread(target=join)
    thread.start()
    time.sleep(0.5)
    served = time.monotonic()
    assert len(greedy(server, n=4)) == 4  # the engine serves while the join waits
    assert time.monotonic() - served < 3.5 and thread.is_alive()
    thread.join(30)
    status, reply = result["reply"]
    assert status == 400 and reply["success"] is False, reply
    assert "bogus" in reply["message"]
    assert 3.5 < result["took"] < 4 + 10, result
    # Nothing of it stays: the name is free again, and the engine still serves.
    status, reply = call(server, "POST", "/destroy_weights_update_group", {"group_name": "bogus"})
    assert status == 400 and "no weights update group" in reply["message"]


def test_generate_equals_completions(server):
    # slime's rollout payload (`slime/rollout/sglang_rollout.py`: GenerateState.sampling_params,
    # `generate`'s payload), greedy here so that it can be compared.
    slime_sp = {"temperature": 0.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 6, "stop": None,
                "stop_token_ids": None, "skip_special_tokens": True, "no_stop_trim": True,
                "spaces_between_special_tokens": False,
                "custom_params": {"return_top_p_token_ids": True}}  # fmt: skip
    status, out = call(server, "POST", "/generate",
                       {"input_ids": PROMPT, "sampling_params": {**slime_sp, "ignore_eos": True},
                        "return_logprob": True})  # fmt: skip
    assert status == 200, out
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "top_p": 0.9,
            "ignore_eos": True, "include_stop_str_in_output": True, "return_token_ids": True,
            "logprobs": 0}  # fmt: skip
    status, ref = server.post("/v1/completions", body)
    choice = ref["choices"][0]
    assert out["output_ids"] == choice["token_ids"] and out["text"] == choice["text"]
    lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-6)
    assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 6)
    assert isinstance(meta["weight_version"], str)

    # A batch of texts answers a list, each equal to its own completion.
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    texts = ["Hello there", "One two"]
    status, outs = call(server, "POST", "/generate", {"text": texts, "sampling_params": sp})
    assert status == 200 and len(outs) == 2
    for text, o in zip(texts, outs, strict=True):
        ref = server.post("/v1/completions", {**body, "prompt": text})[1]["choices"][0]
        assert o["output_ids"] == ref["token_ids"]

    # Streaming: the last event carries the whole output, then [DONE].
    status, raw = server.request(
        "POST", "/generate",
        json.dumps({"input_ids": PROMPT, "sampling_params": sp, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    events = parse_sse(raw)
    assert events[-1] == "[DONE]" and events[-2]["output_ids"] == out["output_ids"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_refusals_are_400s(server):
    for bad in ({"sampling_params": {"max_new_tokens": 2}},
                {"text": "a", "input_ids": [1], "sampling_params": {}},
                {"text": "a", "sampling_params": {"temperature": -1.0}},
                {"text": "a", "sampling_params": {"warp_speed": 3}}):  # fmt: skip
        status, reply = call(server, "POST", "/generate", bad)
        assert status == 400 and reply["error"]["message"], (bad, reply)
    assert len(greedy(server, n=2)) == 2


def test_generate_takes_sglangs_other_fields_at_their_defaults_and_refuses_the_rest(server):
    sp = {"max_new_tokens": 4, "temperature": 0.0}
    plain = call(server, "POST", "/generate", {"text": "Hello", "sampling_params": sp})
    assert plain[0] == 200, plain
    # What sglang-router's re-serialized body adds (tests/test_data_parallel.py sends one
    # through the real router): SGLang's defaults, and fields with no effect here.
    routed = {"text": "Hello", "sampling_params": sp, "model": None, "log_metrics": True,
              "return_hidden_states": False, "background": False, "no_logs": False,
              "return_bytes": False, "return_entropy": False, "return_text_in_logprobs": False,
              "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
              "lora_path": None, "priority": 3, "routing_key": "k"}  # fmt: skip
    status, out = call(server, "POST", "/generate", routed)
    assert status == 200, out
    assert out["output_ids"] == plain[1]["output_ids"]
    for field, value, says in (("return_hidden_states", True, "not supported"),
                               ("image_data", "x.png", "not supported"),
                               ("warp_drive", 1, "not a field of SGLang's")):  # fmt: skip
        status, reply = call(server, "POST", "/generate", {**routed, field: value})
        assert status == 400 and says in reply["error"]["message"], (field, reply)
        assert reply["error"]["message"].startswith(field)


def test_abort_request_by_rid(server):
    body = {"input_ids": PROMPT, "rid": "slow-1",
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0.0}}  # fmt: skip
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(r=call(server, "POST", "/generate", body))
    )
    thread.start()
    time.sleep(1.0)
    assert call(server, "POST", "/abort_request", {"rid": "slow-1"})[0] == 200
    thread.join(30)
    status, out = result["r"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out
    assert out["meta_info"]["completion_tokens"] < 200

    # slime's abort: {"abort_all": true} ends every /generate request, a batch's each prompt.
    batch = {**body, "input_ids": [PROMPT, PROMPT[:3]], "rid": ["b-1", "b-2"]}
    thread = threading.Thread(
        target=lambda: result.update(r=call(server, "POST", "/generate", batch))
    )
    thread.start()
    time.sleep(1.0)
    assert call(server, "POST", "/abort_request", {"abort_all": True})[0] == 200
    thread.join(30)
    status, outs = result["r"]
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["b-1", "b-2"], outs
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    status, loads = call(server, "GET", "/v1/loads?include=core")
    assert status == 200 and loads["loads"][0]["dp_rank"] == 0


def test_admin_methods_as_sglang_takes_them(server):
    status, values = call(server, "GET", "/get_weights_by_name?name=lm_head.weight&truncate_size=3")
    assert status == 200 and len(values) == 3
    assert call(server, "POST", "/get_weights_by_name", {"name": "lm_head.weight",
                                                         "truncate_size": 3}) == (200, values)  # fmt: skip
    assert call(server, "GET", "/pause?mode=keep")[0] == 200
    assert call(server, "GET", "/is_paused")[1] == {"is_paused": True}
    assert call(server, "POST", "/resume")[0] == 200
    status, reply = call(server, "POST", "/reset_prefix_cache")
    assert status == 200 and type(reply["num_dropped_blocks"]) is int, reply
    assert reply["fully_reset"] is True
    status, reply = call(server, "POST", "/resume_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "gpu" in reply["message"]


def test_sigterm_while_a_join_waits_stops_the_server(tmp_path):
    """A join that waits (nobody listening, a long timeout) on both ranks holds neither the loop
    nor the shutdown: SIGTERM stops the server within its shutdown timeout, nothing left."""
    import signal

    from tp_engine.demo import demo_checkpoint_dir

    env = dict(os.environ)
    env.pop("TP_ENGINE_FAULT", None)
    args = ["--model", str(demo_checkpoint_dir()), "--port", "0", "--tensor-parallel-size", "2",
            "--enable-weight-updates", "--max-model-len", "128", "--num-kv-blocks", "32",
            "--shutdown-timeout", "5"]  # fmt: skip
    srv = Server([*torchrun_cmd(2), *args], env, tmp_path / "server.log").wait_ready()
    try:
        body = {"master_address": "127.0.0.1", "master_port": free_port("127.0.0.1"), "rank_offset": 1,
                "world_size": 3, "group_name": "never", "timeout": 120}  # fmt: skip
        thread = threading.Thread(
            target=lambda: call(srv, "POST", "/init_weights_update_group", body), daemon=True
        )
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive()  # still waiting for a trainer that never comes
        start = time.monotonic()
        os.kill(srv.rank0_pid(), signal.SIGTERM)
        while srv.alive_pids() and time.monotonic() - start < 30:
            time.sleep(0.1)
        assert not srv.alive_pids(), srv.log_tail()
        assert time.monotonic() - start < 5 + 5, srv.log_tail()
        assert srv.proc.wait(timeout=5) == 0, srv.log_tail()
    finally:
        srv.stop()
    assert "Traceback" not in srv.log(), srv.log_tail()
