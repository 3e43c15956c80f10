"""The API process's start-up: how long it takes, how much memory it holds, what it imports.

    python benchmarks/api_process.py --repeats 5 --out result.json

Each repeat starts a fresh interpreter that does what `tp_engine.server.api.app.main` does
before it serves: import the app module (and uvicorn, and transformers' AutoTokenizer where the
app has no tokenizer loader of its own), connect to rank 0's pipes, take Hello, load the tokenizer, resolve the chat
parsers, build the `EngineClient` and the FastAPI app, and bind uvicorn's socket; then it says
Ready. This process plays rank 0: it binds the pipes and sends Hello as soon as the child has
connected (so no weight loading is waited for). Hello turns every optional route on (weight
updates, sleep mode, tensor updates, runtime LoRA, Qwen3's reasoning and tool-call parsers),
so that every module a route needs is imported; the tokenizer is Qwen3's own (151,669 tokens).

Per repeat, from the child: `import_s` (the imports), `tokenizer_s`, `build_s` (parsers,
client, app, socket), `max_rss_mib` (`resource.getrusage`, the child's peak resident memory),
and the number of modules in `sys.modules` under `torch`, `triton`, `kernels` and
`rank_worker`; from this process: `ready_s`, the wall time from starting the child to its
Ready (the interpreter's own start included). The summary has min and median of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "triton", "kernels", "rank_worker")


def child(run_dir: str, parent_pid: int) -> None:
    """One API process start-up, timed; prints one JSON line."""
    t0 = time.perf_counter()
    import resource

    import uvicorn

    from shm_ipc.liveness import ProcessWatch
    from tp_engine.server.api import app as app_module
    from tp_engine.server.api.chat_parsers import ChatParsing
    from tp_engine.server.api.engine_client import EngineClient
    from tp_engine.server.api.metrics import ServerMetrics
    from tp_engine.server.ipc import ApiPipes
    from tp_engine.server.messages import Ready

    # The API process's own loader (torch-free), or AutoTokenizer before it had one.
    load = getattr(app_module, "load_tokenizer", None)
    if load is None:
        from transformers import AutoTokenizer

        load = AutoTokenizer.from_pretrained
    t1 = time.perf_counter()
    pipes = ApiPipes(run_dir)
    hello = app_module._wait_for_hello(pipes, ProcessWatch(parent_pid))
    assert hello is not None, "rank 0 sent no Hello"
    t2 = time.perf_counter()
    tokenizer = load(hello.tokenizer_dir or hello.model_dir)
    t3 = time.perf_counter()
    parsing = ChatParsing.resolve(
        tokenizer, hello.reasoning_parser, hello.tool_call_parser, hello.enable_auto_tool_choice
    )
    client = EngineClient(
        pipes, hello, ServerMetrics(hello.served_model_names[0]), run_dir, parent_pid
    )
    app = app_module.build_app(client, tokenizer, None, parsing)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    uvicorn.Server(config)
    sock = config.bind_socket()
    t4 = time.perf_counter()
    pipes.send(Ready(port=sock.getsockname()[1]))
    sock.close()
    loaded = {p: sum(1 for m in sys.modules if m == p or m.startswith(p + ".")) for p in PACKAGES}
    record = {
        "import_s": t1 - t0,
        "tokenizer_s": t3 - t2,
        "build_s": t4 - t3,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "modules": loaded,
        "num_modules": len(sys.modules),
    }
    print("RESULT " + json.dumps(record), flush=True)
    pipes.close()


def hello_for(tokenizer_dir: str) -> Any:
    from tp_engine.server.messages import Hello

    return Hello(
        model_dir=tokenizer_dir,
        served_model_names=["bench"],
        max_model_len=4096,
        vocab_size=151_936,
        generation_defaults={},
        api_key=None,
        tensor_parallel_size=1,
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        enable_weight_updates=True,
        enable_sleep_mode=True,
        enable_weight_updates_from_tensor=True,
        enable_lora=True,
    )


def one_run(tokenizer_dir: str) -> dict[str, Any]:
    from tp_engine.server.ipc import EnginePipes, RunDir
    from tp_engine.server.messages import Exit, Ready

    run = RunDir.create()
    pipes = EnginePipes(run)
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", run.path, str(os.getpid())],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sent = pipes.send_once_connected(
            hello_for(tokenizer_dir), keep_waiting=lambda: proc.poll() is None, timeout_s=120
        )
        assert sent, "the child never connected"
        ready_s = None
        deadline = time.monotonic() + 120
        while ready_s is None and time.monotonic() < deadline and proc.poll() is None:
            if pipes.poll(0.01) and isinstance(pipes.recv_nowait(), Ready):
                ready_s = time.perf_counter() - start
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            pipes.send(Exit(1))
            proc.kill()
            proc.wait()
        pipes.close()
        run.remove()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert ready_s is not None and lines, f"the child failed (exit {proc.returncode})"
    return {"ready_s": ready_s, **json.loads(lines[-1][len("RESULT ") :])}


def run_under(tokenizer_dir: str, root: Path) -> dict[str, Any]:
    """`one_run` in an interpreter that imports the checkout at `root`, so that rank 0's side
    (the pipes, Hello) speaks that checkout's protocol too."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, __file__, "--one-run", tokenizer_dir],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RUN "))[4:])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("ready_s", "import_s", "tokenizer_s", "build_s", "max_rss_mib")
    summary: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in runs]
        summary[key] = {"min": min(values), "median": statistics.median(values)}
    summary["modules"] = runs[-1]["modules"]
    summary["num_modules"] = runs[-1]["num_modules"]
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--compare",
        type=Path,
        default=None,
        metavar="ROOT",
        help="also measure the checkout at ROOT (e.g. an older commit's files), alternating "
        "with this one run by run, so that both see the same load; its results go to the "
        "JSON's 'compare' entry",
    )
    p.add_argument("--child", nargs=2, metavar=("RUN_DIR", "PARENT_PID"), help=argparse.SUPPRESS)
    p.add_argument("--one-run", metavar="TOKENIZER_DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child[0], int(args.child[1]))
        return
    if args.one_run is not None:  # rank 0's side, with the messages of the checkout measured
        print("RUN " + json.dumps(one_run(args.one_run)), flush=True)
        return
    sys.path.insert(0, str(ROOT))
    from tp_engine.testing.tokenizers import build_qwen3_tokenizer

    with tempfile.TemporaryDirectory() as tok_dir:
        build_qwen3_tokenizer(tok_dir)
        # What /model_info reads from a checkpoint (the app reads it once, at build time).
        config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
        (Path(tok_dir) / "config.json").write_text(json.dumps(config))
        roots = {"this": ROOT} if args.compare is None else {"this": ROOT, "compare": args.compare}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in roots}
        for i in range(args.repeats):
            for name, root in roots.items():
                runs[name].append(run_under(tok_dir, root))
                r = runs[name][-1]
                print(
                    f"run {i + 1} ({name}: {root}): ready {r['ready_s']:.3f} s (import "
                    f"{r['import_s']:.3f}, tokenizer {r['tokenizer_s']:.3f}, build "
                    f"{r['build_s']:.3f}), max RSS {r['max_rss_mib']:.1f} MiB, modules "
                    f"{r['modules']}",
                    flush=True,
                )
    result: dict[str, Any] = {"python": sys.version.split()[0]}
    for name, root in roots.items():
        s = summarize(runs[name])
        entry = {"root": str(root), "runs": runs[name], "summary": s}
        if name == "this":
            result.update(entry)
        else:
            result[name] = entry
        print(
            f"{name} min/median: ready {s['ready_s']['min']:.3f}/{s['ready_s']['median']:.3f} s, "
            f"import {s['import_s']['min']:.3f}/{s['import_s']['median']:.3f} s, "
            f"max RSS {s['max_rss_mib']['min']:.1f}/{s['max_rss_mib']['median']:.1f} MiB, "
            f"modules {s['modules']} of {s['num_modules']}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
