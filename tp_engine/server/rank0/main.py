"""What each process of `launch/serve.py` does, and rank 0's start-up and clean-up.

    torchrun --nproc-per-node N launch/serve.py ...   every rank runs `main`:
        rank 0      → `Rank0Server`: engine + API process + engine loop
        rank 1..N-1 → `rank_worker.dist.bringup.serve_as_worker` until rank 0 sends EXIT
    python launch/serve.py [--tensor-parallel-size N]   this process is rank 0 (and starts
                                                        ranks 1..N-1 itself when N > 1)
    python launch/serve.py --data-parallel-size D ...   the launcher of D such runs (replicas)
                                                        behind sglang-router (`replicas`)

Signals: only rank 0 acts on SIGINT/SIGTERM (a graceful drain, see `engine_loop`). Workers
ignore both, because torchrun and a terminal's Ctrl-C signal every rank at once, and a worker
that died first would turn a graceful shutdown into a failed step; they exit when rank 0 tells
them to or, if rank 0 dies, through their owner watchdog. The API process runs in its own
session for the same reason and exits when rank 0 says so or disappears.

A killed launcher: under torchrun every rank watches the agent that started it
(`rank_worker.dist.launcher_watch`), and rank 0 of a data-parallel replica watches the launcher of
the replicas in the same way. When it is gone, rank 0 ends the run as a dead engine does (no
drain, no linger: in-flight requests fail, the API process and the workers are told to exit) and
exits 1; if its main thread cannot get there within `RANK0_GRACE_S`, the watch thread stops the
API process and leaves, and the workers follow rank 0.

Rank 0's start-up order: socket directory and the API process first (its imports overlap the
weight loading), then the engine, Hello, and Ready; socket files are removed once both sides
are connected. Whatever happens, the workers are told to exit (or killed), the API process is
stopped and nothing named is left in the file system or /dev/shm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rank_worker.dist import bringup
from rank_worker.dist.launcher_watch import RANK0_GRACE_S, LauncherWatch
from rank_worker.models.model_spec import ModelSpec
from shm_ipc.liveness import ParentWatch
from tp_engine.config import EngineConfig
from tp_engine.server.api.guards import exposure_warning
from tp_engine.server.args import (
    ServerArgs,
    build_parser,
    engine_config,
    served_names,
    server_args,
)
from tp_engine.server.ipc import EnginePipes, RunDir
from tp_engine.server.messages import Dead, Exit, Hello, Ready
from tp_engine.server.nodes import node_spec
from tp_engine.server.rank0.disagg.serving import Disaggregation
from tp_engine.server.rank0.engine_loop import EXIT_FAILED, EngineLoop
from tp_engine.server.rank0.watchdog import stop_api_process

if TYPE_CHECKING:
    from tp_engine.engine import LLMEngine

logger = logging.getLogger("tp_engine.server")

# How long rank 0 waits for the API process to import, load the tokenizer and listen.
_API_READY_TIMEOUT_S = 300.0
_WORKER_EXIT_TIMEOUT_S = 10.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Torchrun's variables make no sense in the API process, which is no rank.
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


def main(argv: list[str] | None = None) -> int:
    launcher = bringup.torchrun_launcher()  # first: see rank_worker.dist.bringup
    # Watched only by a data-parallel replica (its parent is the launcher of the replicas).
    parent = ParentWatch() if launcher is None else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:  # every argument is checked before any process starts
        tp_size = bringup.tensor_parallel_size(
            args.tensor_parallel_size, args.pipeline_parallel_size
        )
        config = engine_config(args, tp_size)
        sargs = server_args(args)
        node = node_spec(args, config.world_size, under_torchrun=launcher is not None)
    except ValueError as exc:
        parser.error(str(exc))
    warning = exposure_warning(sargs.host, sargs.api_key)
    if warning is not None and (launcher is None or bringup.torchrun_rank() == 0):
        logger.warning("%s\n%s\n%s", "!" * 80, warning, "!" * 80)

    if args.data_parallel_size is not None and args.replica_index is None:
        if launcher is not None:
            parser.error("--data-parallel-size starts its own replicas: run it with python")
        from tp_engine.server.rank0.replicas import ReplicaSet

        try:
            replicas = ReplicaSet(args, argv, tp_size)
        except ValueError as exc:
            parser.error(str(exc))
        return replicas.run()

    if launcher is not None and bringup.torchrun_rank() != 0:
        for sig in _STOP_SIGNALS:  # see the module docstring
            signal.signal(sig, signal.SIG_IGN)
        return bringup.serve_as_worker(
            bringup.start(config.world_size, sargs.dist_backend, launcher)
        )
    if node is not None and node.node_rank > 0:  # headless: this node's ranks serve rank 0
        with _signals_ignored():
            ranks = bringup.start(config.world_size, sargs.dist_backend, None, node)
        return bringup.serve_as_worker(ranks)
    with _signals_ignored():  # spawned children inherit SIG_IGN across exec; see the docstring
        ranks = bringup.start(config.world_size, sargs.dist_backend, launcher, node)
    replica_launcher = parent if args.replica_index is not None else None
    return Rank0Server(config, sargs, ranks, replica_launcher).run()


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Rank0Server:
    def __init__(
        self,
        config: EngineConfig,
        args: ServerArgs,
        ranks: bringup.Ranks,
        replica_launcher: ParentWatch | None = None,
    ) -> None:
        self.config = config
        self.args = args
        self.ranks = ranks
        self.tp = ranks.tp
        # Watched: torchrun's agent, or the data-parallel launcher of this replica; None when
        # this process is the launcher.
        self.launcher = ranks.launcher or replica_launcher
        self.loop: EngineLoop | None = None
        self._stop_signal: int | None = None
        # Set (from the launcher watch's thread) once the launcher is gone: why the run ends.
        self._launcher_gone: str | None = None
        # Made by `_serve` in this order; `_clean_up` releases whatever exists.
        self.run_dir: RunDir | None = None
        self.pipes: EnginePipes | None = None
        self.api: subprocess.Popen | None = None
        self.engine: LLMEngine | None = None
        self.pd: Disaggregation | None = None

    def run(self) -> int:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        watch = None
        if self.launcher is not None:
            watch = LauncherWatch(
                self.launcher,
                "the launcher",
                self._on_launcher_gone,
                grace_s=RANK0_GRACE_S,
                exit_code=EXIT_FAILED,
                on_overdue=self._abandon,
            ).start()
        code = EXIT_FAILED
        try:
            code = self._serve()
            return code
        finally:
            self._clean_up(dead=code != 0)
            if watch is not None:
                watch.stop()

    def _serve(self) -> int:
        self.run_dir = RunDir.create()
        self.pipes = pipes = EnginePipes(self.run_dir)
        self.api = api = self._start_api_process(self.run_dir)
        from tp_engine.engine import LLMEngine  # deferred: pulls in the model code

        # Its role behind a prefill/decode router: the ranks' KV agents report to it.
        self.pd = pd = Disaggregation.prepare(self.args.disaggregation, self.args.host)
        config = self.config
        if pd is not None:
            config = dataclasses.replace(config, disaggregation=pd.settings())
        self.engine = engine = LLMEngine(config, self.tp, self.ranks.fault)
        if pd is not None:
            pd.start(engine)
        if self._launcher_gone is not None:
            logger.error("%s during start-up: exiting", self._launcher_gone)
            return EXIT_FAILED
        if self._stop_signal is not None:
            logger.info("signal %s during start-up: exiting", self._stop_signal)
            pipes.send(Exit(0))
            return 0
        names = served_names(self.args, self.config.model)
        for adapter in self.args.lora_modules:  # as vLLM, start-up fails if one cannot load
            engine.add_lora(adapter)
        hello_sent = pipes.send_once_connected(
            Hello(
                model_dir=str(engine.model_dir),
                served_model_names=names,
                max_model_len=int(engine.config.max_model_len or 0),
                vocab_size=int(engine.vocab_size),
                generation_defaults=dict(engine.generation_defaults),
                api_key=self.args.api_key,
                tensor_parallel_size=self.config.tensor_parallel_size,
                reasoning_parser=self.args.reasoning_parser,
                tool_call_parser=self.args.tool_call_parser,
                enable_auto_tool_choice=self.args.enable_auto_tool_choice,
                limits=self.args.limits.to_wire(),
                enable_weight_updates=self.args.enable_weight_updates,
                enable_sleep_mode=self.args.enable_sleep_mode,
                enable_weight_updates_from_tensor=self.args.enable_weight_updates_from_tensor,
                supported_tasks=supported_tasks(engine.model_spec),
                pooled_size=engine.model_spec.hidden_size,
                is_matryoshka=engine.model_spec.is_matryoshka,
                class_labels=list(engine.model_spec.class_labels),
                enable_lora=engine.lora is not None,
                lora_modules=list(self.args.lora_modules),
                tokenizer_dir=self.config.tokenizer,
                chat_template=self.args.chat_template,
                disaggregation_mode=self.args.disaggregation.mode,
            ),
            keep_waiting=lambda: (
                api.poll() is None and self._stop_signal is None and self._launcher_gone is None
            ),
            timeout_s=_API_READY_TIMEOUT_S,
        )
        if not hello_sent:
            if self._launcher_gone is not None:
                logger.error("%s during start-up: exiting", self._launcher_gone)
                return EXIT_FAILED
            if self._stop_signal is not None:
                logger.info("signal %s during start-up: exiting", self._stop_signal)
                return 0
            logger.error("the API process never connected (exit code %s)", api.poll())
            return EXIT_FAILED
        port = self._wait_for_ready(pipes, api)
        if port is None:
            stopped = self._stop_signal is not None and self._launcher_gone is None
            return 0 if stopped else EXIT_FAILED
        self.run_dir.remove()  # both sides are connected; the names are no longer needed
        logger.info(
            "serving %s (tensor parallel %d%s) on http://%s:%d",
            names[0],
            self.config.tensor_parallel_size,
            ""
            if self.config.pipeline_parallel_size == 1
            else f", pipeline parallel {self.config.pipeline_parallel_size}",
            _url_host(self.args.host),
            port,
        )
        self.loop = EngineLoop(engine, pipes, api, self.args.loop, self._fatal, pd)
        if self._stop_signal is not None:
            self.loop.request_stop(self._stop_signal)
        if self._launcher_gone is not None:  # gone while the loop was being made
            self.loop.end_now(self._launcher_gone)
        return self.loop.run()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop_signal is not None:
            logger.info("signal %d: already shutting down", signum)
            return
        self._stop_signal = signum
        if self.loop is not None:
            self.loop.request_stop(signum)

    def _start_api_process(self, run_dir: RunDir) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
        repo_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        cmd = [
            sys.executable,
            "-m",
            "tp_engine.server.api.app",
            "--run-dir",
            run_dir.path,
            "--parent-pid",
            str(os.getpid()),
            "--host",
            self.args.host,
            "--port",
            str(self.args.port),
            "--uvicorn-log-level",
            self.args.uvicorn_log_level,
        ]
        if self.args.disable_uvicorn_access_log:
            cmd.append("--disable-uvicorn-access-log")
        # Its own session: a terminal's Ctrl-C reaches rank 0, which then drains and stops it.
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait_for_ready(self, pipes: EnginePipes, api: subprocess.Popen) -> int | None:
        deadline = time.monotonic() + _API_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._launcher_gone is not None:
                logger.error("%s during start-up: exiting", self._launcher_gone)
                pipes.send(Exit(EXIT_FAILED))
                return None
            if self._stop_signal is not None:
                pipes.send(Exit(0))
                return None
            if api.poll() is not None:
                logger.error(
                    "the API process exited with code %s before serving (its log says why)",
                    api.returncode,
                )
                return None
            if pipes.poll(0.1):
                msg = pipes.recv_nowait()
                if isinstance(msg, Ready):
                    return msg.port
        logger.error("the API process did not start listening in %.0f s", _API_READY_TIMEOUT_S)
        return None

    def _clean_up(self, dead: bool) -> None:
        engine, api, pipes = self.engine, self.api, self.pipes
        if api is not None and api.poll() is None:
            if pipes is not None:
                pipes.send(Exit(1 if dead else 0))
            stop_api_process(api, timeout_s=5.0)
        if self.pd is not None:
            self.pd.close()
        if engine is not None:
            engine.shutdown()  # workers exit (told EXIT, or the channel closes under them)
        self.ranks.release(
            dead=dead or engine is None, worker_exit_timeout_s=_WORKER_EXIT_TIMEOUT_S
        )
        if pipes is not None:
            pipes.close()
        if self.run_dir is not None:
            self.run_dir.remove()

    def _on_launcher_gone(self, message: str) -> None:
        """From the launcher watch's thread: end the run at once, as a dead engine does."""
        logger.error("%s: ending the run", message)
        self._launcher_gone = message
        if self.loop is not None:
            self.loop.end_now(message)

    def _abandon(self, message: str) -> None:
        """From the launcher watch's thread, when the orderly shutdown did not finish in time
        (the main thread is stuck, e.g. in a collective): stop the API process and leave."""
        api, pipes = self.api, self.pipes
        if api is not None and api.poll() is None:
            # Best effort: the main thread may have closed the pipes by now.
            with contextlib.suppress(Exception):
                if pipes is not None:
                    pipes.send(Dead(message))
                    pipes.send(Exit(EXIT_FAILED))
            try:
                api.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                api.kill()
                api.wait()
        self._fatal(EXIT_FAILED)

    def _fatal(self, code: int) -> None:
        """From the watchdog's (or the launcher watch's) thread, with rank 0's main thread stuck
        in a step: leave now."""
        if self.ranks.group is not None:
            self.ranks.group.kill()
        if self.run_dir is not None:
            self.run_dir.remove()
        logging.shutdown()
        os._exit(code)


def supported_tasks(spec: ModelSpec) -> list[str]:
    """vLLM's task names for what the model serves, which decide the API's routes: scores
    come from an embedding model (cosine) or a one-label classifier (a reranker)."""
    if spec.task == "generate":
        return ["generate"]
    if spec.task == "embed" or spec.head.num_scores == 1:
        return [spec.task, "score"]
    return [spec.task]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
