"""Command-line flags of `launch/serve.py`, named as vLLM names them: the server's own here, the
engine's from the one table every script reads (`tp_engine.config.flags`).

Every flag has help text and shows its default in `--help` (`HelpFormatter`); the environment
variables the server reads are listed in the epilog (`ENVIRONMENT_HELP`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tp_engine.config import EngineConfig
from tp_engine.config.flags import add_engine_flags, engine_kwargs
from tp_engine.config.help_format import HelpFormatter
from tp_engine.config.speculative import SpeculativeConfig
from tp_engine.lora_request import LoRARequest
from tp_engine.server.api.chat_parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from tp_engine.server.api.guards import RequestLimits, allowed_hosts
from tp_engine.server.disagg_flags import (
    ENVIRONMENT_HELP as DISAGGREGATION_ENV_HELP,
)
from tp_engine.server.disagg_flags import (
    DisaggregationOptions,
    add_disaggregation_flags,
    disaggregation_options,
)
from tp_engine.server.nodes import add_node_flags

# The API key may come from the environment, so that it does not show in `ps`.
API_KEY_ENV = "TP_ENGINE_API_KEY"
DEMO_MODEL_NAME = "tp-engine-demo"
# sglang-router's --policy choices for a regular (not prefill/decode) deployment.
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# What --help ends with: every environment variable the server reads.
ENVIRONMENT_HELP = (
    f"""\
