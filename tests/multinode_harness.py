"""Two "nodes" on one host, honestly apart: torchrun on each, static rendezvous, node 1's ranks
in their own mount, IPC and pid namespaces with their own /dev/shm and /tmp.

    node 0:  python -m torch.distributed.run --nnodes 2 --node-rank 0 ... launch/serve.py ...
    node 1:  unshare --mount --ipc --pid --fork --kill-child --mount-proc -- bash -c '
                 mount -t tmpfs tmpfs /dev/shm; mount -t tmpfs tmpfs /tmp; <copy the
                 checkpoint in>; exec python -m torch.distributed.run --node-rank 1 ...'

So isolated, nothing of rank 0's shared memory, socket files or process table is visible on
node 1: a rank that tried the ring, a Unix socket or a pid watch across "nodes" fails at once
instead of silently working. Only loopback TCP joins them, as a network would. The checkout, its
virtual environment and the checkpoint stay visible on node 1 at their own paths, even under
/tmp (`start_node1`), as every node of a cluster has its own copy of them.
SIGKILL to node 1's `unshare` (`--kill-child`) takes the whole namespace down at once: a node
lost.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.server_harness import REPO_ROOT, Server
from tp_engine.server.rank0 import replicas


def free_port() -> int:
    return replicas.free_port("127.0.0.1")  # the nodes' ports: loopback, never ephemeral


def unshare_available() -> str | None:
    """None when this process may make the namespaces (root, or CAP_SYS_ADMIN), else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    probe = ["unshare", "--mount", "--ipc", "--pid", "--fork", "--mount-proc", "--", "bash",
             "-c", "mount -t tmpfs tmpfs /dev/shm"]  # fmt: skip
    done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    return None if done.returncode == 0 else f"unshare refused: {done.stderr.strip()}"


DOC = REPO_ROOT / "docs" / "multi-node.md"
DOC_SECTION = "Try it on one machine"
# Node 1's namespaces and private mounts, as the page writes them.
UNSHARE = ["unshare", "--mount", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
           "bash", "-c"]  # fmt: skip
MOUNTS = ["mount -t tmpfs tmpfs /dev/shm", "mount -t tmpfs tmpfs /tmp"]


def documented_commands() -> dict[str, tuple[list[str], list[str]]]:
    """docs/multi-node.md's "Try it on one machine" commands, node 0's and node 1's, for each
    launch form ("torchrun", "tp-engine"); node 1's torchrun command taken from inside its
    `unshare` line, which must be the harness's own namespaces and mounts."""
    from tests.test_readme_commands import page_blocks

    blocks = [b for b in page_blocks(DOC) if b.section == DOC_SECTION and b.lang == "bash"]
    assert len(blocks) == 3, f"{DOC.name}: expected 3 bash blocks under {DOC_SECTION!r}"
    (node0,), (wrapped,), (tpe0, tpe1) = (b.commands for b in blocks)
    words = shlex.split(wrapped)
    assert words[:-1] == UNSHARE, f"node 1's namespaces differ from the harness's: {words}"
    *mounts, node1 = words[-1].split(" && ")
    assert mounts == MOUNTS and node1.startswith("exec "), words[-1]
    return {
        "torchrun": (shlex.split(node0), shlex.split(node1[len("exec ") :])),
        "tp-engine": (shlex.split(tpe0), shlex.split(tpe1)),
    }


def runnable(argv: list[str], master_port: int, extra: list[str]) -> list[str]:
    """A documented command as this test runs it: this interpreter's torchrun or tp-engine, a
    free rendezvous port, and the test's own flags (checkpoint, port 0, ...) appended."""
    head = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
            "tp-engine": [sys.executable, "-m", "tp_engine.cli"]}[argv[0]]  # fmt: skip
    rest = list(argv[1:])
    rest[rest.index("--master-port") + 1] = str(master_port)
    return [*head, *rest, *extra]


def node_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", **extra)
    env.pop("TP_ENGINE_FAULT", None)
    return env


def start_node0(cmd: list[str], log: Path, env: dict) -> Server:
    """Node 0: rank 0 (the engine and the HTTP server) and its node's ranks; not waited for."""
    return Server(cmd, env, log)


def start_node1(cmd: list[str], checkpoint: Path, log: Path, env: dict) -> Server:
    """Node 1 in its own namespaces (module docstring). The page's mounts cover /tmp, which
    would hide a checkout, a virtual environment or a checkpoint under it (CI clones into
    /tmp): each is bind-mounted aside first and moved back onto its own path after, so node 1
    sees those and nothing else of the host's /tmp."""
    keep = sorted({str(REPO_ROOT), str(Path(sys.prefix).resolve()), str(checkpoint)})
    aside = [f"/dev/shm/.keep{i}" for i in range(len(keep))]
    q = shlex.quote
    steps = [MOUNTS[0]]
    steps += [f"mkdir {a} && mount --bind {q(k)} {a}" for k, a in zip(keep, aside, strict=True)]
    steps += MOUNTS[1:]
    steps += [f"mkdir -p {q(k)} && mount --move {a} {q(k)} && rmdir {a}"
              for k, a in zip(keep, aside, strict=True)]  # fmt: skip
    steps += [f"cd {q(str(REPO_ROOT))}", "exec " + shlex.join(cmd)]
    return Server([*UNSHARE, " && ".join(steps)], env, log)
