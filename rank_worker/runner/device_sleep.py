"""Sleep mode on one rank: give back the device memory of the weights and the KV cache, and take
it again, keeping every tensor the same Python object.

Ownership: each `ModelRunner` owns one `DeviceSleep` (`runner.device_sleep`); the control ops
SLEEP and WAKE (`rank_worker.control.sleep_ops`) drive it on every rank, and rank 0's engine keeps
the engine-wide view (`tp_engine.features.weights_and_sleep.sleep`). Two tags, as vLLM's:

    tag        what                                           after sleep(1)      after sleep(2)
    weights    every parameter and buffer of the model        bytes on the host   parameters
               (and of the draft model)                                           discarded,
                                                                                  buffers on host
               an EAGLE-3 head's parameters and buffers       bytes on the host   bytes on host
    kv_cache   the KV cache (one storage per model, and the   discarded           discarded
               EAGLE-3 head's)

How memory is released: each tensor's storage is resized to 0 bytes (`UntypedStorage.resize_`)
and back to its size at wake; parameters, buffers and the cache's per-layer views stay the same
objects, so everything that holds them (the modules, `WeightMap`, the graph runner) stays
valid. Buffers (rotary tables, the MoE expert map) are computed at start-up, not loaded, so a
weight update would not refill them: they are kept on the host at both levels (vLLM's fix for
its issue 16564). So is an EAGLE-3 head, which no weight update writes either. At wake:

- weights after level 1: the host copy is written back, bytes identical; after level 2: the
  storage comes back zero-filled and `weights_lost` stays set until new weights are loaded
  (the engine refuses to serve meanwhile: garbage is never generated);
- the KV cache comes back zero-filled (`allocate_kv_cache`'s invariant: masked padding reads
  must not find NaN); the prefix cache that described its contents was flushed by the engine.

`data_ptr()` after wake: a new allocation, so the address generally differs (always on CPU;
on a GPU the caching allocator may or may not hand back the same block). CUDA graphs hold the
addresses of the weights and the cache, so sleeping either tag releases the decode graphs
(their memory pool goes back too) and the wake that leaves both tags awake captures them again
(`ModelRunner.capture_graphs`; capture runs the forward's collectives, and every rank runs the
WAKE commit, so every rank captures the same sizes in the same order, as at start-up). A fixed-
address pool (vLLM's CuMemAllocator remaps the same virtual addresses) would avoid the
recapture; it is not used here.

A forward pass over a released storage would read freed memory (a segfault on CPU, an illegal
address on a GPU): `ModelRunner.execute` refuses to run while any tag sleeps.
"""

from __future__ import annotations

import enum
import gc
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rank_worker.tp import TPInfo


class SleepingRunner(Protocol):
    """What `DeviceSleep` reads of its `ModelRunner` (a Protocol: the runner imports this)."""

    model: torch.nn.Module
    draft: Any  # the draft model's ModelRunner, or None
    eagle3: Any  # rank_worker.spec.eagle3_runner.Eagle3Runner, or None
    kv_caches: list[Any] | None  # (k, v) per layer
    lora: Any  # rank_worker.lora.manager.LoraManager, or None without LoRA
    device: torch.device
    tp: TPInfo

    def capture_graphs(self) -> None: ...

    def release_graphs(self) -> bool: ...


logger = logging.getLogger(__name__)


class SleepTag(str, enum.Enum):
    """What a sleep releases and a wake restores (vLLM's tag names)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"

    @classmethod
    def parse_all(cls, tags: Iterable[str] | None) -> tuple[SleepTag, ...]:
        """`tags` as SleepTags in declaration order; None means every tag. ValueError for an
        unknown tag or an empty list."""
        if tags is None:
            return tuple(cls)
        if isinstance(tags, str):
            raise ValueError(f"tags must be a list of tag names, got the string {tags!r}")
        tags = list(tags)
        names = [t.value for t in cls]
        unknown = [t for t in tags if t not in names]
        if unknown or not tags:
            raise ValueError(f"tags must be a non-empty list of {names}, got {tags!r}")
        return tuple(t for t in cls if t.value in tags)


SLEEP_LEVELS = (1, 2)


@dataclass
class _Region:
    """One storage that a sleep released: its size and, where kept, its bytes on the host."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # [nbytes] uint8 on the host (pinned with a GPU); None = discarded
    is_buffer: bool = False  # a module buffer: kept on the host at every level


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A `[nbytes]` uint8 tensor over `storage` (a view: do not keep it across a resize)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _unique_storages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.UntypedStorage]:
    """Each distinct storage once: tied embeddings and the cache's per-layer views share one.
    Keyed by the StorageImpl (`_cdata`), which a resize keeps, unlike `data_ptr`."""
    seen: set[int] = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            yield storage


