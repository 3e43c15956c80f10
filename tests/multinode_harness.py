"""Two "nodes" on one host, honestly apart: torchrun on each, static rendezvous, node 1's ranks
in their own mount, IPC and pid namespaces with their own /dev/shm and /tmp.

    node 0:  python -m torch.distributed.run --nnodes 2 --node-rank 0 ... launch/serve.py ...
    node 1:  unshare --mount --ipc --pid --fork --kill-child --mount-proc -- bash -c '
                 mount -t tmpfs tmpfs /dev/shm; mount -t tmpfs tmpfs /tmp; <copy the
                 checkpoint in>; exec python -m torch.distributed.run --node-rank 1 ...'

So isolated, nothing of rank 0's shared memory, socket files or process table is visible on
node 1: a rank that tried the ring, a Unix socket or a pid watch across "nodes" fails at once
instead of silently working. Only loopback TCP joins them, as a network would. The checkpoint is
copied into node 1's own /tmp at the same path (every node brings its own copy of the weights).
SIGKILL to node 1's `unshare` (`--kill-child`) takes the whole namespace down at once: a node
lost.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.server_harness import REPO_ROOT, Server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unshare_available() -> str | None:
    """None when this process may make the namespaces (root, or CAP_SYS_ADMIN), else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    probe = ["unshare", "--mount", "--ipc", "--pid", "--fork", "--mount-proc", "--", "bash",
             "-c", "mount -t tmpfs tmpfs /dev/shm"]  # fmt: skip
    done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else f"unshare refused: {done.stderr.strip()}"


def torchrun(node_rank: int, nproc: int, master_port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
        "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(master_port),
    ]  # fmt: skip


def node_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", **extra)
    env.pop("TP_ENGINE_FAULT", None)
    return env


def start_node0(serve_args: list[str], master_port: int, log: Path, env: dict) -> Server:
    """Node 0: rank 0 (the engine and the HTTP server) and rank 1; not yet waited for."""
    cmd = [*torchrun(0, 2, master_port), "launch/serve.py", "--port", "0", *serve_args]
    return Server(cmd, env, log)


def start_node1(
    serve_args: list[str], master_port: int, checkpoint: Path, log: Path, env: dict
) -> Server:
    """Node 1, ranks 2 and 3, in its own namespaces (module docstring)."""
    run = [*torchrun(1, 2, master_port), str(REPO_ROOT / "launch/serve.py"), "--port", "0",
           *serve_args]  # fmt: skip
    script = " && ".join(
        [
            "mount -t tmpfs tmpfs /dev/shm",
            f"cd {shlex.quote(str(checkpoint.parent))}",  # a handle on it once /tmp is covered
            "mount -t tmpfs tmpfs /tmp",
            f"mkdir -p {shlex.quote(str(checkpoint))}",
            f"cp -a ./{shlex.quote(checkpoint.name)}/. {shlex.quote(str(checkpoint))}/",
            f"cd {shlex.quote(str(REPO_ROOT))}",
            "exec " + shlex.join(run),
        ]
    )
    cmd = ["unshare", "--mount", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc",
           "--", "bash", "-c", script]  # fmt: skip
    return Server(cmd, env, log)
