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

import base64
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# -- tokenizer ------------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML, as Qwen writes it (without the tool-calling branches).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A few paragraphs of plain English for the BPE merges. The tokenizer is byte-level, so any
# text round-trips whatever the corpus; the corpus only decides which byte runs get merged.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A serving engine answers many requests at "
    "once: it batches the prompts that arrive, runs the model on all of them together, and "
    "streams each answer back as soon as a new token is ready.",
    "Tensor parallelism splits every layer of a large language model across several devices. "
    "Each device holds a slice of every weight matrix, computes its part of the result, and the "
    "devices then add their partial results together before the next layer begins.",
    "Hello, world! How are you today? I am fine, thank you. What would you like to talk about? "
    "Tell me a story about a small robot that learned to paint the sea at sunset.",
    "The cache keeps the keys and values of every token that was already computed, in blocks of "
    "a fixed size. When two requests share the same beginning, they can share the same blocks, "
    "and the second request starts where the first one left off.",
    "Numbers and symbols appear in text too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2024, 3.14, "
    "(a + b) * c = d; x[i] = y{j}; \"quoted\" and 'single' marks; e-mail@example.com; #tag.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    "Once upon a time there was a quiet village by a river. Every morning the people walked to "
    "the market, and every evening they came home, told each other what they had seen, and "
    "went to sleep under the bright stars of the summer sky.",
)
_TOKENIZER_VOCAB = 640


