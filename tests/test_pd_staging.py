"""Prefill/decode disaggregation through a host staging pool, where a rank's device cache cannot
be registered for transfers (`rank_worker.kv.pd_staging`, rank 0's `disagg.staging`): the
slots rank 0 hands out, the copy staging → cache that a step plan carries and the scheduler
waits for, a prefill's writes gathered through a pool smaller than the order (Mooncake for
real, into another process), and an agent that stages when told to."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
import zmq

from rank_worker.kv.copies import HostBlockCopier
from rank_worker.kv.kv_transfer import KVRegion, KVTransferEngine
from rank_worker.kv.pd_agent import KVAgent
from rank_worker.kv.pd_staging import HostStaging, StagingCopier, staging_reason, staging_slots
from shm_ipc import wire
from shm_ipc.block_copies import (
    DEVICE_TIER,
    HOST_TIER,
    STAGING_TIER,
    BlockCopy,
    decode_block_copies,
    encode_block_copies,
)
from shm_ipc.pd_wire import RankHello, decode_pd
from tests.control_plane import EOS, Stepper, expected_output, make_scheduler, make_seq
from tests.test_kv_transfer import HOST, block_choice, make_cache, receiver
from tp_engine.core.remote_prompts import RemotePrompts
from tp_engine.server.rank0.disagg.staging import StagingSlots


def ids(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


# -- rank 0's slots ----------------------------------------------------------------------------


def test_slots_prefer_a_run_and_wait_when_short():
    slots = StagingSlots(8)
    a = slots.take(3)
    b = slots.take(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    slots.give([1])
    # Free: 1, 5, 6, 7: a run of three is 5..7, not the lowest three.
    assert slots.take(3) == [5, 6, 7]
    assert slots.take(2) is None and slots.num_free == 1  # nothing taken
    slots.give([0, 3, 6])
    # Free: 0, 1, 3, 6: no run of three, so the lowest three.
    assert slots.take(3) == [0, 1, 3]
    slots.give([3])
    with pytest.raises(ValueError, match="twice"):
        slots.give([3])


def test_slots_of_a_copy_are_free_once_its_step_is_applied():
    slots = StagingSlots(4)
    taken = slots.take(4)
    assert taken is not None
    slots.give_after(7, taken[:2])
    slots.give_after(9, taken[2:])
    slots.steps_applied(6)
    assert slots.num_free == 0
    slots.steps_applied(8)
    assert slots.num_free == 2
    slots.steps_applied(9)
    assert slots.num_free == 4


# -- the copy in a step plan -------------------------------------------------------------------


def test_a_staging_copy_travels_in_the_plan_and_its_request_waits_for_it():
    sched = make_scheduler(num_blocks=16, block_size=4)
    remote = RemotePrompts(lambda: sched, [EOS])
    prompt = list(range(1, 11))
    expected = expected_output(prompt, 3, 64)
    seq = make_seq("a", prompt, max_tokens=3)
    remote.hold(seq)
    remote.reserve()
    table = list(seq.block_table)
    copy = BlockCopy(STAGING_TIER, DEVICE_TIER, ids([5, 6, 7]), ids(table))
    sched.block_manager.copy_in(copy)
    assert sched.block_manager.loading(seq)
    remote.arrive("a", expected[0], None)
    st = Stepper(sched)  # asserts a step that computes a loading sequence waits for its copies
    out, _ = st.step()
    assert [s.seq_id for s in out.scheduled] == ["a"] and out.step.reads_copies_up
    while sched.has_unfinished():
        st.step()
    assert seq.output_token_ids == expected
    values, _ = decode_block_copies(encode_block_copies([copy], True))
    assert values[0].src == STAGING_TIER and values[0].dst_blocks.tolist() == table


def kv_storage(num_blocks: int, layers: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, num_blocks, 4, 2, 8), generator=g)


def pairs(storage: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(storage.shape[0])]


def test_the_staging_copier_writes_only_the_named_blocks_and_hands_the_rest_on():
    storage = kv_storage(12)
    staging = HostStaging(storage, 4)
    staging.pool.copy_(torch.randn(staging.pool.shape))
    host = HostBlockCopier(pairs(storage), 3)
    host.host.copy_(torch.randn(host.host.shape))
    copier = StagingCopier(staging, pairs(storage), host)
    before = storage.clone()
    copies = [
        BlockCopy(HOST_TIER, DEVICE_TIER, ids([1]), ids([2])),
        BlockCopy(STAGING_TIER, DEVICE_TIER, ids([3, 0]), ids([5, 9])),
        BlockCopy(STAGING_TIER, DEVICE_TIER, ids([1, 2]), ids([7, 3])),  # a run of slots
    ]
    copier.before_forward(copies, reads_copies_up=True)
    copier.after_forward()
    expected = before.clone()
    expected[:, :, [5, 9, 7, 3]] = staging.pool[:, :, [3, 0, 1, 2]]
    expected[:, :, 2] = host.host[1]  # the host tier's pool: [blocks, layers, 2, ...]
    assert torch.equal(storage, expected)
    # A slot past the pool, or a copy into another tier: refused before anything is copied.
    with pytest.raises(ValueError, match=r"staging slot ids \[4\] outside \[0, 4\)"):
        copier.before_forward([BlockCopy(STAGING_TIER, DEVICE_TIER, ids([4]), ids([0]))], True)
    with pytest.raises(ValueError, match="into the device cache"):
        copier.before_forward([BlockCopy(STAGING_TIER, HOST_TIER, ids([0]), ids([0]))], True)
    assert torch.equal(storage, expected)
    alone = StagingCopier(staging, pairs(storage), None)
    with pytest.raises(ValueError, match="no host KV tier"):
        alone.before_forward(copies, True)


# -- the prefill's writes through a small pool, into another process --------------------------


@pytest.mark.slow
def test_a_prefill_writes_through_a_pool_smaller_than_its_order_exactly():
    seed = 11
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, seed), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the receiver did not start"
        peer, wires = parent.recv()
        src_cache = make_cache("small", "src", seed)
        src_blocks, dst_blocks = block_choice("small", seed)
        staging = HostStaging(src_cache, 5)  # 22 blocks in five gathers
        with KVTransferEngine(HOST) as engine:
            engine.register(staging.pool)  # only the pool: the cache is never registered
            dst = KVRegion.from_wire(wires["small"])
            moved = staging.send(engine, peer, dst, src_blocks, dst_blocks)
            assert moved == len(src_blocks) * 2 * dst.num_layers * dst.block_bytes
            parent.send({"small": (src_blocks, dst_blocks)})
            assert parent.poll(60), "the receiver did not report"
            assert parent.recv() == {}
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


# -- an agent ----------------------------------------------------------------------------------


def test_when_a_rank_stages():
    cpu = torch.zeros(1, 2, 3, 4, 1, 1)
    assert staging_reason("auto", cpu) is None  # host memory registers as it is
    assert staging_reason("off", cpu) is None
    assert staging_reason("on", cpu) == "--disaggregation-host-staging on"
    with pytest.raises(ValueError, match="host staging is one of"):
        staging_reason("always", cpu)
    storage = torch.zeros(2, 2, 10, 4, 1, 1)
    assert staging_slots(2 * 17, storage) == 9  # 34 tokens in blocks of 4
    assert staging_slots(1000, storage) == 10  # never more than the cache
    assert staging_slots(0, storage) == 1


def test_a_decode_agent_told_to_stage_registers_and_announces_its_pool():
    storage = kv_storage(10)
    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port(f"tcp://{HOST}")
    settings = {"mode": "decode", "host": HOST, "endpoint": f"tcp://{HOST}:{port}",
                "ib_device": "", "host_staging": "on"}  # fmt: skip
    agent = KVAgent(storage, 0, settings, staging_tokens=24)
    try:
        assert pull.poll(10_000)
        hello = decode_pd(pull.recv(), "the agent")
        assert isinstance(hello, RankHello) and hello.staged
        assert agent.staging is not None
        assert hello.region.base_ptr == agent.staging.pool.data_ptr() != storage.data_ptr()
        assert hello.region.num_blocks == 6  # 24 tokens in blocks of 4
        assert hello.region.block_bytes == KVRegion.of_cache(storage).block_bytes

        class Runner:
            kv_caches = pairs(storage)
            host_pool = None

        assert isinstance(agent.plan_copier(Runner()), StagingCopier)
    finally:
        agent.close()
        pull.close(linger=0)
    assert wire.encode(hello)  # the hello is one of the wire's messages


@pytest.mark.gpu
def test_staging_beside_a_cuda_cache_gathers_and_copies_in_exactly():
    """The GPU's path: the pool pinned in host memory, the gather on the device then across
    the bus, the copy in across the bus then scattered on the device."""
    from rank_worker.kv.pd_staging import _cpu_wheel_installed

    cache = kv_storage(12).cuda()
    staging = HostStaging(cache, 4)
    assert staging.pool.is_pinned() and not staging.pool.is_cuda
    staging.gather([7, 2, 9])
    assert torch.equal(staging.pool[:, :, :3], cache[:, :, [7, 2, 9]].cpu())
    received = torch.zeros_like(cache)
    copier = StagingCopier(staging, pairs(received), None)
    copies = [
        BlockCopy(STAGING_TIER, DEVICE_TIER, ids([0, 1, 2]), ids([4, 0, 11])),  # a run
        BlockCopy(STAGING_TIER, DEVICE_TIER, ids([2, 0]), ids([5, 6])),
    ]
    copier.before_forward(copies, reads_copies_up=True)
    torch.cuda.synchronize()
    expected = torch.zeros_like(cache)
    expected[:, :, [4, 0, 11]] = cache[:, :, [7, 2, 9]]
    expected[:, :, [5, 6]] = cache[:, :, [9, 7]]
    assert torch.equal(received, expected)
    # `auto` stages a CUDA cache exactly when Mooncake's CPU wheel is the one installed.
    assert (staging_reason("auto", cache) is not None) == _cpu_wheel_installed()