environment variables:
  {API_KEY_ENV}          the API key, where --api-key is not given (keeps it out of `ps`)
  TP_ENGINE_CACHE            where the demo model (and other built checkpoints) are written on
                             first use (default: ~/.cache/tp_engine)
  VLLM_ALLOW_RUNTIME_LORA_UPDATING
                             "true" (or 1) offers /v1/load_lora_adapter and
                             /v1/unload_lora_adapter (with --enable-lora); 404 otherwise
  TP_ENGINE_ROUTER_ADMIN_KEY the sglang-router admin key with --data-parallel-size (default: a
                             random key per run)
  TP_ENGINE_PP_LAYER_PARTITION
                             layers per pipeline stage with --pipeline-parallel-size, e.g.
                             "30,18" (vLLM's VLLM_PP_LAYER_PARTITION); default an even split
"""
    + DISAGGREGATION_ENV_HELP
)
# A --chat-template value holding one of these is the template itself, else a file's path
# (vLLM's rule).
_JINJA_CHARS = "{}\n"


def chat_template_arg(value: str) -> str:
    """vLLM's --chat-template: the template itself, or the path of a file holding it; checked
    to parse as Jinja, so that a broken template fails the start, not every request."""
    text = value
    if not any(c in value for c in _JINJA_CHARS):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(
                f"{value!r} looks like a file path, but it cannot be read ({exc.strerror}); "
                "give a template file or the template itself"
            ) from None
    import jinja2  # transformers renders templates with it

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(
            f"the chat template does not parse: {exc.message} (line {exc.lineno})"
        ) from None
    return text


@dataclass(frozen=True)
class LoopOptions:
    """How rank 0's engine loop (`tp_engine.server.rank0.engine_loop`) waits and gives up: set
    by the flags here, so the flags import no part of rank 0."""

    # Watchdog: the engine is dead when no step completes for this long while work is queued.
    # Generous, since a first step may compile kernels.
    iteration_timeout_s: float = 120.0
    # After SIGINT/SIGTERM, in-flight requests get this long to finish before they are aborted.
    shutdown_timeout_s: float = 10.0
    # Once dead, keep answering 503 this long before exiting (so health checks see it).
    dead_linger_s: float = 2.0
    # How long the API process gets to exit after Exit before it is killed.
    api_exit_timeout_s: float = 10.0


@dataclass(frozen=True)
class ServerArgs:
    host: str
    port: int
    api_key: str | None
    served_model_names: list[str] | None
    uvicorn_log_level: str
    disable_uvicorn_access_log: bool
    dist_backend: str | None
    loop: LoopOptions
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Admin routes (`tp_engine.server.api.admin_routes`): RL weight sync and pause; sleep and wake.
    enable_weight_updates: bool = False
    enable_sleep_mode: bool = False
    # SGLang's /update_weights_from_tensor: pickled tensor handles, read by a restricted
    # unpickler (`tp_engine.features.weights_and_sleep.tensor_payload`); off unless asked for.
    enable_weight_updates_from_tensor: bool = False
    # --lora-modules: adapters loaded at start-up, served by name (ids 1, 2, ... in order).
    lora_modules: list[LoRARequest] = field(default_factory=list)
    # --chat-template: the template's text (read from its file), replacing the tokenizer's.
    chat_template: str | None = None
    # --disaggregation-*: this server's role behind a prefill/decode router.
    disaggregation: DisaggregationOptions = field(default_factory=DisaggregationOptions)


def lora_module(item: str) -> LoRARequest:
    """One --lora-modules item: `name=path`, or JSON {"name", "path", "base_model_name"?}
    (vLLM's `LoRAParserAction`; its int id is set once all are parsed)."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return LoRARequest(name, 1, path)
    try:
        spec = json.loads(item)
        return LoRARequest(spec["name"], 1, spec["path"], spec.get("base_model_name"))
    except (ValueError, TypeError, KeyError) as exc:
        raise argparse.ArgumentTypeError(
            f"Invalid JSON format for --lora-modules: {item} ({exc})"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py",
        description="OpenAI-compatible server for Qwen3 on N tensor-parallel ranks.",
        epilog=ENVIRONMENT_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients use in 'model' (default: --model as given, as vLLM serves it); the "
        "first is reported",
    )
    p.add_argument(
        "--chat-template",
        type=chat_template_arg,
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="Jinja chat template for chat completions and chat embeddings: a file, or the "
        "template itself (default: the tokenizer's)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged)")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize, /detokenize and "
        f"/tokenizer_info (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        help="ranks; default torchrun's WORLD_SIZE, else 1 (N > 1 without torchrun starts N - 1 "
        "worker processes)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages, each a group of --tensor-parallel-size ranks holding its share of "
        "the layers (world = TP x PP ranks; $TP_ENGINE_PP_LAYER_PARTITION='a,b' sets the "
        "layers per stage, default an even split)",
    )
    p.add_argument(
        "--dist-backend",
        choices=["nccl", "gloo"],
        default=None,
        help="collectives between ranks (default: nccl with GPUs, gloo on CPU or when ranks "
        "share a GPU)",
    )
    dp = p.add_argument_group(
        "data parallelism",
        "N replicas of the engine (each a tensor-parallel group of --tensor-parallel-size "
        "ranks on its own devices) behind sglang-router (`pip install 'tp-engine[router]'`)",
    )
    dp.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="replicas behind the router on --host/--port (replica i gets devices i*M..i*M+M-1 "
        "for M = --tensor-parallel-size); default: one engine, no router",
    )
    dp.add_argument(
        "--router-policy",
        choices=ROUTER_POLICIES,
        default="cache_aware",
        help="how the router picks a replica (cache_aware: the one holding the longest prefix)",
    )
    dp.add_argument(
        "--restart-dead-replicas",
        action="store_true",
        help="restart a replica that died (without: the others keep serving)",
    )
    dp.add_argument(
        "--router-prometheus-port",
        type=int,
        default=29000,
        help="the router's own /metrics (requests per replica URL); each replica keeps its own",
    )
    # Set by the data-parallel launcher on the replicas it starts: serve one engine and end the
    # run if the launcher is gone (as torchrun's ranks do).
    p.add_argument("--replica-index", type=int, default=None, help=argparse.SUPPRESS)
    add_node_flags(p)
    p.add_argument(
        "--engine-iteration-timeout",
        type=float,
        default=120.0,
        help="seconds without a completed step, while requests wait, before the engine is "
        "declared dead (health 503, exit non-zero)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before abort",
    )
    p.add_argument(
        "--engine-dead-linger",
        type=float,
        default=2.0,
        help="seconds a dead server keeps answering 503 before it exits",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split chat output into reasoning_content and content (Qwen3's <think> blocks)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help="parse tool calls out of chat output (hermes: Qwen3's <tool_call> blocks)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide when to call tools (tool_choice 'auto'); needs "
        "--tool-call-parser",
    )
    p.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="offer the RL routes: weight updates from disk or a trainer's process group "
        "(SGLang's /update_weights_from_*), pause and resume, cache flushes",
    )
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="offer /sleep, /wake_up, /is_sleeping (and SGLang's /release_memory_occupation, "
        "/resume_memory_occupation): give the GPU's memory back while a trainer runs",
    )
    # The engine's own flags: one table (`tp_engine.config.flags`) for every script.
    groups = add_engine_flags(p)
    groups["lora"].add_argument(
        "--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
        help='adapters a request picks by its "model": name=path, or JSON \'{"name": ..., '
        '"path": ..., "base_model_name": ...}\'',
    )  # fmt: skip
    p.add_argument("--uvicorn-log-level", default="info", help="the HTTP server's log level")
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no log line per request"
    )
    limits = p.add_argument_group(
        "request limits and access", "what one request may cost, and who may send one"
    )
    defaults = RequestLimits()
    limits.add_argument(
        "--max-request-body-bytes", type=int, default=defaults.max_body_bytes,
        help="larger request bodies get a 413 before they are read",
    )  # fmt: skip
    limits.add_argument(
        "--allowed-hosts", nargs="+", default=None, metavar="NAME",
        help="Host header names to answer to besides localhost, 127.0.0.1, [::1] and --host "
        "(others get a 421: DNS rebinding); '*' for any. A wildcard --host (0.0.0.0) without "
        "this flag answers to any name",
    )  # fmt: skip
    limits.add_argument(
        "--protect-metrics-and-docs", action="store_true",
        help="/metrics, /docs, /redoc and /openapi.json need the API key too (open by default, "
        "as in vLLM)",
    )  # fmt: skip
    limits.add_argument(
        "--max-constraint-bytes", type=int, default=defaults.max_constraint_bytes,
        help="largest JSON schema, regex, grammar or tool parameter schema a request may give",
    )  # fmt: skip
    limits.add_argument(
        "--max-constraint-depth", type=int, default=defaults.max_constraint_depth,
        help="deepest nesting of a JSON schema or tool parameter schema",
    )  # fmt: skip
    hicache = p.add_argument_group(
        "hierarchical cache (SGLang's spelling of --kv-offloading-size)",
        "a host-memory KV tier below the GPU's, as SGLang's HiCache flags ask for it",
    )
    hicache.add_argument(
        "--enable-hierarchical-cache", action="store_true",
        help="a host-memory KV tier of --hicache-size GiB per rank (= --kv-offloading-size)",
    )  # fmt: skip
    hicache.add_argument(
        "--hicache-size", type=float, default=None, metavar="GIB",
        help="GiB of host memory per rank for it (SGLang's --hicache-ratio is not supported: "
        "give the size; default: none)",
    )  # fmt: skip
    sglang_spec = p.add_argument_group(
        "speculative decoding (SGLang's spelling of --speculative-config)",
        "an EAGLE-3 head as SGLang's flags name it; the same as --speculative-config "
        '\'{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}\'',
    )
    sglang_spec.add_argument(
        "--speculative-algorithm", default=None, metavar="EAGLE3",
        help="EAGLE3 (an EAGLE-3 head, SpecForge/SGLang or vLLM speculators layout)",
    )  # fmt: skip
    sglang_spec.add_argument(
        "--speculative-draft-model-path", default=None, metavar="DIR",
        help="the head's directory",
    )  # fmt: skip
    sglang_spec.add_argument(
        "--speculative-num-steps", type=int, default=None, metavar="K",
        help="drafts per step, chained (default: 3)",
    )  # fmt: skip
    p.add_argument(
        "--enable-weight-updates-from-tensor", action="store_true",
        help="also offer SGLang's /update_weights_from_tensor (slime's colocated weight sync): "
        "its body is pickled tensor handles, read by an unpickler that admits only torch's "
        "tensor rebuild functions; needs --enable-weight-updates",
    )  # fmt: skip
    add_disaggregation_flags(p)
    return p


