"""The flags and environment variables of prefill/decode disaggregation, with SGLang's names:

    prefill:  tp-engine serve DIR --disaggregation-mode prefill --port 30000
    decode:   tp-engine serve DIR --disaggregation-mode decode --port 30001
    router:   python -m sglang_router.launch_router --pd-disaggregation \
                  --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001

What each role does is `tp_engine.server.rank0.disagg`; these are only the choices, read here
so that the flags import no part of rank 0.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

MODES = ("null", "prefill", "decode")
# SGLang's `mooncake` (RDMA where a device is found or named, else TCP), `mooncake_tcp` (TCP
# always) and `fake` (decode only: no KV moves, the first token made up; for decode benchmarks).
BACKENDS = ("mooncake", "mooncake_tcp", "fake")
DEFAULT_BOOTSTRAP_PORT = 8998
# Where a rank's device cache cannot be registered with the transfer engine, its pages go
# through a host staging pool (`rank_worker.kv.pd_staging`): auto (there only), on, off.
HOST_STAGING = ("auto", "on", "off")
# SGLang's environment variables and defaults (seconds).
BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
HEARTBEAT_INTERVAL_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
HEARTBEAT_FAILURES_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
DEFAULT_TIMEOUT_S = 300.0

ENVIRONMENT_HELP = f"""\
  {BOOTSTRAP_TIMEOUT_ENV}
                             seconds a prefill keeps a request's pages for a decode that never
                             says where they go (default 300)
  {WAITING_TIMEOUT_ENV}
                             seconds a decode waits for a request's pages (default 300)
  {HEARTBEAT_INTERVAL_ENV}, {HEARTBEAT_FAILURES_ENV}
                             a decode checks each prefill it waits on every 5 s; 2 failed
                             checks in a row fail that prefill's requests at once
  MOONCAKE_PROTOCOL, MC_FORCE_TCP
                             Mooncake's transport ("tcp" or "rdma"; MC_FORCE_TCP=1: tcp)
"""


@dataclass(frozen=True)
class DisaggregationOptions:
    """What `--disaggregation-*` asked for; mode "null": a regular server."""

    mode: str = "null"
    backend: str = "mooncake"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    ib_device: str = ""
    bootstrap_timeout_s: float = DEFAULT_TIMEOUT_S
    waiting_timeout_s: float = DEFAULT_TIMEOUT_S
    heartbeat_interval_s: float = 5.0
    heartbeat_failures: int = 2
    host_staging: str = "auto"
    staging_tokens: int = 0  # 0: two of the longest prompts

    @property
    def enabled(self) -> bool:
        return self.mode != "null"

    @property
    def moves_kv(self) -> bool:
        return self.enabled and self.backend != "fake"


def add_disaggregation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "prefill/decode disaggregation (SGLang's flags)",
        "two servers behind sglang-router --pd-disaggregation: the prefill computes each "
        "prompt and writes its KV pages into the decode's, which generates the rest",
    )
    g.add_argument(
        "--disaggregation-mode", choices=MODES, default="null",
        help="this server's role: null (regular), prefill or decode",
    )  # fmt: skip
    g.add_argument(
        "--disaggregation-transfer-backend", choices=BACKENDS, default="mooncake",
        help="how KV pages move: mooncake (RDMA where a device is found, else TCP), "
        "mooncake_tcp, or fake (decode only: no KV moves, for decode benchmarks)",
    )  # fmt: skip
    g.add_argument(
        "--disaggregation-bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT,
        help="the prefill's bootstrap server port (a decode uses its own value for a "
        "request whose bootstrap_port is null)",
    )  # fmt: skip
    g.add_argument(
        "--disaggregation-decode-enable-radix-cache", action="store_true",
        help="a decode server's prefix cache (off by default in decode mode, as SGLang's)",
    )  # fmt: skip
    g.add_argument(
        "--disaggregation-ib-device", default="", metavar="NAME",
        help="the RDMA device Mooncake uses (default: found, or TCP without one)",
    )  # fmt: skip
    g.add_argument(
        "--disaggregation-host-staging", choices=HOST_STAGING, default="auto",
        help="move KV pages through a host staging pool: auto (where the device cache "
        "cannot be registered with the transfer engine), on, or off",
    )  # fmt: skip
    g.add_argument(
        "--disaggregation-host-staging-tokens", type=int, default=0, metavar="N",
        help="the staging pool's size in tokens, on each rank (default: twice "
        "--max-model-len); a decode's requests wait for room in it",
    )  # fmt: skip


def disaggregation_options(args: argparse.Namespace) -> DisaggregationOptions:
    """The options; ValueError for a combination that cannot work, naming the flags."""
    mode, backend = args.disaggregation_mode, args.disaggregation_transfer_backend
    if mode == "prefill" and backend == "fake":
        raise ValueError("a prefill server does not support 'fake' as the transfer backend")
    if not 0 < args.disaggregation_bootstrap_port < 65536:
        raise ValueError("--disaggregation-bootstrap-port must be in 1..65535")
    if mode != "null" and getattr(args, "data_parallel_size", None) is not None:
        raise ValueError("--disaggregation-mode is not supported with --data-parallel-size yet")
    if mode != "null" and getattr(args, "pipeline_parallel_size", 1) > 1:
        raise ValueError(
            "--disaggregation-mode is not supported with --pipeline-parallel-size > 1 yet"
        )
    if args.disaggregation_host_staging_tokens < 0:
        raise ValueError("--disaggregation-host-staging-tokens must be >= 0")
    return DisaggregationOptions(
        mode=mode,
        backend=backend,
        bootstrap_port=args.disaggregation_bootstrap_port,
        ib_device=args.disaggregation_ib_device,
        bootstrap_timeout_s=_seconds(BOOTSTRAP_TIMEOUT_ENV),
        waiting_timeout_s=_seconds(WAITING_TIMEOUT_ENV),
        heartbeat_interval_s=_seconds(HEARTBEAT_INTERVAL_ENV, 5.0),
        heartbeat_failures=max(1, round(_seconds(HEARTBEAT_FAILURES_ENV, 2.0))),
        host_staging=args.disaggregation_host_staging,
        staging_tokens=args.disaggregation_host_staging_tokens,
    )


def _seconds(name: str, default: float = DEFAULT_TIMEOUT_S) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"${name} must be > 0, got {value!r}")
    return seconds