class DeviceSleep:
    """Release and restore one runner's weights and KV cache (see the module docstring).

    State: `asleep` maps each sleeping tag to the level it was put to sleep at;
    `weights_lost` is set by a level-2 sleep of the weights and cleared by
    `note_weights_loaded` (a full weight update)."""

    def __init__(self, runner: SleepingRunner) -> None:
        self.runner = runner
        self.asleep: dict[SleepTag, int] = {}
        self.weights_lost = False
        self._regions: dict[SleepTag, list[_Region]] = {}
        # Whether the runner had decode graphs when the first tag went to sleep.
        self._had_graphs = False

    # -- what each tag covers ---------------------------------------------------------------

    def _models(self) -> list[torch.nn.Module]:
        runner = self.runner
        models = [runner.model]
        if runner.draft is not None:
            models.append(runner.draft.model)
        return models

    def _parameters(self) -> list[torch.Tensor]:
        return [p for model in self._models() for p in model.parameters()]

    def _buffers(self) -> list[torch.Tensor]:
        """What the weights tag keeps on the host at either level: the models' buffers, the
        LoRA slot stacks and an EAGLE-3 head (no weight update writes them again; the adapters
        and the head stay loaded)."""
        buffers = [b for model in self._models() for b in model.buffers()]
        lora, eagle3 = self.runner.lora, self.runner.eagle3
        if lora is not None:
            buffers += lora.device_tensors()
        if eagle3 is not None:
            buffers += [*eagle3.head.parameters(), *eagle3.head.buffers()]
        return buffers

    def _kv_tensors(self) -> list[torch.Tensor]:
        runner = self.runner
        caches = list(runner.kv_caches or [])
        if runner.draft is not None:
            caches += list(runner.draft.kv_caches or [])
        if runner.eagle3 is not None and runner.eagle3.kv_cache is not None:
            caches.append(runner.eagle3.kv_cache)
        return [t for pair in caches for t in pair]

    def device_bytes(self, tag: SleepTag) -> int:
        """Bytes `tag` holds on the device now (0 while it sleeps); each storage counted once."""
        tensors = (
            self._parameters() + self._buffers() if tag is SleepTag.WEIGHTS else self._kv_tensors()
        )
        return sum(s.nbytes() for s in _unique_storages(tensors))

    def host_bytes(self) -> int:
        """Bytes of host copies kept by the sleeping tags."""
        return sum(
            r.host.numel()
            for regions in self._regions.values()
            for r in regions
            if r.host is not None
        )

    def report(self) -> dict[str, int]:
        """{"weights", "kv_cache": device bytes, "host_backup": host bytes} of this rank."""
        return {
            "weights": self.device_bytes(SleepTag.WEIGHTS),
            "kv_cache": self.device_bytes(SleepTag.KV_CACHE),
            "host_backup": self.host_bytes(),
        }

    # -- sleep and wake ---------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int) -> None:
        """Release every awake tag at `level` (1: weights kept on the host; 2: parameters
        discarded). A weights tag already asleep with a host copy loses that copy at level 2
        (the host memory goes back); otherwise a sleeping tag stays as it is."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if not self.asleep:
            self._drop_graphs()
        if SleepTag.WEIGHTS not in self.asleep:
            self._release_weights(level)
        elif level == 2 and self.asleep[SleepTag.WEIGHTS] == 1:
            for region in self._regions[SleepTag.WEIGHTS]:
                if not region.is_buffer:
                    region.host = None
            self.asleep[SleepTag.WEIGHTS] = 2
            self.weights_lost = True
        if SleepTag.KV_CACHE not in self.asleep:
            self._regions[SleepTag.KV_CACHE] = [
                self._release(s, keep=False) for s in _unique_storages(self._kv_tensors())
            ]
            self.asleep[SleepTag.KV_CACHE] = level
        self._return_to_device()

    def wake_up(self, tags: Iterable[SleepTag]) -> None:
        """Restore each of `tags` that sleeps (an awake one is left alone); once no tag sleeps,
        capture the decode graphs again where the runner had them."""
        for tag in tags:
            if tag not in self.asleep:
                continue
            for region in self._regions.pop(tag):
                self._restore(region)
            del self.asleep[tag]
        if not self.asleep and self._had_graphs:
            self._had_graphs = False
            self.runner.capture_graphs()

    def check_weights_awake(self) -> None:
        """Raise before anything writes the weights while their storage is released (a write
        there would land in freed memory). Wake the weights first: `wake_up(["weights"])`."""
        if SleepTag.WEIGHTS in self.asleep:
            raise RuntimeError(
                f"rank {self.runner.tp.rank}: the weights are asleep (released by sleep level "
                f"{self.asleep[SleepTag.WEIGHTS]}): wake_up(tags=['weights']) before loading them"
            )

    def note_weights_loaded(self) -> None:
        """Every parameter was written since the level-2 sleep (a full weight update)."""
        self.weights_lost = False

    def _release_weights(self, level: int) -> None:
        buffers = {s._cdata for s in _unique_storages(self._buffers())}
        regions = []
        for storage in _unique_storages(self._parameters() + self._buffers()):
            is_buffer = storage._cdata in buffers
            region = self._release(storage, keep=level == 1 or is_buffer)
            region.is_buffer = is_buffer
            regions.append(region)
        self._regions[SleepTag.WEIGHTS] = regions
        self.asleep[SleepTag.WEIGHTS] = level
        if level == 2:
            self.weights_lost = True

    def _release(self, storage: torch.UntypedStorage, keep: bool) -> _Region:
        nbytes = storage.nbytes()
        host = None
        if keep:
            pin = storage.device.type == "cuda"
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_of(storage))
        storage.resize_(0)
        return _Region(storage, nbytes, host)

    def _restore(self, region: _Region) -> None:
        region.storage.resize_(region.nbytes)
        view = _bytes_of(region.storage)
        if region.host is not None:
            view.copy_(region.host)
        else:
            view.zero_()

    def _drop_graphs(self) -> None:
        if self.runner.release_graphs():
            self._had_graphs = True

    def _return_to_device(self) -> None:
        """Make the released bytes free on the device, not cached by torch's allocator (else
        another process, the trainer, cannot use them: slime PR 579's OOM)."""
        gc.collect()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
            torch.cuda.empty_cache()
