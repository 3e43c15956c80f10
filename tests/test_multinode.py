"""Tensor parallelism across two "nodes" (`tests/multinode_harness.py`: node 1 in its own
namespaces), launched with docs/multi-node.md's own commands: both forms (torchrun on each node,
and `tp-engine serve --nnodes --node-rank`) serve greedy completions equal to transformers at TP
4 over 2 x 2 ranks, dense with prefix hits (from the GPU pool and from the host tier), chunked
prefill and preemption, and MoE; the faults end cleanly: node 1 lost → node 0's server ends
naming its ranks and node; node 1 never there → node 0's start-up fails naming it (node 0 lost
→ node 1's ranks exit: tests/test_pp_multinode.py). The plan path is checked from the logs:
node 1's ranks get plans over TCP, node 0's rank 1 from the ring.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shm_ipc.liveness import ProcessWatch
from tests.moe_cases import MIN_ROUTER_MARGIN, MOE_CHECKPOINTS, load_hf_moe, router_margins
from tests.moe_cases import hf_greedy as moe_greedy
from tests.multinode_harness import (
    documented_commands,
    free_port,
    node_env,
    runnable,
    start_node0,
    start_node1,
    unshare_available,
)
from tests.server_harness import Server, shm_entries
from tests.tp_cases import hf_greedy

pytestmark = pytest.mark.slow

# Two KV heads over four ranks: each KV head is replicated on two ranks (node 0 holds one head
# on both of its ranks, node 1 the other).
SHAPE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
             intermediate_size=64, seed=7, max_position_embeddings=256)  # fmt: skip
MAX_TOKENS = 12
# Small KV pool and step budget: six prompts of 20-40 tokens over 18 blocks of 8 preempt, and
# every prompt is prefilled in chunks of at most 16 tokens; a host-memory KV tier below the
# pool (2 MB per rank).
SERVE_ARGS = ["--port", "0", "--block-size", "8", "--num-kv-blocks", "18",
              "--max-num-batched-tokens", "16", "--max-num-seqs", "6",
              "--enable-prefix-caching", "--served-model-name", "mn",
              "--enable-sleep-mode", "--kv-offloading-size", "0.002"]  # fmt: skip
NODE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    why_not = unshare_available()
    if why_not is not None:
        pytest.fail(f"the multi-node tests need namespaces (run as root): {why_not}")
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(tmp_path_factory.mktemp("mn") / "ckpt", **SHAPE)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    from tp_engine.testing import build_random_qwen3_moe

    shape = dict(MOE_CHECKPOINTS["moe_e6k2"], max_position_embeddings=256)
    return build_random_qwen3_moe(tmp_path_factory.mktemp("mn-moe") / "ckpt", **shape)


def start_cluster(
    checkpoint: Path,
    logs: Path,
    form: str = "torchrun",
    more_args: tuple[str, ...] = (),
    gpus: tuple[str, str] | None = None,
) -> tuple[Server, Server]:
    """docs/multi-node.md's two commands of `form`, on `checkpoint`, node 1 namespaced; `gpus`:
    each node's CUDA_VISIBLE_DEVICES (None: CPU)."""
    port = free_port()
    env = node_env(TP_ENGINE_NODE_TIMEOUT_S=str(NODE_TIMEOUT_S))
    env0, env1 = env, env
    if gpus is not None:
        env0, env1 = (dict(env, CUDA_VISIBLE_DEVICES=g) for g in gpus)
    extra = ["--model", str(checkpoint), *SERVE_ARGS, *more_args]
    doc0, doc1 = documented_commands()[form]
    node1 = start_node1(runnable(doc1, port, extra), checkpoint, logs / "node1.log", env1)
    node0 = start_node0(runnable(doc0, port, extra), logs / "node0.log", env0)
    try:
        node0.wait_ready()
    except BaseException:
        node0.stop()
        node1.stop()
        raise
    # Node 1's processes, watched by their host pids (its own pid namespace numbers them anew).
    node1.watches = [ProcessWatch(pid) for pid in node1.descendants()]
    return node0, node1


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    node0, node1 = start_cluster(checkpoint, tmp_path_factory.mktemp("logs"))
    yield node0, node1
    node0.stop()
    node1.stop()


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 600) for _ in range(16)]  # two full blocks shared by all
    return [shared + [rng.randrange(3, 600) for _ in range(rng.randrange(4, 24))]
            for _ in range(6)]  # fmt: skip


