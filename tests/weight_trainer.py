"""A stand-in trainer for the weight-update tests: a separate process that hosts the weights
update group's TCPStore, joins the group as its rank 0 (as SGLang's trainers do, in the layout of `rank_worker.control.weight_group`), and
broadcasts the tensors it is told to, in order.

Commands on `commands` (a multiprocessing queue), replies on `replies`:
    ("send", checkpoint_dir, [[name, dtype, shape], ...])  broadcast each tensor of the
        checkpoint, cast to dtype; a shape that differs from the checkpoint's is sent as zeros
        of that shape (what a trainer with wrong metadata would do) → ("sent", seconds)
    ("die_after", checkpoint_dir, [[name, dtype, shape], ...], k)  broadcast the first k
        tensors, then exit at once without a word (a trainer killed mid-update)
    ("stop",)  → ("stopped",), and the process exits
The first reply is ("ready",) once every rank has joined. Any failure → ("error", traceback).
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any


def trainer_main(port: int, world_size: int, group_name: str, commands: Any, replies: Any) -> None:
    try:
        import torch
        from safetensors.torch import load_file

        from rank_worker.control.weight_group import group_broadcast, weights_update_group
        from rank_worker.control.weight_ops import parse_dtype
        from rank_worker.models.loader import safetensors_files

        pg, _store = weights_update_group(
            "127.0.0.1", port, 0, world_size, group_name, "gloo", timeout_s=60
        )
        replies.put(("ready",))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                replies.put(("stopped",))
                return
            _, ckpt, metas, *die_after = cmd
            tensors: dict[str, torch.Tensor] = {}
            for path in safetensors_files(ckpt):
                tensors.update(load_file(str(path)))
            start = time.perf_counter()
            for i, (name, dtype, shape) in enumerate(metas):
                if die_after and i == die_after[0]:
                    os._exit(1)
                t = tensors.get(name)
                if t is None or list(t.shape) != list(shape):
                    t = torch.zeros(shape)
                group_broadcast(pg, t.to(parse_dtype(dtype)).contiguous())
            replies.put(("sent", time.perf_counter() - start))
    except BaseException:
        replies.put(("error", traceback.format_exc()))


@dataclass
class Trainer:
    """A running stand-in trainer: its process, command and reply queues, and store port."""

    process: Any
    commands: Any
    replies: Any
    port: int

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def spawn_trainer(world_size: int, group_name: str) -> Trainer:
    """Start `trainer_main` in a fresh (spawned) process on a free port of 127.0.0.1."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    commands, replies = ctx.Queue(), ctx.Queue()
    args = (port, world_size, group_name, commands, replies)
    process = ctx.Process(target=trainer_main, args=args, daemon=True)
    process.start()
    return Trainer(process, commands, replies, port)


def checkpoint_metas(checkpoint: Any, dtype: str = "float32") -> list[list[Any]]:
    """`[name, dtype, shape]` of every tensor of a single-file checkpoint, as a trainer
    announces them."""
    from safetensors.torch import load_file

    tensors = load_file(str(checkpoint) + "/model.safetensors")
    return [[name, dtype, list(t.shape)] for name, t in tensors.items()]