def engine_config(args: argparse.Namespace, tp_size: int) -> EngineConfig:
    """The engine's config; raises ValueError (before any process starts) on a bad value."""
    kwargs = engine_kwargs(args)
    # --lora-modules serves adapters, so it turns LoRA on as vLLM's does.
    kwargs["enable_lora"] = args.enable_lora or bool(args.lora_modules)
    if args.enable_hierarchical_cache or args.hicache_size is not None:
        kwargs["kv_offloading_size"] = hierarchical_cache_size(args)
    sglang_spec = SpeculativeConfig.from_sglang(
        args.speculative_algorithm, args.speculative_draft_model_path, args.speculative_num_steps
    )
    if sglang_spec is not None:
        if args.speculative_config is not None:
            raise ValueError("give --speculative-config or --speculative-algorithm, not both")
        kwargs["speculative_config"] = sglang_spec
    if args.disaggregation_mode == "decode":  # off unless asked for, as SGLang's decode
        kwargs["enable_prefix_caching"] = args.disaggregation_decode_enable_radix_cache
    pp = args.pipeline_parallel_size
    if pp > 1 and args.data_parallel_size is not None:  # beyond the engine's config
        raise ValueError(
            f"--data-parallel-size is not supported with pipeline_parallel_size={pp} yet"
        )
    return EngineConfig(
        model=args.model, tensor_parallel_size=tp_size, pipeline_parallel_size=pp, **kwargs
    )


