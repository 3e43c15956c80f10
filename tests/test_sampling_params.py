"""`SamplingParams.from_optional` and the generation-config defaults it takes (no engine)."""

from __future__ import annotations

import json

import pytest

from tp_engine.generation_config import eos_token_ids, sampling_defaults
from tp_engine.sampling_params import SamplingParams


def test_from_optional_fills_only_unset_fields():
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 99}
    p = SamplingParams.from_optional(defaults, temperature=None, top_p=0.5, seed=None)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens, p.seed) == (0.6, 20, 0.5, 99, None)
    assert SamplingParams.from_optional(None, temperature=None) == SamplingParams()
    assert SamplingParams.from_optional(defaults, temperature=0.0).temperature == 0.0
    with pytest.raises(ValueError, match="no field 'temprature'"):
        SamplingParams.from_optional(defaults, temprature=1.0)
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p "):
        SamplingParams.from_optional(defaults, top_p=3.0)


def test_sampling_defaults_follow_vllm_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True,
             "max_new_tokens": 300, "eos_token_id": [5, 9], "repetition_penalty": None}
        )
    )  # fmt: skip
    assert sampling_defaults(tmp_path) == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "max_tokens": 300,
    }

    class Tok:
        eos_token_id = 7

    assert eos_token_ids(Tok(), tmp_path) == {5, 7, 9}
    assert sampling_defaults(tmp_path / "missing") == {}


def test_bad_generation_config_names_the_file_and_field(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"generation_config\.json: SamplingParams\.top_p "):
        sampling_defaults(tmp_path)
