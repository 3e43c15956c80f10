"""Random-weight Qwen3 and Qwen3-MoE checkpoints made locally, in the Hugging Face layout.

The built-in demo model (served when no `--model` is given), the tests and the benchmarks need
checkpoints on machines that cannot download one. This module writes the same files a real
Qwen3 (or Qwen3-MoE) export has (config.json, generation_config.json, safetensors, optionally
sharded with model.safetensors.index.json, and tokenizer files with a ChatML chat template), so
that everything downstream, transformers included, loads them as it would a real model. MoE
checkpoints hold one tensor per expert and projection, under the published names
(`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, router `mlp.gate.weight`), and
their config.json spells the expert count `num_experts` as the published ones do.

Weights are written tensor by tensor rather than through `Qwen3ForCausalLM`, so that a
real-size checkpoint (the benchmarks' `QWEN3_PRESETS["32B"]`) never needs the whole model in
host memory at once: only the shard being written. The tensor names and shapes are
transformers' own (the tests load the result with `Qwen3ForCausalLM.from_pretrained` and check
nothing is missing).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tp_engine.testing.tokenizers import ENDOFTEXT, IM_END, TOKENIZERS

# Standard deviation of the logits of a random model: large enough that greedy decoding
# follows the context rather than one token that wins everywhere, small enough that sampling at
# temperature 1 is not greedy in disguise.
_LOGIT_STD = 3.0
# Embedding scale. A tied head scores every token by its own input embedding, so an embedding
# that dominates the residual stream makes greedy decoding repeat the last token forever; tied
# models get embeddings small next to the layer outputs (O(1) per feature).
_EMBED_STD_UNTIED = 1.0
_EMBED_STD_TIED = 0.05
# Router logits' standard deviation (the router's input is normed): trained routers are sharp,
# and sharp random ones give top-k choices clear margins, so that the reorderings of fp32 sums
# between tensor-parallel sizes never swap an expert (the MoE tests check the margins).
ROUTER_SCALE = 4.0


def _random_tensor(
    name: str,
    shape: tuple[int, ...],
    *,
    hidden_size: int,
    embed_std: float,
    gen: torch.Generator,
    router_scale: float = ROUTER_SCALE,
) -> torch.Tensor:
    """A random fp32 tensor for the checkpoint tensor `name`.

    Scaled so that activations stay O(1) through any depth: linear weights ~ N(0, 1/fan_in),
    norm weights ~ 1 ± 0.1 (non-trivial, so a misplaced norm shows up in the tests). The final
    norm sets the logit scale for a tied and an untied head alike: its output has RMS
    `_LOGIT_STD / (sqrt(hidden) * embed_std)`, and a logit sums `hidden` such products. A MoE
    router (`mlp.gate.weight`) gives logits of standard deviation `router_scale`.
    """
    if name.endswith(".mlp.gate.weight"):
        return router_scale * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("norm.weight"):
        w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        if name == "model.norm.weight":
            w *= _LOGIT_STD / (math.sqrt(hidden_size) * embed_std)
        return w
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return embed_std * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def _dense_mlp_shapes(
    prefix: str, hidden_size: int, intermediate_size: int
) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (f"{prefix}.mlp.gate_proj.weight", (intermediate_size, hidden_size)),
        (f"{prefix}.mlp.up_proj.weight", (intermediate_size, hidden_size)),
        (f"{prefix}.mlp.down_proj.weight", (hidden_size, intermediate_size)),
    ]


def _model_shapes(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    mlp: Callable[[str, int], list[tuple[str, tuple[int, ...]]]],
) -> list[tuple[str, tuple[int, ...]]]:
    """Embedding, layers (attention, norms, then `mlp(prefix, layer)`), final norm, head."""
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden_size))
    ]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden_size,)),
            (f"{p}.self_attn.q_proj.weight", (num_heads * head_dim, hidden_size)),
            (f"{p}.self_attn.k_proj.weight", (num_kv_heads * head_dim, hidden_size)),
            (f"{p}.self_attn.v_proj.weight", (num_kv_heads * head_dim, hidden_size)),
            (f"{p}.self_attn.o_proj.weight", (hidden_size, num_heads * head_dim)),
            (f"{p}.self_attn.q_norm.weight", (head_dim,)),
            (f"{p}.self_attn.k_norm.weight", (head_dim,)),
            (f"{p}.post_attention_layernorm.weight", (hidden_size,)),
            *mlp(p, i),
        ]
    shapes.append(("model.norm.weight", (hidden_size,)))
    if not tie_word_embeddings:
        shapes.append(("lm_head.weight", (vocab_size, hidden_size)))
    return shapes


def _write_safetensors(
    out_dir: Path,
    shapes: list[tuple[str, tuple[int, ...]]],
    *,
    hidden_size: int,
    embed_std: float,
    dtype: torch.dtype,
    seed: int,
    max_shard_bytes: int | None,
    router_scale: float = ROUTER_SCALE,
) -> None:
    """Generate and write the tensors, one shard in memory at a time."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if max_shard_bytes is not None and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = (
            "model.safetensors"
            if max_shard_bytes is None
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        tensors = {
            name: _random_tensor(
                name,
                shape,
                hidden_size=hidden_size,
                embed_std=embed_std,
                gen=gen,
                router_scale=router_scale,
            ).to(dtype)
            for name, shape in group
        }
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    if max_shard_bytes is not None:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_random_qwen3(
    out_dir: str | Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    max_shard_bytes: int | None = None,
    rope_theta: float = 1_000_000.0,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: str = "test",
) -> Path:
    """Write a random-weight Qwen3 checkpoint (config, generation config, weights, tokenizer).

    `vocab_size` None uses the tokenizer's size; a larger value pads the embedding table as
    real checkpoints do (Qwen3's 151936 rows exceed its tokenizer). `tokenizer`: "test" (a
    640-token BPE trained here) or "qwen3" (Qwen3's own, `build_qwen3_tokenizer`). `max_shard_bytes` splits the
    weights into several files with a `model.safetensors.index.json`. Same arguments and seed,
    same bytes. Returns `out_dir`.
    """
    from transformers import Qwen3Config

    return _write_checkpoint(
        out_dir,
        Qwen3Config,
        "Qwen3ForCausalLM",
        dict(intermediate_size=intermediate_size),
        mlp=lambda prefix, _: _dense_mlp_shapes(prefix, hidden_size, intermediate_size),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        max_shard_bytes=max_shard_bytes,
        rope_theta=rope_theta,
        seed=seed,
        dtype=dtype,
        tokenizer=tokenizer,
    )