def hierarchical_cache_size(args: argparse.Namespace) -> float:
    """SGLang's `--enable-hierarchical-cache --hicache-size GIB` as `kv_offloading_size`."""
    if not args.enable_hierarchical_cache:
        raise ValueError("--hicache-size needs --enable-hierarchical-cache")
    if args.hicache_size is None:
        raise ValueError(
            "--enable-hierarchical-cache needs --hicache-size GiB (SGLang's --hicache-ratio is "
            "not supported)"
        )
    if args.kv_offloading_size is not None and args.kv_offloading_size != args.hicache_size:
        raise ValueError("give --kv-offloading-size or --hicache-size, not both")
    return args.hicache_size


def server_args(args: argparse.Namespace) -> ServerArgs:
    for name in ("engine_iteration_timeout", "shutdown_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.engine_dead_linger < 0:
        raise ValueError("--engine-dead-linger must be >= 0")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key == "":
        raise ValueError("--api-key must not be empty")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    if args.protect_metrics_and_docs and args.api_key is None:
        raise ValueError("--protect-metrics-and-docs needs --api-key (the key is what opens them)")
    for name in ("max_request_body_bytes", "max_constraint_bytes", "max_constraint_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.structured_outputs_timeout_s <= 0:
        raise ValueError("--structured-outputs-timeout must be > 0")
    lora_modules = [
        LoRARequest(m.lora_name, i, m.lora_path, m.base_model_name)
        for i, m in enumerate(args.lora_modules or [], start=1)
    ]
    names = [m.lora_name for m in lora_modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must differ, got {names}")
    return ServerArgs(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=args.served_model_name,
        uvicorn_log_level=args.uvicorn_log_level,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        dist_backend=args.dist_backend,
        loop=LoopOptions(
            iteration_timeout_s=args.engine_iteration_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
            dead_linger_s=args.engine_dead_linger,
        ),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        enable_weight_updates=args.enable_weight_updates,
        enable_sleep_mode=args.enable_sleep_mode,
        enable_weight_updates_from_tensor=args.enable_weight_updates_from_tensor,
        lora_modules=lora_modules,
        chat_template=args.chat_template,
        disaggregation=disaggregation_options(args),
        limits=RequestLimits(
            max_body_bytes=args.max_request_body_bytes,
            allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
            protect_metrics_and_docs=args.protect_metrics_and_docs,
            max_constraint_bytes=args.max_constraint_bytes,
            max_constraint_depth=args.max_constraint_depth,
            constraint_timeout_s=args.structured_outputs_timeout_s,
        ),
    )


def served_names(args: ServerArgs, model: str | None) -> list[str]:
    if args.served_model_names:
        return list(args.served_model_names)
    return [model if model else DEMO_MODEL_NAME]