def build_tokenizer(out_dir: str | Path) -> Any:
    """Train a small byte-level BPE tokenizer and save it to `out_dir` with Qwen's special
    tokens, eos `<|im_end|>`, pad `<|endoftext|>` and a ChatML chat template.

    Deterministic: the same corpus and settings give the same merges on every machine. Returns
    the `transformers` tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level, no prefix space, GPT-2's split regex: every byte sequence has an encoding.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer=trainer)
    # Added after training, so they sit at the end of the vocabulary as in Qwen's.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


# Qwen3's tokenizer, rebuilt from Qwen's published BPE ranks: the 151,643 byte-level tokens of
# `qwen.tiktoken` (shipped inside the `dashscope` package), Qwen2's pre-tokenizer split (single
# digits, unlike tiktoken's cl100k) behind NFC, and Qwen3's 26 added tokens at their public ids.
# 151,669 tokens in all, under the 151,936 rows of Qwen3's embedding, as in the real checkpoints.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (  # (content, special), ids from 151643 on
    (ENDOFTEXT, True), (IM_START, True), (IM_END, True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True), ("<|repo_name|>", True), ("<|file_sep|>", True),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)  # fmt: skip
QWEN3_TOKENIZER_SIZE = 151_669
QWEN3_VOCAB_ROWS = 151_936


def qwen_tiktoken_path() -> Path:
    """`dashscope`'s copy of Qwen's BPE ranks, found without importing the package (whose
    import pulls in its HTTP client)."""
    import importlib.util

    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the Qwen3 tokenizer is built from Qwen's BPE ranks in the 'dashscope' package "
            "(resources/qwen.tiktoken): pip install dashscope"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: this dashscope release does not ship qwen.tiktoken")
    return path


def build_qwen3_tokenizer(out_dir: str | Path) -> Any:
    """Qwen3's tokenizer (see QWEN3_ADDED_TOKENS) saved to `out_dir` with eos `<|im_end|>`, pad
    `<|endoftext|>` and the ChatML chat template; about 2 s. Returns the `transformers`
    tokenizer. "Hello" encodes to 9707 as in Qwen3."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class QwenRanks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
            # One "base64-token rank" pair a line; read here so that tiktoken is not needed.
            with open(path, "rb") as f:
                return {
                    base64.b64decode(t): int(r) for t, r in (ln.split() for ln in f if ln.strip())
                }

    tok = QwenRanks(vocab_file=str(qwen_tiktoken_path()), pattern=QWEN2_SPLIT_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    for content, special in QWEN3_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    if tok.get_vocab_size() != QWEN3_TOKENIZER_SIZE:
        raise ValueError(f"built {tok.get_vocab_size()} tokens, expected {QWEN3_TOKENIZER_SIZE}")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[c for c, special in QWEN3_ADDED_TOKENS[1:] if special],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


TOKENIZERS: dict[str, Callable[[str | Path], Any]] = {
    "test": build_tokenizer,
    "qwen3": build_qwen3_tokenizer,
}


# -- model ----------------------------------------------------------------------------------

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


def _tensor_shapes(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen3ForCausalLM checkpoint, in transformers' names and order."""
    return _model_shapes(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        mlp=lambda p, _: _dense_mlp_shapes(p, hidden_size, intermediate_size),
    )


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

    out, vocab_size, eos_id, pad_id = _start_checkpoint(out_dir, vocab_size, tokenizer)
    torch_dtype = getattr(torch, dtype)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
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
    )
    config.dtype = torch_dtype
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(str(out))
    _save_generation_config(out, eos_id, pad_id)
    shapes = _tensor_shapes(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    _write_safetensors(
        out,
        shapes,
        hidden_size=hidden_size,
        embed_std=_EMBED_STD_TIED if tie_word_embeddings else _EMBED_STD_UNTIED,
        dtype=torch_dtype,
        seed=seed,
        max_shard_bytes=max_shard_bytes,
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

    out, vocab_size, eos_id, pad_id = _start_checkpoint(out_dir, vocab_size, tokenizer)
    if intermediate_size is None:
        intermediate_size = num_experts_per_tok * moe_intermediate_size
    mlp_only = sorted(int(i) for i in mlp_only_layers)
    torch_dtype = getattr(torch, dtype)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=tie_word_embeddings,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=mlp_only,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    config.dtype = torch_dtype
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(str(out))
    # transformers 5 writes the expert count as `num_local_experts` (its attribute_map's
    # target); the published configs, and older transformers, say `num_experts`.
    config_file = out / "config.json"
    config_dict = json.loads(config_file.read_text())
    if "num_local_experts" in config_dict:
        config_dict["num_experts"] = config_dict.pop("num_local_experts")
    config_file.write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    _save_generation_config(out, eos_id, pad_id)

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


# -- the built-in demo model ----------------------------------------------------------------

# Bump when the demo's shape or weights change, so old caches are not reused.
DEMO_VERSION = 1
DEMO_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=192,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    seed=0,
)


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


def demo_checkpoint_dir() -> Path:
    """The tiny random demo checkpoint, built on first use and cached in
    `$TP_ENGINE_CACHE/demo-qwen3-v<N>` (see `cached_random_qwen3`)."""
    return cached_random_qwen3(f"demo-qwen3-v{DEMO_VERSION}", **DEMO_SHAPE)


# -- FP8 checkpoints (Qwen's published format) ------------------------------------------------

FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# The decoder layers' linear weights, the ones Qwen's FP8 checkpoints store in e4m3 (the MoE
# router `mlp.gate.weight`, norms, embedding and head stay in their dtype).
_FP8_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
    r"\.weight"
)


def _rewrite_checkpoint(
    src: Path,
    out: Path,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    edit_config: Callable[[dict[str, Any]], None],
) -> Path:
    """Copy checkpoint `src` to `out` file by file (one safetensors file in memory at a time),
    each tensor replaced by `convert(name, tensor)`; the index follows; config.json edited."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from rank_worker.loader import INDEX_FILE, safetensors_files

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
            shutil.copy(f, out / f.name)
    weight_map: dict[str, str] = {}
    total = 0
    for path in safetensors_files(src):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open objects are not iterable
                tensors.update(convert(name, f.get_tensor(name)))
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = path.name
            total += t.numel() * t.element_size()
    if (src / INDEX_FILE).exists():
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    edit_config(config)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def quantize_checkpoint_fp8(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `src_dir`'s checkpoint in Qwen's FP8 format to `out_dir`: every decoder linear
    weight block-quantized to float8_e4m3fn with its `weight_scale_inv` (fp32, one per 128×128
    block: the block's max magnitude / 448), the rest unchanged, and config.json's
    `quantization_config` (`FP8_QUANTIZATION_CONFIG`). Returns `out_dir`."""
    from kernels.fp8_gemm import quantize_block_fp8

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not _FP8_LINEAR.fullmatch(name):
            return {name: t}
        q, scale = quantize_block_fp8(t)
        return {name: q, name.removesuffix("weight") + "weight_scale_inv": scale}

    def edit(config: dict[str, Any]) -> None:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)

    return _rewrite_checkpoint(Path(src_dir), Path(out_dir), convert, edit)


