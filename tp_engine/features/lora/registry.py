"""LoRA adapters on rank 0: which adapter a request uses, which device slot holds it, and when
a slot is loaded or given back.

Ownership: the engine owns one `AdapterRegistry` when `enable_lora` is on. The ranks hold the
slot stacks and read adapter files themselves (`rank_worker.lora`); rank 0 decides, between
steps, which adapter each of the `max_loras` slots holds and tells every rank through the
control calls LOAD_LORA and UNLOAD_LORA (`SlotLoader`). A step's plan carries each row's slot
(`plan_sections`: the registry's own per-row `adapter_slot`, -1 for the base model).

An adapter's life here:

    register   first use of a `LoRARequest` (or `add_lora`): its config is checked on rank 0
               and it gets a load id, new for every registration (the prefix-cache tag)
    resident   `prepare_slots`, between two steps, gives a slot to the adapters the waiting
               queue needs first: a free slot, else the least recently used slot that no
               running sequence pins and no earlier waiting sequence wants
    pinned     while a running sequence uses it (the batch's rows, followed as a
               `RowFollower`); a pinned slot is never taken
    removed    `remove`: new requests no longer get it; the sequences already using it finish
               on it, and once none is left its slot is given back

Admission (the scheduler's `Gate.admits`) takes a sequence only when its adapter is resident:
slots are `max_loras`, so no step carries more distinct adapters than that (vLLM's
`max_loras` check) and every step finds its adapters loaded.

K/V computed under an adapter is K/V of that adapter only: a sequence's prefix-cache chain is
rooted at ("adapter", load id) (`Sequence.cache_tags`). The load id changes when an adapter is
removed and registered again under the same name, so a reload never serves the old one's K/V
(vLLM #42125 keyed by name alone).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tp_engine.core.running_batch import RowFollower
from tp_engine.lora_request import LoRARequest

if TYPE_CHECKING:
    from tp_engine.core.sequence import Sequence

logger = logging.getLogger(__name__)

# PEFT's file names (`save_pretrained`); vLLM also reads .bin/.pt weights, which we do not.
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAAdapterNotFoundError(ValueError):
    """No adapter at a path, or none of a name (vLLM answers both 404)."""


class SlotLoader(Protocol):
    """Loads adapters into the ranks' device slots (the engine's control calls). A refusal
    (`ControlRefusedError`, a ValueError) leaves every rank as it was."""

    def load_slot(self, slot: int, lora_uid: int, path: str) -> None: ...

    def unload_slot(self, slot: int, lora_uid: int) -> None:
        """Empty `slot` and drop adapter `lora_uid` from the ranks' host copies."""


@dataclass(eq=False)
class Adapter:
    """One registered adapter."""

    request: LoRARequest
    # New for every registration: the ranks' name for the weights and the prefix-cache tag.
    load_id: int
    slot: int | None = None
    # Running sequences using it (their rows pin the slot).
    num_running: int = 0
    # `remove` was called: no new requests; freed once no sequence uses it.
    removed: bool = False

    def attach(self, seq: Sequence) -> None:
        """Make `seq` run with this adapter: its rows use the adapter's slot, and its K/V is
        shared only with sequences of this same load (the root of its prefix-cache chain)."""
        seq.adapter_id = self.load_id
        seq.cache_tags = (*seq.cache_tags, ("adapter", self.load_id))


def check_adapter_dir(request: LoRARequest) -> None:
    """Refuse a path that holds no PEFT adapter (`LoRAAdapterNotFoundError`, vLLM's text)."""
    path = Path(request.lora_path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise LoRAAdapterNotFoundError(
            f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}"
        )


_load_ids = itertools.count(1)


