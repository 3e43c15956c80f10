"""Pipeline parallelism across two "nodes" (`tests/multinode_harness.py`: torchrun on each, node
1 in its own namespaces), the layout PP is for: TP 2 inside each node, PP 2 across them
(`--tensor-parallel-size 2 --pipeline-parallel-size 2` over 2 x 2 ranks). Node 0 holds stage 0
(ranks 0, 1: the embedding and layers [0, 2)), node 1 stage 1 (ranks 2, 3: layer 2, the norm and
the LM head); greedy completions equal transformers' with prefix hits, chunked prefill and
preemption; node 1's ranks take their plans over TCP, and the hidden states, the residual and
the logits cross between the nodes by gloo send/recv. Then (torchrun form) node 0 is lost:
node 1's ranks exit on their own.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from shm_ipc.liveness import ProcessWatch
from tests.multinode_harness import (
    documented_commands,
    free_port,
    node_env,
    runnable,
    start_node0,
    start_node1,
    unshare_available,
)
from tests.tp_cases import hf_greedy

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
             intermediate_size=64, tie_word_embeddings=True, seed=9,
             max_position_embeddings=256)  # fmt: skip
MAX_TOKENS = 8
SERVE_ARGS = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--block-size", "8",
              "--num-kv-blocks", "14", "--max-num-batched-tokens", "16", "--max-num-seqs", "6",
              "--enable-prefix-caching", "--served-model-name", "pp"]  # fmt: skip


@pytest.mark.parametrize("form", ["torchrun", "tp-engine"])
def test_tp2_pp2_across_two_nodes_equals_transformers(tmp_path, form: str) -> None:
    """docs/multi-node.md's two commands of `form` (torchrun's, or `tp-engine serve --nnodes`,
    whose node processes spawn their ranks), with TP 2 x PP 2 in place of the page's TP 4."""
    why_not = unshare_available()
    if why_not is not None:
        pytest.fail(f"the multi-node tests need namespaces (run as root): {why_not}")
    from tp_engine.testing import build_random_qwen3

    checkpoint = build_random_qwen3(tmp_path / "ckpt", **SHAPE)
    rng = random.Random(4)
    shared = [rng.randrange(3, 600) for _ in range(16)]  # two full blocks shared by all
    batch = [shared + [rng.randrange(3, 600) for _ in range(rng.randrange(4, 24))]
             for _ in range(6)]  # fmt: skip
    expected = hf_greedy(checkpoint, batch, MAX_TOKENS)
    port = free_port()
    env = node_env(TP_ENGINE_NODE_TIMEOUT_S="5")
    env.pop("TP_ENGINE_PP_LAYER_PARTITION", None)
    extra = ["--model", str(checkpoint), "--port", "0", *SERVE_ARGS]  # the last -tp wins
    doc0, doc1 = documented_commands()[form]
    node1 = start_node1(runnable(doc1, port, extra), checkpoint, tmp_path / "node1.log", env)
    node0 = start_node0(runnable(doc0, port, extra), tmp_path / "node0.log", env)
    try:
        node0.wait_ready()
        body = {"model": "pp", "prompt": batch, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        preempted_before = node0.metric("vllm:num_preemptions_total")
        for attempt in ("first", "cached"):
            status, resp = node0.post("/v1/completions", body)
            assert status == 200, resp
            assert [c["token_ids"] for c in resp["choices"]] == expected, attempt
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert node0.metric("vllm:num_preemptions_total") > preempted_before
        log0, log1 = node0.log(), node1.log()
        for rank in (0, 1):
            assert (
                f"rank {rank}: pipeline stage 0 of 2 (TP rank {rank} of 2), layers [0, 2)" in log0
            )
        for rank in (2, 3):
            assert (
                f"rank {rank}: pipeline stage 1 of 2 (TP rank {rank - 2} of 2), layers [2, 3)"
                in log1
            )
            assert f"rank {rank} (node 1): plans from rank 0 over tcp://" in log1
        assert "Traceback" not in log0 + log1
        if form == "torchrun":
            # Node 0 lost, every process of it at once: node 1's ranks (stage 1) exit.
            node1.watches = [ProcessWatch(pid) for pid in node1.descendants()]
            for pid in node0.descendants() | {node0.proc.pid}:
                os.kill(pid, signal.SIGKILL)
            lost_at = time.monotonic()
            assert node1.proc.wait(timeout=60) != 0
            took = time.monotonic() - lost_at
            assert took < 30, f"node 1 took {took:.1f} s to exit"
            assert "rank 0 (node 0) is gone" in node1.log(), node1.log_tail()
            assert len(node1.watches) >= 3 and node1.alive_pids() == set()
    finally:
        node0.stop()
        node1.stop()