def _write_checkpoint(
    out_dir: str | Path,
    config_class: type,
    architecture: str,
    extra_config: dict[str, Any],
    *,
    mlp: Callable[[str, int], list[tuple[str, tuple[int, ...]]]],
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int | None,
    tie_word_embeddings: bool,
    max_position_embeddings: int,
    max_shard_bytes: int | None,
    rope_theta: float,
    seed: int,
    dtype: str,
    tokenizer: str,
    router_scale: float = ROUTER_SCALE,
) -> Path:
    """What the dense and MoE builders share: the tokenizer, config.json (`config_class` with
    the attention shape and `extra_config`), generation_config.json, then the weights, whose
    layers' MLP tensors `mlp(prefix, layer)` names."""
    out, vocab_size, eos_id, pad_id = _start_checkpoint(out_dir, vocab_size, tokenizer)
    torch_dtype = getattr(torch, dtype)
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        **extra_config,
    )
    config.dtype = torch_dtype
    config.architectures = [architecture]
    config.save_pretrained(str(out))
    # transformers 5 writes the expert count as `num_local_experts` (its attribute_map's
    # target); the published configs, and older transformers, say `num_experts`.
    config_file = out / "config.json"
    config_dict = json.loads(config_file.read_text())
    if "num_local_experts" in config_dict:
        config_dict["num_experts"] = config_dict.pop("num_local_experts")
        config_file.write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    _save_generation_config(out, eos_id, pad_id)
    shapes = _model_shapes(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        mlp=mlp,
    )
    _write_safetensors(
        out,
        shapes,
        hidden_size=hidden_size,
        embed_std=_EMBED_STD_TIED if tie_word_embeddings else _EMBED_STD_UNTIED,
        dtype=torch_dtype,
        seed=seed,
        max_shard_bytes=max_shard_bytes,
        router_scale=router_scale,
    )
    return out


