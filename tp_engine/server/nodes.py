"""The multi-node flags of `tp-engine serve` without torchrun, with vLLM's names:

    node 0:   tp-engine serve DIR --tensor-parallel-size 4 --nnodes 2 --node-rank 0 \
                  --master-addr HEAD --master-port 29501
    node 1:   tp-engine serve DIR --tensor-parallel-size 4 --nnodes 2 --node-rank 1 \
                  --master-addr HEAD --master-port 29501 --headless

Each node's process is its first rank and starts the node's other ranks
(`rank_worker.dist.local_group`); node 0's rank 0 hosts the rendezvous on `--master-addr:
--master-port` and runs the engine and the API server, the other nodes serve it headless (no
HTTP). Under torchrun these are torchrun's own flags, so here they are refused.
"""

from __future__ import annotations

import argparse

from rank_worker.dist.local_group import NodeSpec


def add_node_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "several nodes (without torchrun)",
        "one command per node, the same but for --node-rank (and --headless off node 0)",
    )
    g.add_argument("--nnodes", type=int, default=1, help="nodes the ranks are spread over")
    g.add_argument("--node-rank", type=int, default=0, help="this node, 0..nnodes-1")
    g.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="node 0's address, where the ranks meet (not the address rank 0's plan sockets "
        "bind: that is $TP_ENGINE_HOST_IP, or the one that routes here)",
    )
    g.add_argument("--master-port", type=int, default=29501, help="the rendezvous port")
    g.add_argument(
        "--headless",
        action="store_true",
        help="serve rank 0 from this node, no HTTP (nodes other than 0; implied there)",
    )
    g.add_argument(
        "--node-join-timeout",
        type=float,
        default=300.0,
        help="seconds node 0 waits for every other node before failing, naming the missing",
    )


def node_spec(args: argparse.Namespace, world_size: int, under_torchrun: bool) -> NodeSpec | None:
    """The node layout the flags ask for (None: one node); ValueError for a combination that
    cannot work, naming the flags."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1}")
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless is for nodes other than 0: node 0 serves the API")
    if args.nnodes == 1:
        return None
    if under_torchrun:
        raise ValueError("--nnodes is torchrun's flag under torchrun: give it to torchrun")
    spec = NodeSpec(
        args.nnodes, args.node_rank, args.master_addr, args.master_port, args.node_join_timeout
    )
    spec.ranks_per_node(world_size)  # raises if the ranks do not split evenly
    return spec