def dequantize_checkpoint_fp8(src_dir: str | Path, out_dir: str | Path) -> Path:
    """The inverse for references: an FP8 checkpoint's weights dequantized (`W_fp8 *
    scale_inv`, exactly, in float32) into an unquantized checkpoint that transformers loads on
    any device. Other tensors keep their dtype; config.json loses `quantization_config` and
    says float32. Returns `out_dir`."""
    from kernels.fp8_gemm import dequantize_block_fp8

    pending: dict[str, torch.Tensor] = {}

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        # A weight and its scale may come in either order within a file.
        if name.endswith("weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            other = pending.pop(weight, None)
            if other is None:
                pending[name] = t
                return {}
            return {weight: dequantize_block_fp8(other, t)}
        if t.dtype == torch.float8_e4m3fn:
            scale = pending.pop(name + "_scale_inv", None)
            if scale is None:
                pending[name] = t
                return {}
            return {name: dequantize_block_fp8(t, scale)}
        return {name: t}

    def edit(config: dict[str, Any]) -> None:
        config.pop("quantization_config", None)
        config["dtype"] = "float32"

    out = _rewrite_checkpoint(Path(src_dir), Path(out_dir), convert, edit)
    if pending:
        raise ValueError(f"FP8 weights or scales without their partner: {sorted(pending)}")
    return out


def truncate_layers(src_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """A copy of `src_dir`'s checkpoint with its first `num_layers` decoder layers only (the
    embeddings, final norm, head and tokenizer unchanged): a layer-dropped draft model for
    speculative decoding, which shares the target's vocabulary and agrees with it often.
    Returns `out_dir`."""
    layer = re.compile(r"model\.layers\.(\d+)\.")

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        match = layer.match(name)
        return {} if match and int(match.group(1)) >= num_layers else {name: t}

    def edit(config: dict[str, Any]) -> None:
        if not 1 <= num_layers <= config["num_hidden_layers"]:
            raise ValueError(
                f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}"
            )
        config["num_hidden_layers"] = num_layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:num_layers]

    return _rewrite_checkpoint(Path(src_dir), Path(out_dir), convert, edit)


def with_rope_scaling(
    src_dir: str | Path, out_dir: str | Path, scaling: dict[str, Any], *, legacy: bool = False
) -> Path:
    """A copy of `src_dir`'s checkpoint (same weights) whose RoPE is scaled by `scaling` (e.g.
    `{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}`).

    `legacy=False` writes transformers 5's `rope_parameters` (the base `rope_theta` kept inside
    it); `legacy=True` writes a pre-5 config.json as published Qwen3 checkpoints have it: a
    top-level `rope_theta` and `scaling` as `rope_scaling`. Returns `out_dir`."""

    def edit(config: dict[str, Any]) -> None:
        params = config.pop("rope_parameters", None) or {}
        theta = params.get("rope_theta", config.pop("rope_theta", None))
        if legacy:
            config["rope_theta"] = theta
            config["rope_scaling"] = dict(scaling)
        else:
            config.pop("rope_scaling", None)
            config["rope_parameters"] = {"rope_theta": theta, **scaling}

    return _rewrite_checkpoint(Path(src_dir), Path(out_dir), lambda n, t: {n: t}, edit)