def _start_checkpoint(
    out_dir: str | Path, vocab_size: int | None, tokenizer: str = "test"
) -> tuple[Path, int, int, int]:
    """Make `out_dir` and its tokenizer (a `TOKENIZERS` name); returns (dir, vocab size, eos
    id, pad id)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer {tokenizer!r}: expected one of {sorted(TOKENIZERS)}")
    tok = TOKENIZERS[tokenizer](out)
    if vocab_size is None:
        vocab_size = len(tok)
    if vocab_size < len(tok):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tok)}")
    return out, vocab_size, tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)


def _save_generation_config(out: Path, eos_id: int, pad_id: int) -> None:
    from transformers import GenerationConfig

    gen_config = GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=pad_id
    )
    gen_config.save_pretrained(str(out))


def build_random_qwen3_moe(
    out_dir: str | Path,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    moe_intermediate_size: int,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] | list[int] = (),
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 4096,
    max_shard_bytes: int | None = None,
    rope_theta: float = 1_000_000.0,
    router_scale: float = ROUTER_SCALE,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: str = "test",
) -> Path:
    """Write a random-weight Qwen3-MoE checkpoint (`Qwen3MoeForCausalLM`), as published.

    Layer i is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step`;
    dense layers get an MLP of `intermediate_size` (None: `num_experts_per_tok *
    moe_intermediate_size`, which is what the released 30B-A3B and 235B-A22B configs state).
    `router_scale`: the router logits' standard deviation (`ROUTER_SCALE`). Otherwise as
    `build_random_qwen3`: same arguments and seed, same bytes. Returns `out_dir`.
    """
    from transformers import Qwen3MoeConfig

    if intermediate_size is None:
        intermediate_size = num_experts_per_tok * moe_intermediate_size
    mlp_only = sorted(int(i) for i in mlp_only_layers)

    def mlp(prefix: str, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        if layer in mlp_only or (layer + 1) % decoder_sparse_step:
            return _dense_mlp_shapes(prefix, hidden_size, intermediate_size)
        inter = moe_intermediate_size
        shapes = [(f"{prefix}.mlp.gate.weight", (num_experts, hidden_size))]
        for e in range(num_experts):
            shapes += [
                (f"{prefix}.mlp.experts.{e}.gate_proj.weight", (inter, hidden_size)),
                (f"{prefix}.mlp.experts.{e}.up_proj.weight", (inter, hidden_size)),
                (f"{prefix}.mlp.experts.{e}.down_proj.weight", (hidden_size, inter)),
            ]
        return shapes

    return _write_checkpoint(
        out_dir,
        Qwen3MoeConfig,
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=decoder_sparse_step,
            mlp_only_layers=mlp_only,
        ),
        mlp=mlp,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        max_shard_bytes=max_shard_bytes,
        rope_theta=rope_theta,
        seed=seed,
        dtype=dtype,
        tokenizer=tokenizer,
        router_scale=router_scale,
    )


# -- a cache of built checkpoints -------------------------------------------------------------


def cache_dir() -> Path:
    """Where built checkpoints are cached: `$TP_ENGINE_CACHE`, default `~/.cache/tp_engine`."""
    return Path(os.environ.get("TP_ENGINE_CACHE") or Path.home() / ".cache" / "tp_engine")


def cached_random_qwen3(
    name: str, *, builder: Callable[..., Path] | None = None, **shape: Any
) -> Path:
    """`cache_dir() / name`, built with `builder(**shape)` on first use (default
    `build_random_qwen3`; `build_random_qwen3_moe` for MoE shapes).

    Built in a temporary directory next to it and renamed into place: the rename is atomic, so
    a concurrent first use (every torchrun rank at once) either wins or finds the finished
    directory, and nobody ever reads a half-written checkpoint.
    """
    root = cache_dir()
    final = root / name
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        (builder or build_random_qwen3)(tmp, **shape)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its copy first; theirs is complete, use it.
            if not (final / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
