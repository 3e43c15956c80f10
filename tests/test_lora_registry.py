"""Rank 0's adapter registry with a fake slot loader: slots, pins, LRU eviction, the admission
gate (no step carries more distinct adapters than slots), removal while in use, and the
prefix-cache tags of adapters (no cross-adapter hit, no stale hit after a reload)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.control_plane import Stepper, expected_output, make_scheduler, make_seq
from tp_engine.core.engine_states import Gate
from tp_engine.core.sequence import SequenceStatus
from tp_engine.features.lora.registry import AdapterRegistry, LoRAAdapterNotFoundError
from tp_engine.lora_request import LoRARequest


class FakeLoader:
    """Records the control calls; refuses paths named in `refuse`."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.refuse: set[str] = set()

    def load_slot(self, slot: int, lora_uid: int, path: str) -> None:
        if path in self.refuse:
            raise ValueError(f"refused {path}")
        self.calls.append(("load", slot, lora_uid, Path(path).name))

    def unload_slot(self, slot: int, lora_uid: int) -> None:
        self.calls.append(("unload", slot))


def adapter_dir(root: Path, name: str) -> str:
    path = root / name
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


@pytest.fixture
def adapters(tmp_path: Path) -> list[LoRARequest]:
    return [LoRARequest(n, i + 1, adapter_dir(tmp_path, n)) for i, n in enumerate("abcd")]


def registry_for(sched, max_loras: int = 2) -> tuple[AdapterRegistry, FakeLoader]:
    loader = FakeLoader()
    reg = AdapterRegistry(max_loras, loader, check_config=lambda path: None)
    reg.follow(sched.batch)
    sched.gate = Gate(admits=reg.admits)
    return reg, loader


def run(sched, reg: AdapterRegistry) -> list[set[int]]:
    """Step to completion, preparing slots between steps; returns each step's distinct slots
    as its plan reads them (checked against the rows' adapters when it was scheduled)."""
    per_step: list[set[int]] = []
    schedule = sched.schedule

    def schedule_and_check():
        step = schedule()
        slots = reg.adapter_slot[step.rows]
        for row, slot in zip(step.rows.tolist(), slots.tolist(), strict=True):
            seq = sched.batch.seqs[row]
            want = -1 if seq.adapter_id is None else reg.by_load_id[seq.adapter_id].slot
            assert slot == want, seq
        per_step.append(set(slots[slots >= 0].tolist()))
        return step

    sched.schedule = schedule_and_check
    stepper = Stepper(sched)
    while stepper.has_work():
        assert reg.prepare_slots(sched.waiting) == []
        stepper.step()
        reg.release_removed(sched.waiting)
    sched.schedule = schedule
    return per_step


def test_max_loras_bounds_every_step_and_all_finish(adapters):
    sched = make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    reg, loader = registry_for(sched, max_loras=2)
    seqs = []
    for i in range(8):  # a, b, c, d, a, b, c, d (+ base every other)
        seq = make_seq(f"s{i}", [i + 1, 2, 3, 4, 5], max_tokens=3)
        if i % 3:
            reg.register(adapters[i % 4]).attach(seq)
        sched.add(seq)
        seqs.append(seq)
    per_step = run(sched, reg)
    assert max(len(s) for s in per_step) == 2
    assert all(s.output_token_ids == expected_output(s.prompt_token_ids, 3, 64) for s in seqs)
    # Base requests passed the adapter requests that waited for a slot: admitted at step 0.
    assert all(seq.queue_time_s is not None for seq in seqs)
    loads = [c for c in loader.calls if c[0] == "load"]
    assert {c[3] for c in loads} == {"a", "b", "c", "d"} and len(loads) >= 4
    # Nothing pinned at the end; every slot reusable.
    assert all(a.num_running == 0 for a in reg.by_load_id.values())


def test_lru_eviction_skips_pinned_and_wanted_slots(adapters):
    sched = make_scheduler()
    reg, loader = registry_for(sched, max_loras=2)
    a, b, c = (reg.register(r) for r in adapters[:3])
    reg.preload(a)
    reg.preload(b)
    assert (a.slot, b.slot) == (0, 1)
    pinned = make_seq("p", [1, 2, 3], max_tokens=8)
    b.attach(pinned)
    sched.add(pinned)
    Stepper(sched).step()  # b pinned by a running sequence
    waiting = make_seq("w", [1, 2], max_tokens=1)
    c.attach(waiting)
    sched.add(waiting)
    reg.prepare_slots(sched.waiting)
    assert (a.slot, b.slot, c.slot) == (None, 1, 0)  # a (unpinned, least recent) made room
    assert loader.calls[-1] == ("load", 0, c.load_id, "c")
    d = reg.register(adapters[3])
    reg.preload(d)  # the least recent unpinned slot: c gets one again before admission
    assert d.slot == 0 and c.slot is None


def test_refused_load_ends_its_waiting_sequences_only(adapters):
    sched = make_scheduler()
    reg, loader = registry_for(sched)
    bad = reg.register(adapters[0])
    good = reg.register(adapters[1])
    loader.refuse.add(adapters[0].lora_path)
    s1, s2 = make_seq("1", [1, 2]), make_seq("2", [3, 4])
    bad.attach(s1)
    good.attach(s2)
    sched.add(s1)
    sched.add(s2)
    assert reg.prepare_slots(sched.waiting) == [s1]
    assert good.slot == 0 and reg.list_loras() == [2]


