"""Demo assets for the README's "Try it on the demo model" walkthroughs, made from the demo model
(random weights, nothing downloaded):

    python launch/demo_assets.py                 # writes ./demo-assets (--out DIR elsewhere)

    demo-assets/Qwen3-Embedding-demo/   the demo model as Qwen3-Embedding is published
                                        (sentence-transformers files: served as an embedder)
    demo-assets/Qwen3-Reranker-demo/    the demo model as Qwen3-Reranker is published ("no" and
                                        "yes" tokens; served with vLLM's reranker overrides)
    demo-assets/adapters/sql, chat, math  PEFT LoRA adapters of the demo model (random, non-zero)

An asset already written is kept (delete the directory to rebuild it). Each is written to a
temporary directory first and renamed into place, so an interrupted run leaves nothing
half-written. The vectors, scores and texts are those of random weights: the walkthroughs show
the API, not the quality.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from tp_engine.demo import demo_checkpoint_dir
from tp_engine.testing.pooling_checkpoints import embedding_layout, reranker_layout

# name -> (rank, alpha, target modules, seed): different ranks and modules, so the three
# adapters give three different outputs in one batch.
ADAPTERS = {
    "sql": (8, 16, ["q_proj", "v_proj"], 1),
    "chat": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 2),
    "math": (4, 8, ["o_proj", "down_proj"], 3),
}  # fmt: skip


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-able projection of a Qwen3 layer."""
    hidden, head_dim = config["hidden_size"], config.get("head_dim")
    head_dim = head_dim or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


def write_peft_adapter(
    base: Path, out: Path, rank: int, alpha: int, modules: list[str], seed: int
) -> Path:
    """A PEFT LoRA adapter of `base` as `peft` saves one (adapter_config.json,
    adapter_model.safetensors), A and B random and non-zero (PEFT's default B is zero, which
    would make the adapter the base model)."""
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    shapes = module_shapes(config)
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            fan_in, fan_out = shapes[module]
            parent = "self_attn" if module in attention else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.1
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def build_once(target: Path, build: Callable[[Path], object]) -> str:
    """`build(tmp)` renamed to `target`, unless `target` exists already."""
    if target.exists():
        return "kept"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp / "asset")
        (tmp / "asset").rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return "written"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="demo-assets", help="directory to write the assets to")
    args = p.parse_args(argv)
    out = Path(args.out)
    demo = demo_checkpoint_dir()
    jobs: dict[Path, Callable[[Path], object]] = {
        out / "Qwen3-Embedding-demo": lambda d: embedding_layout(demo, d),
        out / "Qwen3-Reranker-demo": lambda d: reranker_layout(demo, d),
    }
    for name, (rank, alpha, modules, seed) in ADAPTERS.items():
        jobs[out / "adapters" / name] = lambda d, r=rank, a=alpha, m=modules, s=seed: (
            write_peft_adapter(demo, d, r, a, m, s)
        )
    for target, build in jobs.items():
        print(f"{build_once(target, build):8} {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
