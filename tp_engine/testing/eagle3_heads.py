"""EAGLE-3 heads for tests and benchmarks: written in either published layout, and trained on a
tiny target's own greedy continuations so that their drafts are accepted.

`train_eagle3_head` follows SpecForge's recipe at toy scale (`/work/shared/research/
eagle3-format.md`, section 4): the target's aux states and greedy tokens over its own
continuations of random prompts; a draft vocabulary of the most frequent target tokens (ids
ascending, `d2t[i] = used[i] - i`); training-time test (TTT) over `ttt` chained steps with
teacher forcing, step j at RoPE position p + j attending to step 0's keys at positions <= p and
to its own chain's keys at base p; loss weights 0.8^j; Adam, seeded. The head's math here is
written out independently of the runtime's (`rank_worker.spec.eagle3_head`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# The speculators converter's rename of the decoder layer (`rank_worker.spec.eagle3_format`).
_SPECULATORS_PREFIX = ("midlayer.", "layers.0.")


def write_eagle3_head(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    layout: str = "specforge",
    layer_ids: list[int] | None = None,
    num_target_layers: int | None = None,
) -> Path:
    """Write `tensors` (canonical SpecForge names) and `config` (the Llama fields: hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
    rope_theta, max_position_embeddings, vocab_size, draft_vocab_size) as a head in `layout`
    ("specforge" or "speculators"). `layer_ids`: the aux layers pinned in the layout's own
    reading (SpecForge: layer outputs; speculators: layer inputs), None: the default."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    llama = {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu",
             "tie_word_embeddings": False, "rope_scaling": None, **config}  # fmt: skip
    if layout == "specforge":
        cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLMEagle3"], **llama}
        if layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids),
                                   "use_aux_hidden_state": True}  # fmt: skip
        names = dict(tensors)
    elif layout == "speculators":
        layer = {k: v for k, v in llama.items() if k != "draft_vocab_size"}
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": config["draft_vocab_size"],
            "norm_before_residual": False,
            "target_hidden_size": config["hidden_size"],
            "eagle_aux_hidden_state_layer_ids": None if layer_ids is None else list(layer_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny-target", "architectures": ["Qwen3ForCausalLM"]},
            },
        }
        old, new = _SPECULATORS_PREFIX
        names = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in tensors.items()}
    else:
        raise ValueError(f"layout must be 'specforge' or 'speculators', got {layout!r}")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in names.items()}, str(out / "model.safetensors"))
    return out