def complete(server: Server, batch: list[list[int]]) -> dict:
    body = {"model": "mn", "prompt": batch, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, resp = server.post("/v1/completions", body)
    assert status == 200, resp
    return resp


def test_tp4_across_two_nodes_equals_transformers_with_prefix_hits_chunks_and_preemption(
    cluster, checkpoint
):
    node0, node1 = cluster
    batch = prompts(seed=1)
    expected = hf_greedy(checkpoint, batch, MAX_TOKENS)
    preempted_before = node0.metric("vllm:num_preemptions_total")
    first = complete(node0, batch)
    assert [c["token_ids"] for c in first["choices"]] == expected
    assert node0.metric("vllm:num_preemptions_total") > preempted_before
    again = complete(node0, batch)  # the shared prefix and whole prompts are cached now
    assert [c["token_ids"] for c in again["choices"]] == expected
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Other prompts push the cached blocks down to the host tier; the same batch then comes back
    # from it: block copies, carried in the plans, on every rank of both nodes.
    host_hits = node0.metric("vllm:external_prefix_cache_hits_total")
    complete(node0, prompts(seed=9))
    third = complete(node0, batch)
    assert [c["token_ids"] for c in third["choices"]] == expected
    assert node0.metric("vllm:external_prefix_cache_hits_total") > host_hits
    # The path the plans took: node 1's ranks over TCP, node 0's rank 1 from the ring.
    log0, log1 = node0.log(), node1.log()
    assert "node 1 ready: ranks [2, 3] get plans over tcp://" in log0
    for rank in (2, 3):
        assert f"rank {rank} (node 1): plans from rank 0 over tcp://" in log1
    assert "rank 1 (node" not in log0 + log1  # rank 1 shares rank 0's node: the ring
    # Only node 0 serves HTTP.
    assert "Uvicorn running" in log0 and "Uvicorn running" not in log1
    assert log1.count("Traceback") == 0


@pytest.mark.multigpu
def test_tp4_across_two_nodes_over_nccl_equals_transformers(checkpoint, tmp_path):
    """The same across two namespaced nodes of one 4-GPU machine, two GPUs each, over NCCL."""
    import torch

    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs (2 per node), found {torch.cuda.device_count()}")
    node0, node1 = start_cluster(
        checkpoint, tmp_path, more_args=("--dist-backend", "nccl"), gpus=("0,1", "2,3")
    )
    try:
        batch = prompts(seed=5)
        expected = hf_greedy(checkpoint, batch, MAX_TOKENS)
        assert [c["token_ids"] for c in complete(node0, batch)["choices"]] == expected
    finally:
        node0.stop()
        node1.stop()


def test_control_calls_reach_the_other_node_sleep_and_wake(cluster, checkpoint):
    node0, _ = cluster
    batch = prompts(seed=4)[:2]
    expected = hf_greedy(checkpoint, batch, MAX_TOKENS)
    assert node0.request("POST", "/sleep?level=1")[0] == 200  # a control call on every rank
    status, body = node0.get("/is_sleeping")
    assert status == 200 and b"true" in body
    assert node0.request("POST", "/wake_up")[0] == 200
    assert [c["token_ids"] for c in complete(node0, batch)["choices"]] == expected


def test_moe_with_tp_engine_serve_then_node1_lost_ends_node0_naming_its_ranks(
    moe_checkpoint, tmp_path
):
    batch = prompts(seed=2)[:3]
    model = load_hf_moe(moe_checkpoint)
    expected = moe_greedy(model, batch, MAX_TOKENS)
    assert router_margins(model, [p + e for p, e in zip(batch, expected, strict=True)]) > (
        MIN_ROUTER_MARGIN
    )  # no near-tie between experts that float reordering could flip
    node0, node1 = start_cluster(moe_checkpoint, tmp_path, form="tp-engine")
    try:
        assert [c["token_ids"] for c in complete(node0, batch)["choices"]] == expected
        assert "Uvicorn running" not in node1.log()  # headless
        run_pids = node0.run_pids()
        lost_at = time.monotonic()
        os.kill(node1.proc.pid, signal.SIGKILL)  # unshare --kill-child: the whole node goes
        lost = "ranks 2 and 3 (node 1) died during an idle wait"
        deadline = time.monotonic() + 30
        while node0.proc.poll() is None and time.monotonic() < deadline:
            status, body = node0.get("/health")
            if status == 503:  # the engine is dead; the server lingers a moment, saying why
                assert lost in body.decode(), body
                break
            time.sleep(0.1)
        code = node0.proc.wait(timeout=60)
        took = time.monotonic() - lost_at
        assert code != 0
        log = node0.log()
        assert lost in log, node0.log_tail()
        assert took < 30, f"node 0 took {took:.1f} s to end"
        assert node0.alive_pids() == set(), "a node 0 process outlived the run"
        assert shm_entries(run_pids) == set()
        assert node1.proc.wait(timeout=30) != 0 and node1.alive_pids() == set()
    finally:
        node0.stop()
        node1.stop()


def test_a_node_that_never_joins_fails_node0_start_up_naming_it(checkpoint, tmp_path):
    doc0, _ = documented_commands()["tp-engine"]
    extra = ["--model", str(checkpoint), *SERVE_ARGS, "--node-join-timeout", "2"]
    port = free_port()
    node0 = start_node0(runnable(doc0, port, extra), tmp_path / "node0.log", node_env())
    try:
        assert node0.proc.wait(timeout=120) != 0
        assert "node 1 (ranks [2, 3]) did not join within 2 s" in node0.log(), node0.log_tail()
        assert ranks_meeting_at(port) == [], "node 0's spawned rank outlived its start-up"
    finally:
        node0.stop()


def ranks_meeting_at(port: int) -> list[int]:
    """Pids of the processes whose rendezvous is 127.0.0.1:`port` (spawned ranks carry it)."""
    marker = f"TP_ENGINE_STORE=tcp://127.0.0.1:{port}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker in Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found
