"""The parallel-layout limit (`benchmarks/parallel_limits.py`) on cases worked out by hand, and
its worked example (`benchmarks/multi_node_limits.py`) for Qwen3-235B-A22B on 2 x 8 H100."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.limits import ModelShape, Peaks
from benchmarks.multi_node_limits import QWEN3_235B_A22B_CONFIG, main
from benchmarks.parallel_limits import (
    IB_NDR400,
    NVLINK4_H100,
    Hardware,
    Layout,
    Link,
    Schedule,
    StageTime,
    StepLimit,
    Work,
    bubble_fraction,
    gather_to_first_s,
    in_flight_idle_fraction,
    kv_heads_per_rank,
    kv_replication,
    rank_memory,
    ring_allreduce_s,
    send_s,
    stage_layers,
    stage_time,
    step_limit,
)

QWEN3_235B = ModelShape.from_hf_config(QWEN3_235B_A22B_CONFIG)

# A dense toy whose counts fit on paper: per layer attention 8 (4 + 2*2) 2 + 4*2*8 = 192, norms
# 2*8 + 2*2 = 20, MLP 3*8*16 = 384 (596 in all); embedding and head 10*8 = 80 each.
TOY = ModelShape(
    hidden_size=8,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    intermediate_size=16,
    vocab_size=10,
    tie_word_embeddings=False,
)
# Rates of 1000 so that a time in seconds is the count / 1000.
SLOW = Hardware(Peaks(1000.0, 1000.0, "test"), 1e6, "test")


def test_kv_heads_are_split_then_replicated():
    assert [kv_heads_per_rank(QWEN3_235B, tp) for tp in (1, 2, 4, 8, 16)] == [4, 2, 1, 1, 1]
    assert [kv_replication(QWEN3_235B, tp) for tp in (1, 2, 4, 8, 16)] == [1, 1, 1, 2, 4]
    with pytest.raises(ValueError, match="multiple of 4 KV heads"):
        kv_heads_per_rank(QWEN3_235B, 6)
    with pytest.raises(ValueError, match="does not divide 4 KV heads"):
        kv_heads_per_rank(ModelShape(**{**TOY.__dict__, "num_kv_heads": 4}), 3)


def test_kv_bytes_per_token_per_rank_of_qwen3_235b():
    # 2 (K and V) x layers x 1 KV head x 128 x 2 bytes.
    assert rank_memory(QWEN3_235B, Layout(16), 0).kv_bytes_per_token == 2 * 94 * 128 * 2
    assert rank_memory(QWEN3_235B, Layout(8, 2), 1).kv_bytes_per_token == 2 * 47 * 128 * 2
    assert rank_memory(QWEN3_235B, Layout(4), 0).kv_bytes_per_token == 2 * 94 * 128 * 2
    assert rank_memory(QWEN3_235B, Layout(2), 0).kv_bytes_per_token == 2 * 94 * 2 * 128 * 2


def test_one_rank_holds_every_weight_the_offline_model_counts():
    for shape in (TOY, QWEN3_235B):
        assert rank_memory(shape, Layout(1), 0).weight_bytes == 2 * shape.weight_params
    assert rank_memory(TOY, Layout(1), 0).weight_bytes == 2 * (4 * 596 + 80 + 80 + 8)


def test_two_stages_halve_the_layers_and_part_the_embedding_from_the_head():
    one = rank_memory(TOY, Layout(1), 0)
    first, last = (rank_memory(TOY, Layout(1, 2), s) for s in (0, 1))
    assert (first.layers, last.layers) == (2, 2)
    assert first.weight_bytes == 2 * (2 * 596 + 80)  # the embedding
    assert last.weight_bytes == 2 * (2 * 596 + 80 + 8)  # the head and the final norm
    assert first.weight_bytes + last.weight_bytes == one.weight_bytes
    assert first.kv_bytes_per_token == last.kv_bytes_per_token == one.kv_bytes_per_token / 2
    # Qwen3-235B: the decoder layers' share of a rank halves exactly from PP 1 to PP 2.
    table = 151936 * 4096 / 8 * 2
    pp1 = rank_memory(QWEN3_235B, Layout(8), 0).weight_bytes - 2 * table - 2 * 4096
    pp2 = rank_memory(QWEN3_235B, Layout(8, 2), 0).weight_bytes - table
    assert pp2 == pytest.approx(pp1 / 2, rel=1e-12)


def test_a_tied_head_is_stored_once_on_one_stage_and_twice_on_two():
    tied = ModelShape(**{**TOY.__dict__, "tie_word_embeddings": True})
    assert rank_memory(tied, Layout(1), 0).weight_bytes == 2 * tied.weight_params
    two = sum(rank_memory(tied, Layout(1, 2), s).weight_bytes for s in (0, 1))
    assert two == 2 * tied.weight_params + 2 * 80


def test_experts_sliced_or_whole_take_the_same_bytes():
    tp = rank_memory(QWEN3_235B, Layout(8), 0)
    ep = rank_memory(QWEN3_235B, Layout(8, expert_parallel=True), 0)
    assert tp.weight_bytes == ep.weight_bytes
    # Per layer: attention 4096 (8 + 2) 128 + 8 128 4096, norms, router 128 x 4096, and 1/8 of
    # 128 experts of 3 x 4096 x 1536.
    layer = (
        4096 * 10 * 128 + 8 * 128 * 4096 + 2 * 4096 + 2 * 128 + 128 * 4096 + 16 * 3 * 4096 * 1536
    )
    assert tp.weight_bytes == 2 * (94 * layer + 2 * 151936 * 4096 / 8 + 4096)
    hundred = ModelShape(**{**QWEN3_235B.__dict__, "num_experts": 100})
    with pytest.raises(ValueError, match="does not divide 100"):
        rank_memory(hundred, Layout(8, expert_parallel=True), 0)
    assert rank_memory(hundred, Layout(8), 0).fits  # sliced: 1536 / 8


def test_kv_room_and_whether_the_model_fits():
    m = rank_memory(TOY, Layout(1), 0, SLOW, memory_utilization=0.5, reserved_bytes=1000)
    assert m.kv_budget_bytes == 0.5e6 - 5104 - 1000
    assert m.max_kv_tokens == (0.5e6 - 5104 - 1000) // 64  # 2 x 4 layers x 2 heads x 2 x 2 B
    small = rank_memory(TOY, Layout(1), 0, Hardware(SLOW.peaks, 5000, "tiny"))
    assert not small.fits and small.max_kv_tokens == 0
    # Qwen3-235B on one 8 x 80 GB node: 470 GB of weights fit, with 13 GB per rank left.
    one_node = rank_memory(QWEN3_235B, Layout(8), 0)
    assert one_node.fits and 12e9 < one_node.kv_budget_bytes < 14e9
    assert not rank_memory(QWEN3_235B, Layout(4), 0).fits


def test_ring_allreduce_and_send_formulas():
    link = Link("toy", 1000.0, 0.5, "test")
    assert ring_allreduce_s(1000, 4, link) == 0.5 + 2 * 3 / 4 * 1000 / 1000  # 2.0 s
    assert ring_allreduce_s(1000, 2, link) == 0.5 + 1.0
    assert ring_allreduce_s(1000, 1, link) == 0.0
    assert send_s(1000, link) == 1.5


def test_infiniband_only_when_the_tp_group_spans_nodes():
    assert Layout(16).tp_spans_nodes and Layout(16).tp_link.name == IB_NDR400.name
    assert Layout(16).tp_link.bytes_per_s == 50e9
    for layout in (Layout(8), Layout(8, 2), Layout(4, 4), Layout(1, 16)):
        assert not layout.tp_spans_nodes and layout.tp_link == NVLINK4_H100
    # Stage boundaries: TP 8 x PP 2 crosses the nodes; TP 2 x PP 8 only between ranks 6 and 8.
    assert Layout(8, 2).boundary_link(0) == IB_NDR400
    assert [Layout(2, 8).boundary_link(s) == IB_NDR400 for s in range(7)] == [
        False, False, False, True, False, False, False,
    ]  # fmt: skip
    assert Layout(4, 2).boundary_link(0) == NVLINK4_H100  # both stages on node 0
    with pytest.raises(ValueError, match="no next stage"):
        Layout(8, 2).boundary_link(1)
    with pytest.raises(ValueError, match="neither divides nor is a multiple"):
        Layout(12)
    # Several NICs widen a cross-node ring, never past NVLink.
    assert Layout(16, inter_node_nics=4).tp_link.bytes_per_s == 200e9
    assert Layout(16, inter_node_nics=16).tp_link.bytes_per_s == 450e9


def test_logits_gather_takes_the_far_node_over_infiniband():
    # TP 16 on 2 x 8: rank 0 receives 7/16 of it over NVLink and 8/16 over IB, at once.
    size = 16e6
    want = IB_NDR400.latency_s + max(7 / 16 * size / 450e9, 8 / 16 * size / 50e9)
    assert gather_to_first_s(size, Layout(16)) == pytest.approx(want, rel=1e-12)
    assert gather_to_first_s(size, Layout(8)) == pytest.approx(
        NVLINK4_H100.latency_s + 7 / 8 * size / 450e9, rel=1e-12
    )
    assert gather_to_first_s(size, Layout(1)) == 0.0


def test_stage_time_of_a_decode_token_by_hand():
    t = stage_time(TOY, Layout(1), 0, Work.decode(1, 3), SLOW)
    # 2 FLOPs x 4 layers x 576 linear weights, 4 x 4 layers x 4 heads x 2 x 3 keys, 2 x 80 head.
    assert t.flops == 2 * 4 * 576 + 4 * 4 * 4 * 2 * 3 + 2 * 80
    # Weights 4 x 596 + head 80 + final norm 8 + one embedding row 8, in bf16; KV 64 B a token,
    # 3 read and 1 written.
    assert t.bytes == 2 * (4 * 596 + 80 + 8 + 8) + 4 * 64
    assert t.memory_s == t.bytes / 1000 and t.compute_s == t.flops / 1000
    assert t.time_s == max(t.flops, t.bytes) / 1000  # TP 1, PP 1: no communication
    assert t.comm_s == 0.0


def test_stage_time_counts_two_allreduces_per_layer_and_the_embeddings():
    link = Link("toy", 1e3, 0.25, "test")
    layout = Layout(2, 2, intra_node=link, inter_node=link)
    first, last = (stage_time(TOY, layout, s, Work.decode(3, 5), SLOW) for s in (0, 1))
    one = ring_allreduce_s(3 * 8 * 2, 2, link)  # 3 tokens x hidden 8 x 2 bytes
    assert first.allreduce_s == pytest.approx((2 * 2 + 1) * one)
    assert last.allreduce_s == pytest.approx(2 * 2 * one)
    assert first.send_s == send_s(2 * 3 * 8 * 2, link) and last.send_s == 0.0
    assert first.gather_s == 0.0
    assert last.gather_s == pytest.approx(link.latency_s + 1 / 2 * 3 * 10 * 2 / 1e3)


def test_decode_reads_only_the_experts_its_tokens_reach():
    layout = Layout(8)
    one, full = (stage_time(QWEN3_235B, layout, 0, Work.decode(b, 1)) for b in (1, 4096))
    expert = 3 * 4096 * 1536 / 8 * 2  # one expert's bytes on one rank
    assert one.bytes < full.bytes
    # Batch 1: 8 experts a layer; batch 4096: all 128 (to 1e-12), KV of 4095 more tokens.
    kv = 2 * 94 * 128 * 2
    diff = full.bytes - one.bytes
    want = 94 * 120 * expert + 2 * 4095 * kv + 4095 * 4096 / 8 * 2
    assert diff == pytest.approx(want, rel=1e-9)


def test_bubble_fractions():
    assert bubble_fraction(2, 1) == 0.5
    assert bubble_fraction(4, 4) == 3 / 7
    assert bubble_fraction(1, 5) == 0.0
    assert in_flight_idle_fraction(2, 1) == 0.5
    assert in_flight_idle_fraction(4, 2) == 0.5
    assert in_flight_idle_fraction(2, 2) == in_flight_idle_fraction(2, 3) == 0.0
    with pytest.raises(ValueError):
        bubble_fraction(2, 0)


def _stage(seconds: float) -> StageTime:
    return StageTime(0, 0.0, 0.0, 0.0, seconds, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 6])
def test_balanced_pipeline_step_and_idle(p: int, m: int):
    stages = tuple(_stage(0.1) for _ in range(p))
    flushed = StepLimit(Layout(1, p), stages, m, Schedule.FLUSHED, 8.0 * m)
    assert flushed.step_s == pytest.approx((m + p - 1) * 0.1)
    assert flushed.idle_fraction == pytest.approx(bubble_fraction(p, m))
    in_flight = StepLimit(Layout(1, p), stages, m, Schedule.IN_FLIGHT, 8.0 * m)
    assert in_flight.step_s == pytest.approx(max(m, p) * 0.1)
    assert in_flight.idle_fraction == pytest.approx(in_flight_idle_fraction(p, m))
    assert in_flight.balanced_tokens_per_s == pytest.approx(8.0 / 0.1)
    if m == 1:  # one batch in flight: 1/P of every stage busy
        assert in_flight.tokens_per_s == pytest.approx(in_flight.balanced_tokens_per_s / p)


def test_an_unbalanced_pipeline_waits_on_its_slowest_stage():
    stages = (_stage(0.1), _stage(0.3))
    assert StepLimit(Layout(1, 2), stages, 1, Schedule.IN_FLIGHT, 1.0).step_s == pytest.approx(0.4)
    assert StepLimit(Layout(1, 2), stages, 2, Schedule.IN_FLIGHT, 2.0).step_s == pytest.approx(0.6)
    assert StepLimit(Layout(1, 2), stages, 3, Schedule.FLUSHED, 3.0).step_s == pytest.approx(1.0)


def test_stage_layers_split():
    assert stage_layers(94, 2) == [47, 47]
    assert stage_layers(95, 2) == [48, 47]
    assert stage_layers(10, 4) == [2, 3, 3, 2]
    assert sum(stage_layers(94, 3)) == 94
    with pytest.raises(ValueError):
        stage_layers(2, 3)


def test_step_limit_of_qwen3_235b_on_two_nodes():
    pp = step_limit(QWEN3_235B, Layout(8, 2), Work.decode(64, 2048))
    one_node = step_limit(QWEN3_235B, Layout(8), Work.decode(64, 2048))
    # PP 2 with one batch in flight does the one node's work stage by stage, plus one send.
    assert pp.step_s == pytest.approx(one_node.step_s, rel=0.02)
    assert pp.idle_fraction == pytest.approx(0.5, abs=0.01)
    tp16 = step_limit(QWEN3_235B, Layout(16), Work.decode(1, 2048))
    # 189 all-reduces over IB, each at least its latency.
    assert tp16.stages[0].allreduce_s >= 189 * IB_NDR400.latency_s
    assert math.isclose(tp16.comm_share, tp16.stages[0].comm_s / tp16.stages[0].time_s)


def test_worked_example_command(tmp_path, capsys):
    out = tmp_path / "limits.json"
    assert main(["--batches", "1", "256", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| TP8 x PP2 (2 nodes) | 1 | 47 |" in printed
    result = json.loads(out.read_text())
    layouts = result["layouts"]
    assert set(layouts) == {"TP16 (2 nodes)", "TP8 x PP2 (2 nodes)", "TP8 (1 node)"}
    assert layouts["TP16 (2 nodes)"]["kv_replication"] == 4
    assert layouts["TP8 (1 node)"]["fits"]
    # One node holds 64 x 2048 tokens of KV, not 256 x 2048.
    fits = {d["batch"]: d["kv_fits"] for d in layouts["TP8 (1 node)"]["decode"]}
    assert fits == {1: True, 256: False}
    pp = layouts["TP8 x PP2 (2 nodes)"]
    assert pp["kv_capacity_tokens"] > 1.9 * layouts["TP16 (2 nodes)"]["kv_capacity_tokens"]
    assert [d["micro_batches"] for d in pp["decode"]] == [1, 1, 2]
    assert result["command"].endswith("--output-json " + str(out))