def draft_vocabulary(tokens: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge's map: the `size` most frequent of `tokens` (ids 0, 1, ... unused by them fill
    up), ascending. Returns `(used [size] target ids, d2t [size])`."""
    counts = torch.bincount(tokens.flatten(), minlength=size)
    ranked = torch.argsort(-counts.float(), stable=True)[:size]
    used = torch.sort(ranked).values
    return used, used - torch.arange(size)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., S, heads, d] rotated by position [..., S] (half-split, as Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[..., None].float() * inv  # [..., S, d/2]
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _TrainHead(torch.nn.Module):
    def __init__(self, h: int, inter: int, heads: int, kv: int, hd: int, vd: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * shape[-1] ** -0.5)

        self.p = torch.nn.ParameterDict({
            "fc": w(h, 3 * h), "q": w(heads * hd, 2 * h), "k": w(kv * hd, 2 * h),
            "v": w(kv * hd, 2 * h), "o": w(h, heads * hd), "gate": w(inter, h), "up": w(inter, h),
            "down": w(h, inter), "lm_head": w(vd, h),
            **{n: torch.nn.Parameter(torch.ones(h)) for n in ("hn", "ln1", "ln2", "norm")},
        })  # fmt: skip
        self.heads, self.kv, self.hd = heads, kv, hd

    def qkv(self, e: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, eps: float, theta: float):
        p = self.p
        z = torch.cat([_rms(e, p["ln1"], eps), _rms(h, p["hn"], eps)], -1)  # [B, S, 2H]
        b, s = z.shape[:2]
        q = _rope((z @ p["q"].T).view(b, s, self.heads, self.hd), pos, theta)
        k = _rope((z @ p["k"].T).view(b, s, self.kv, self.hd), pos, theta)
        v = (z @ p["v"].T).view(b, s, self.kv, self.hd)
        rep = self.heads // self.kv
        return q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)

    def finish(self, h: torch.Tensor, attn: torch.Tensor, eps: float) -> torch.Tensor:
        p = self.p
        y = h + attn.flatten(-2) @ p["o"].T
        n = _rms(y, p["ln2"], eps)
        return y + (F.silu(n @ p["gate"].T) * (n @ p["up"].T)) @ p["down"].T


def train_eagle3_head(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    prompts: list[list[int]],
    max_new_tokens: int,
    layer_ids: tuple[int, int, int] = (0, 1, 2),
    draft_vocab_size: int = 160,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    steps: int = 300,
    ttt: int = 3,
    lr: float = 3e-3,
    rope_theta: float = 10000.0,
    seed: int = 0,
    layout: str = "specforge",
) -> Path:
    """Train a head on the target's greedy continuations of `prompts` (see the module
    docstring) and write it to `out_dir` in `layout`, pinning `layer_ids` (SpecForge's
    reading: outputs of those layers). Deterministic for the same arguments."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    cfg = model.config
    hsz = cfg.hidden_size
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("train_eagle3_head: the prompts must have one length (batched greedy)")
    with torch.no_grad():
        ids = torch.tensor(prompts)  # [B, P]
        for _ in range(max_new_tokens):  # batched greedy, the whole sequence each time
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        fwd = model(ids, output_hidden_states=True)
        hs = fwd.hidden_states
        aux = torch.cat([hs[i + 1] for i in layer_ids], -1)  # [B, S, 3H] outputs of the layers
        teacher = fwd.logits.argmax(-1)  # [B, S] the target's greedy token after each position
        embed = model.get_input_embeddings()(ids)  # [B, S, H]
    used, d2t = draft_vocabulary(teacher, draft_vocab_size)
    t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    t2d[used] = torch.arange(draft_vocab_size)
    head_dim = hsz // num_heads
    inter = intermediate_size or 2 * hsz
    net = _TrainHead(hsz, inter, num_heads, num_kv_heads, head_dim, draft_vocab_size, seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    eps = float(cfg.rms_norm_eps)
    s = ids.shape[1]
    n = s - 1 - ttt  # base positions p with every step's label in range
    base = torch.arange(n)
    causal = base[None, :] <= base[:, None]  # [n, n] step-0 keys at positions <= p
    for _ in range(steps):
        h = aux[:, :n] @ net.p["fc"].T  # [B, n, H]
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        loss = torch.zeros(())
        for j in range(ttt):
            e = embed[:, 1 + j : 1 + j + n]  # teacher forcing: the token after p + j
            q, k, v = net.qkv(e, h, base + j, eps, rope_theta)
            scale = head_dim**-0.5
            if j == 0:
                k0, v0 = k, v
                scores = torch.einsum("bqhd,bkhd->bhqk", q, k0) * scale
                scores = scores.masked_fill(~causal, float("-inf"))
                vals = [v0]
            else:
                keys.append((k, v))
                s0 = torch.einsum("bqhd,bkhd->bhqk", q, k0) * scale
                s0 = s0.masked_fill(~causal, float("-inf"))
                diag = [torch.einsum("bqhd,bqhd->bhq", q, kj)[..., None] * scale for kj, _ in keys]
                scores = torch.cat([s0, *diag], -1)
                vals = [v0] + [vj for _, vj in keys]
            probs = scores.softmax(-1)
            attn = torch.einsum("bhqk,bkhd->bqhd", probs[..., :n], vals[0])
            for i, vj in enumerate(vals[1:]):
                attn = attn + probs[..., n + i].permute(0, 2, 1)[..., None] * vj
            y = net.finish(h, attn, eps)
            logits = _rms(y, net.p["norm"], eps) @ net.p["lm_head"].T  # [B, n, Vd]
            label = t2d[teacher[:, 1 + j : 1 + j + n]]  # predicting the token after p + 1 + j
            mask = label >= 0
            ce = F.cross_entropy(logits[mask], label[mask]) if mask.any() else logits.sum() * 0
            loss = loss + 0.8**j * ce
            h = y
        opt.zero_grad()
        loss.backward()
        opt.step()
    p = {k: v.detach().clone() for k, v in net.p.items()}
    tensors = {
        "fc.weight": p["fc"], "midlayer.self_attn.q_proj.weight": p["q"],
        "midlayer.self_attn.k_proj.weight": p["k"], "midlayer.self_attn.v_proj.weight": p["v"],
        "midlayer.self_attn.o_proj.weight": p["o"], "midlayer.mlp.gate_proj.weight": p["gate"],
        "midlayer.mlp.up_proj.weight": p["up"], "midlayer.mlp.down_proj.weight": p["down"],
        "midlayer.hidden_norm.weight": p["hn"], "midlayer.input_layernorm.weight": p["ln1"],
        "midlayer.post_attention_layernorm.weight": p["ln2"], "norm.weight": p["norm"],
        "lm_head.weight": p["lm_head"], "d2t": d2t, "t2d": t2d >= 0,
    }  # fmt: skip
    config = {
        "hidden_size": hsz, "intermediate_size": inter, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "rms_norm_eps": eps,
        "rope_theta": rope_theta, "max_position_embeddings": int(cfg.max_position_embeddings),
        "vocab_size": int(cfg.vocab_size), "draft_vocab_size": draft_vocab_size,
    }  # fmt: skip
    ids_in_layout = list(layer_ids) if layout == "specforge" else [i + 1 for i in layer_ids]
    return write_eagle3_head(out_dir, tensors, config, layout=layout, layer_ids=ids_in_layout)


def build_predictable_target(
    out_dir: str | Path, *, layer_scale: float = 0.2, seed: int = 3
) -> Path:
    """A tiny random Qwen3 (4 layers, hidden 64, the test tokenizer) whose layers' output
    projections are scaled by `layer_scale`: its greedy continuations then follow the current
    token more than a random model's do (they settle into cycles), which a one-layer head can
    learn from a few dozen sequences. A random target's continuations are near-random text no
    small head predicts. The layers still shape every hidden state."""
    from tp_engine.testing.checkpoints import build_random_qwen3
    from tp_engine.testing.rewrites import rewrite_checkpoint

    out = Path(out_dir)
    base = build_random_qwen3(
        out.with_name(out.name + "-base"), hidden_size=64, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=128,
        seed=seed,
    )  # fmt: skip

    def scale(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t = t * layer_scale
        return {name: t}

    return rewrite_checkpoint(base, out, scale, lambda cfg: None)


def cached_eagle3_pair() -> tuple[Path, Path]:
    """`(target, head)`: the tests' tiny predictable target and the head trained on it (32
    random 8-token prompts, 32 greedy tokens each, 150 steps, seed 0), built once under
    `cache_dir()` (training takes a minute on a busy CPU) and reused by tests and benchmarks.
    Built in a temporary directory and renamed into place, as `cached_random_qwen3` does."""
    import os
    import shutil
    import tempfile

    from tp_engine.testing.checkpoints import cache_dir

    root = cache_dir()
    final = root / "eagle3-tiny-v1"
    target, head = final / "target", final / "head"
    if (head / "config.json").exists():
        return target, head
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        build_predictable_target(tmp / "target")
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, 643, (32, 8), generator=g).tolist()
        train_eagle3_head(
            tmp / "target", tmp / "head", prompts=prompts, max_new_tokens=32, steps=150, seed=0
        )
        try:
            os.rename(tmp, final)
        except OSError:
            if not (head / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target, head