def test_remove_lets_running_finish_then_frees_the_slot(adapters):
    sched = make_scheduler()
    reg, loader = registry_for(sched)
    a = reg.register(adapters[0])
    seq = make_seq("s", [1, 2, 3], max_tokens=4)
    a.attach(seq)
    sched.add(seq)
    stepper = Stepper(sched)
    reg.prepare_slots(sched.waiting)
    stepper.step()
    assert reg.remove(1) and not reg.remove(1) and reg.list_loras() == []
    # Re-registered under the same id: a new load id, while the old one still runs.
    again = reg.register(adapters[0])
    assert again.load_id != a.load_id and a.slot == 0
    while stepper.has_work():
        reg.release_removed(sched.waiting)
        stepper.step()
    assert seq.output_token_ids == expected_output([1, 2, 3], 4, 64)
    reg.release_removed(sched.waiting)
    assert ("unload", 0) in loader.calls and a.load_id not in reg.by_load_id


def test_registration_checks(adapters, tmp_path):
    sched = make_scheduler()
    reg, _ = registry_for(sched)
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found for"):
        reg.register(LoRARequest("x", 9, str(tmp_path / "missing")))
    reg.register(adapters[0])
    with pytest.raises(ValueError, match="another adapter needs another id"):
        reg.register(LoRARequest("a2", 1, adapters[1].lora_path))
    with pytest.raises(ValueError, match="id must be > 0, got 0"):
        LoRARequest("z", 0, "p")


def test_prefix_cache_is_per_adapter_load(adapters):
    """The same prompt under base, a and b: no cross-adapter hit, full hits within one; after
    a removal and a reload under the same name, no stale hit."""
    sched = make_scheduler(num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64)
    reg, _ = registry_for(sched)
    prompt = list(range(1, 14))  # 3 full blocks of 4, and one token

    def cached_tokens(adapter) -> int:
        seq = make_seq(f"q{len(sched.block_manager.cached)}", prompt, max_tokens=1)
        if adapter is not None:
            adapter.attach(seq)
        sched.add(seq)
        run(sched, reg)
        return seq.num_cached_tokens

    a, b = reg.register(adapters[0]), reg.register(adapters[1])
    assert [cached_tokens(x) for x in (None, a, b)] == [0, 0, 0]
    assert [cached_tokens(x) for x in (None, a, b)] == [12, 12, 12]
    reg.remove(1)
    reloaded = reg.register(LoRARequest("a", 1, adapters[0].lora_path))
    assert cached_tokens(reloaded) == 0 and cached_tokens(reloaded) == 12
    assert np.all(reg.adapter_slot == -1)


def test_refused_load_ends_the_sequences_outside_the_queue_too(adapters):
    """Held n > 1 siblings and requests whose grammar compiles are outside the queue when the
    ranks refuse their adapter: they reach it later with an adapter the registry forgot, are
    not admitted and end at the next `prepare_slots` (it raised KeyError, stopping the
    engine)."""
    sched = make_scheduler()
    reg, loader = registry_for(sched)
    bad = reg.register(adapters[0])
    loader.refuse.add(adapters[0].lora_path)
    first, sibling = make_seq("0_r", [1, 2]), make_seq("1_r", [1, 2])
    bad.attach(first)
    bad.attach(sibling)
    sched.add(first)
    assert reg.prepare_slots(sched.waiting) == [first]
    assert reg.by_load_id == {} and reg.list_loras() == []
    sched.finish(first.seq_id, SequenceStatus.FINISHED_ABORTED)
    sched.add(sibling)  # released: its first sample ended
    assert not reg.admits(sibling)
    assert reg.prepare_slots(sched.waiting) == [sibling]
    assert len(loader.calls) == 0  # nothing asked of the ranks again


def test_refused_reload_of_a_removed_adapter_keeps_its_id_successor(adapters):
    """An adapter removed while a request still waits for it, its id registered again for
    another adapter: when the ranks refuse to load the removed one (its files are gone), its
    request ends and the new registration under that id stays served."""
    sched = make_scheduler()
    reg, loader = registry_for(sched)
    old = reg.register(adapters[0])
    seq = make_seq("s", [1, 2])
    old.attach(seq)
    sched.add(seq)
    assert reg.remove(1)
    new = reg.register(LoRARequest("a", 1, adapters[1].lora_path))
    loader.refuse.add(adapters[0].lora_path)
    assert reg.prepare_slots(sched.waiting) == [seq]
    assert reg.list_loras() == [1] and reg.by_id[1] is new
    assert old.load_id not in reg.by_load_id and new.load_id in reg.by_load_id


def test_preempted_adapter_requests_recompute_on_their_adapter(adapters):
    """A pool too small for every sequence preempts some: they give their pins back, wait
    (their adapter may lose its slot meanwhile) and recompute on their own adapter's slot;
    every step's rows read their adapter's slot (`run` checks) and nothing stays pinned."""
    sched = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=32)
    reg, _ = registry_for(sched, max_loras=2)
    seqs = []
    for i in range(6):  # base, b, c, base, a, b
        seq = make_seq(f"s{i}", [i + 1, 2, 3, 4, 5, 6], max_tokens=12)
        if i % 3:
            reg.register(adapters[i % 4]).attach(seq)
        sched.add(seq)
        seqs.append(seq)
    preempted = []
    schedule = sched.schedule

    def recording():
        step = schedule()
        preempted.extend(step.preempted)
        return step

    sched.schedule = recording
    per_step = run(sched, reg)
    assert any(seq.adapter_id is not None for seq in preempted)
    assert max(len(s) for s in per_step) == 2
    assert all(s.output_token_ids == expected_output(s.prompt_token_ids, 12, 64) for s in seqs)
    assert all(a.num_running == 0 for a in reg.by_load_id.values())
    assert reg.num_adapter_rows == 0
