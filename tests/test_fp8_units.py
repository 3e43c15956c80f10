"""FP8 pieces without an engine: the quantization config, block-aligned shards and their
refusals, strict loading of fp8 weights and scales, KV-cache sizing, config checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rank_worker.kv.cache import KVCacheSpec, cpu_num_blocks
from rank_worker.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from rank_worker.models.quantization import Fp8BlockQuant, block_slice, fp8_quant_of
from rank_worker.tp import TPInfo
from tp_engine.config import EngineConfig
from tp_engine.testing import FP8_QUANTIZATION_CONFIG


def tp(rank: int, size: int) -> TPInfo:
    return TPInfo(rank=rank, size=size)


def test_quant_config_parsed_strictly():
    cfg = SimpleNamespace(quantization_config=dict(FP8_QUANTIZATION_CONFIG))
    assert fp8_quant_of(cfg, fused=True) == Fp8BlockQuant(kernel="triton")
    assert fp8_quant_of(SimpleNamespace(), fused=False) is None
    for key, bad in (("weight_block_size", [64, 64]), ("activation_scheme", "static"),
                     ("quant_method", "gptq")):  # fmt: skip
        qc = {**FP8_QUANTIZATION_CONFIG, key: bad}
        with pytest.raises(ValueError, match=key):
            fp8_quant_of(SimpleNamespace(quantization_config=qc), fused=False)


def test_block_slice():
    assert block_slice(256, 128, 1024, "x") == (2, 1)
    assert block_slice(128, 72, 200, "x") == (1, 1)  # the partial last block of the dimension
    with pytest.raises(ValueError, match=r"features \[64, 128\).*split a 128×128 block"):
        block_slice(64, 64, 128, "x")
    with pytest.raises(ValueError, match="split"):
        block_slice(0, 72, None, "x")  # a packed part must be whole blocks


def test_shards_take_their_block_scales():
    quant = Fp8BlockQuant()
    w = torch.randn(512, 256).to(torch.float8_e4m3fn)
    scales = torch.arange(8, dtype=torch.float32).view(4, 2)  # [512/128, 256/128]
    col = ColumnParallelLinear(256, 512, tp(1, 2), dtype=torch.float32, device="cpu", quant=quant)
    col.weight.weight_loader(col.weight, w, None)
    col.weight_scale_inv.weight_loader(col.weight_scale_inv, scales, None)
    assert torch.equal(col.weight_scale_inv, scales[2:4])
    assert torch.equal(col.weight.view(torch.uint8), w[256:].view(torch.uint8))
    row = RowParallelLinear(512, 256, tp(1, 2), dtype=torch.float32, device="cpu", quant=quant)
    row.weight_scale_inv.weight_loader(row.weight_scale_inv, scales.T.contiguous(), None)
    assert torch.equal(row.weight_scale_inv, scales.T[:, 2:4])
    with pytest.raises(ValueError, match=r"expected torch\.float8_e4m3fn"):
        col.weight.weight_loader(col.weight, w.float(), None)
    with pytest.raises(ValueError, match="split a 128×128 block"):
        RowParallelLinear(512, 256, tp(1, 8), dtype=torch.float32, device="cpu", quant=quant)


def test_fp8_kv_cache_holds_twice_the_blocks_of_bf16():
    hf = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=8, head_dim=128,
                         hidden_size=1024, num_attention_heads=8)  # fmt: skip
    bf16 = KVCacheSpec.for_model(hf, tp(0, 1), 16, torch.bfloat16)
    fp8 = KVCacheSpec.for_model(hf, tp(0, 1), 16, torch.float8_e4m3fn)
    assert 2 * fp8.bytes_per_block == bf16.bytes_per_block
    assert cpu_num_blocks(fp8, None, 1 << 26) == 2 * cpu_num_blocks(bf16, None, 1 << 26)


def test_engine_config_checks_kv_cache_dtype():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="flash_attn"):
        EngineConfig(kv_cache_dtype="fp8", attention_backend="flash_attn", block_size=256)