class AdapterRegistry(RowFollower):
    """Adapters, their slots and pins (see the module docstring). A sequence names its adapter
    by load id (`Sequence.adapter_id`), so that sequences of a removed adapter finish on it
    even after its `lora_int_id` was registered again for another.

    `check_config(path)` validates an adapter's config on rank 0 (raises ValueError with vLLM's
    message), so that most refusals come before any rank is asked.
    """

    def __init__(
        self, max_loras: int, loader: SlotLoader, check_config: Callable[[str], object]
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.loader = loader
        self.check_config = check_config
        # lora_int_id -> its current registration; load id -> every adapter still in use
        # (registered, or removed with sequences left).
        self.by_id: dict[int, Adapter] = {}
        self.by_load_id: dict[int, Adapter] = {}
        # slot -> the adapter in it (None: free), and the slots by last use, least recent first.
        self.slots: list[Adapter | None] = [None] * max_loras
        self._lru = list(range(max_loras))
        # row -> the adapter its running sequence pins (None: base).
        self._row_adapter: list[Adapter | None] = []
        # [max_rows] int32: each running row's slot, -1 for the base model; and how many rows
        # run an adapter (while 0, plans carry no adapter slots).
        self.adapter_slot = np.full(0, -1, dtype=np.int32)
        self.num_adapter_rows = 0

    # -- registration ----------------------------------------------------------------------------

    def register(self, request: LoRARequest) -> Adapter:
        """The adapter of `request`, registered (checked, with a new load id) on first use.
        Raises ValueError (`LoRAAdapterNotFoundError` for a missing path) saying why."""
        adapter = self.by_id.get(request.lora_int_id)
        if adapter is not None:
            if adapter.request.lora_path != request.lora_path:
                raise ValueError(
                    f"LoRA id {request.lora_int_id} is {adapter.request.lora_name!r} from "
                    f"{adapter.request.lora_path}; another adapter needs another id"
                )
            return adapter
        check_adapter_dir(request)
        self.check_config(request.lora_path)
        adapter = Adapter(request, next(_load_ids))
        self.by_id[request.lora_int_id] = adapter
        self.by_load_id[adapter.load_id] = adapter
        return adapter

    def preload(self, adapter: Adapter) -> None:
        """Load a new adapter into a slot now if one is free or unpinned: every rank checks its
        weights before its name is served (vLLM's `add_lora`); a refusal forgets it. With every
        slot pinned it is loaded when a request needs it."""
        if adapter.slot is not None:
            return
        slot = self._free_slot(wanted=set())
        if slot is None:
            return
        try:
            self._load(adapter, slot)
        except ValueError:
            self._drop_refused(adapter)
            raise

    def remove(self, lora_int_id: int) -> bool:
        """Stop serving an adapter; False if it is not registered. Sequences using it finish on
        it; its slot is given back once none is left (`release_removed`)."""
        adapter = self.by_id.pop(lora_int_id, None)
        if adapter is None:
            return False
        adapter.removed = True
        return True

    def list_loras(self) -> list[int]:
        return sorted(self.by_id)

    def release_removed(self, waiting: Iterable[Sequence]) -> None:
        """Give back the slots of removed adapters that no sequence uses any more."""
        removed = [a for a in self.by_load_id.values() if a.removed and a.num_running == 0]
        if not removed:
            return
        in_use = {seq.adapter_id for seq in waiting}
        for adapter in removed:
            if adapter.load_id not in in_use:
                self._forget(adapter)

    def _drop_refused(self, adapter: Adapter) -> None:
        """Forget an adapter the ranks refused to load. Its id is unregistered only while it
        names this adapter: a removed adapter's id may name a newer registration by now."""
        if self.by_id.get(adapter.request.lora_int_id) is adapter:
            self.remove(adapter.request.lora_int_id)
        self._forget(adapter)

    def _forget(self, adapter: Adapter) -> None:
        if adapter.slot is not None:
            self.loader.unload_slot(adapter.slot, adapter.load_id)
            self.slots[adapter.slot] = None
            adapter.slot = None
        self.by_load_id.pop(adapter.load_id, None)

    # -- slots -----------------------------------------------------------------------------------

    def admits(self, seq: Sequence) -> bool:
        """The scheduler's gate: base sequences always, others once their adapter is in a slot."""
        if seq.adapter_id is None:
            return True
        adapter = self.by_load_id.get(seq.adapter_id)
        return adapter is not None and adapter.slot is not None

    def prepare_slots(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        """Between steps: load the adapters the waiting sequences need, in queue order, while
        slots can be had. Returns the waiting sequences whose adapter the ranks refused to load
        (their caller ends them); that adapter is forgotten. A sequence that was outside the
        queue then (a held n > 1 sibling, a request compiling its grammar) finds its adapter
        forgotten when it reaches the queue, and is returned then."""
        waiting = list(waiting)
        wanted: set[int] = set()  # slots the queue so far needs kept
        failed: set[int] = set()
        for seq in waiting:
            if seq.adapter_id is None or seq.adapter_id in failed:
                continue
            adapter = self.by_load_id.get(seq.adapter_id)
            if adapter is None:  # refused while this sequence was outside the queue
                failed.add(seq.adapter_id)
                continue
            if adapter.slot is None:
                slot = self._free_slot(wanted)
                if slot is None:
                    break  # every slot pinned, or wanted earlier in the queue
                try:
                    self._load(adapter, slot)
                except ValueError:
                    logger.exception("LoRA adapter %r failed to load", adapter.request.lora_name)
                    failed.add(adapter.load_id)
                    self._drop_refused(adapter)
                    continue
            assert adapter.slot is not None
            wanted.add(adapter.slot)
            if len(wanted) == self.max_loras:
                break
        return [seq for seq in waiting if seq.adapter_id in failed]

    def _free_slot(self, wanted: set[int]) -> int | None:
        """A free slot, else the least recently used one that nothing pins or wants."""
        for slot, adapter in enumerate(self.slots):
            if adapter is None:
                return slot
        for slot in self._lru:
            adapter = self.slots[slot]
            if slot not in wanted and adapter is not None and adapter.num_running == 0:
                return slot
        return None

    def _load(self, adapter: Adapter, slot: int) -> None:
        self.loader.load_slot(slot, adapter.load_id, adapter.request.lora_path)
        old = self.slots[slot]
        if old is not None:
            old.slot = None
        self.slots[slot] = adapter
        adapter.slot = slot
        self._touch(slot)

    def _touch(self, slot: int) -> None:
        self._lru.remove(slot)
        self._lru.append(slot)

    # -- pins: the running batch's rows (RowFollower) --------------------------------------------

    def reset_rows(self, max_rows: int) -> None:
        for adapter in self.by_load_id.values():
            adapter.num_running = 0
        self._row_adapter = [None] * max_rows
        self.adapter_slot = np.full(max_rows, -1, dtype=np.int32)
        self.num_adapter_rows = 0

    def add_row(self, row: int, seq: Sequence) -> None:
        if seq.adapter_id is None:
            return
        adapter = self.by_load_id[seq.adapter_id]
        if adapter.slot is None:
            raise AssertionError(f"{seq} admitted without its adapter in a slot")
        adapter.num_running += 1
        self._row_adapter[row] = adapter
        self.adapter_slot[row] = adapter.slot
        self.num_adapter_rows += 1
        self._touch(adapter.slot)

    def remove_row(self, row: int) -> None:
        adapter = self._row_adapter[row]
        if adapter is None:
            return
        adapter.num_running -= 1
        self._row_adapter[row] = None
        self.adapter_slot[row] = -1
        self.num_adapter_rows -= 1

    def plan_sections(self, rows: np.ndarray) -> dict[str, np.ndarray] | None:
        """The `adapter_slots` section of a plan over batch `rows` (`CoreHooks.plan_sections`);
        None while every row runs the base model."""
        if not self.num_adapter_rows:
            return None
        return {"adapter_slots": self.adapter_slot[rows]}
