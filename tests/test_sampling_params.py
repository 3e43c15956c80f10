"""`SamplingParams`: `from_optional` and the generation-config defaults it takes, and the
token constraints' validation and checks (no engine)."""

from __future__ import annotations

import json
import re

import pytest

from tp_engine.config.generation import eos_token_ids, sampling_defaults
from tp_engine.sampling_params import SamplingParams, tokenize_bad_words


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


# -- logit_bias, allowed_token_ids, bad_words --------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"logit_bias": {"7": 100.5}}, "logit_bias", "in [-100, 100]"),
        ({"logit_bias": {"7": float("nan")}}, "logit_bias", "in [-100, 100]"),
        ({"logit_bias": {"seven": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {-3: 1}}, "logit_bias", "token ids"),
        ({"logit_bias": [1, 2]}, "logit_bias", "map of token id"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
        ({"allowed_token_ids": [1, -1]}, "allowed_token_ids", "non-negative"),
        ({"bad_words": ["ok", "  "]}, "bad_words", "not empty"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids", "non-empty"),
    ],
)
def test_token_constraints_are_validated(fields, field, message):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} .*{re.escape(message)}"):
        SamplingParams(**fields)


def test_logit_bias_takes_json_string_keys_and_round_trips_as_fields():
    p = SamplingParams(logit_bias={"5": 100, 6: -2.5}, allowed_token_ids=(1, 2))
    assert p.logit_bias == {5: 100.0, 6: -2.5} and p.allowed_token_ids == [1, 2]
    fields = p.as_fields()
    assert fields["logit_bias"] == {"5": 100.0, "6": -2.5}  # msgpack maps: string keys
    assert SamplingParams(**fields) == p


def test_check_vocab_names_the_field():
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[9]).check_vocab(10)
    for fields, field in [
        ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 12]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, 10]]}, "bad_words"),
    ]:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
            SamplingParams(**fields).check_vocab(10)


def test_check_first_step_refuses_constraints_that_leave_nothing():
    eos = [2]
    SamplingParams(allowed_token_ids=[2, 3], bad_words_token_ids=[[3]]).check_first_step(5, eos)
    # min_tokens holds EOS back; ignore_eos lets it be.
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids leaves no token"):
        SamplingParams(
            allowed_token_ids=[2, 3], bad_words_token_ids=[[3]], min_tokens=1
        ).check_first_step(5, eos)
    SamplingParams(
        allowed_token_ids=[2], min_tokens=1, ignore_eos=True, max_tokens=4
    ).check_first_step(5, eos)
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids leaves no token"):
        SamplingParams(allowed_token_ids=[3], stop_token_ids=[3], min_tokens=2).check_first_step(5)
    # Without allowed_token_ids: single-token bad words banning the whole vocabulary.
    every = [[t] for t in range(4)]
    SamplingParams(bad_words_token_ids=every).check_first_step(5)
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words leaves no token"):
        SamplingParams(bad_words_token_ids=[*every, [4], [1, 2]]).check_first_step(5)


class _SpaceTokenizer:
    """Words -> ids: a leading space makes a word another token (as BPE vocabularies do)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        pieces = [("_" if i else "") + w for i, w in enumerate(text.split(" ")) if w]
        return {"input_ids": [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]}


def test_tokenize_bad_words_with_and_without_a_leading_space():
    tok = _SpaceTokenizer()
    p = tokenize_bad_words(SamplingParams(bad_words=["red cat", " dog"]), tok)
    assert p.bad_words_token_ids == [
        tok("red cat")["input_ids"],
        tok(" red cat")["input_ids"],
        tok("dog")["input_ids"],
        tok(" dog")["input_ids"],
    ]
    assert (
        len(p.bad_words_token_ids[0]) == 2 and p.bad_words_token_ids[0] != p.bad_words_token_ids[1]
    )
    assert tokenize_bad_words(p, tok) is p  # tokenized once
    plain = SamplingParams()
    assert tokenize_bad_words(plain, tok) is plain
