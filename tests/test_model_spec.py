"""`ModelSpec`: what a checkpoint is served as, from config.json, hf_overrides and the
sentence-transformers files, as vLLM's --runner / --convert decide it; and `PoolingParams`'
defaults and refusals against it, and what they do to a head row (`tp_engine.core.pooled_records`). No
engine: configs and files only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rank_worker.models.model_spec import HeadSpec, ModelSpec, load_hf_config
from tp_engine.config import EngineConfig
from tp_engine.engine import _check_pooling_config
from tp_engine.pooling_params import PoolingParams

TOKENS = {"no": 5, "yes": 9}


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("spec") / "causal"
    config = Qwen3Config(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=32, max_position_embeddings=64,
    )  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(path)
    return path


def resolve(path: Path, overrides=None, **kw) -> ModelSpec:
    return ModelSpec.resolve(path, load_hf_config(path, overrides), token_id=TOKENS.get, **kw)


def with_st_modules(src: Path, dst: Path, pooling: dict) -> Path:
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    modules = [
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir(exist_ok=True)
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return dst


def test_auto_detection_as_vllm(causal_dir, tmp_path):
    assert resolve(causal_dir).task == "generate"
    assert resolve(causal_dir).head == HeadSpec("lm")
    # runner pooling on a causal LM converts it to an embedder (vLLM's default convert); with
    # no sentence-transformers files to say otherwise its embeddings are L2-normalised, as
    # vLLM's embed default.
    spec = resolve(causal_dir, runner="pooling")
    assert (spec.task, spec.head.kind, spec.normalize) == ("embed", "last_token", True)
    # sentence-transformers files (6.x spelling, no Normalize module): an embedder, no L2.
    st = with_st_modules(causal_dir, tmp_path / "st", {"pooling_mode": "lasttoken"})
    assert (resolve(st).task, resolve(st).normalize) == ("embed", False)
    # The original Qwen3-Reranker with vLLM's overrides: the yes/no token head, false first.
    reranker = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    spec = resolve(causal_dir, reranker)
    assert spec.task == "classify" and spec.head == HeadSpec("token_score", (5, 9))
    assert spec.head.num_scores == 1
    assert spec.class_labels == ()  # one score, not classes: /classify says LABEL_0
    # A converted seq-cls checkpoint: its score matrix, as many rows as labels.
    spec = resolve(causal_dir, {"architectures": ["Qwen3ForSequenceClassification"],
                                "num_labels": 3})  # fmt: skip
    assert spec.head == HeadSpec("seq_cls", num_labels=3)
    assert HeadSpec.from_dict(spec.head.to_dict()) == spec.head  # what the ranks receive
    # Its class names, by row, from id2label (transformers' LABEL_<i> when the config has none).
    assert spec.class_labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    spec = resolve(causal_dir, {"architectures": ["Qwen3ForSequenceClassification"],
                                "id2label": {"1": "positive", "0": "negative"}})  # fmt: skip
    assert (spec.head.num_labels, spec.class_labels) == (2, ("negative", "positive"))
    assert resolve(causal_dir, {"id2label": {"0": "x"}}).class_labels == ()  # generates


def test_refusals(causal_dir, tmp_path):
    with pytest.raises(ValueError, match="needs runner 'pooling'"):
        resolve(causal_dir, runner="generate", convert="embed")
    with pytest.raises(ValueError, match="needs a pooling architecture"):
        resolve(causal_dir, runner="pooling", convert="none")
    mean = with_st_modules(causal_dir, tmp_path / "mean", {"pooling_mode_mean_tokens": True})
    with pytest.raises(ValueError, match="pooling mode 'mean_tokens' is not supported"):
        resolve(mean)
    # A module after the pooling that changes the vector (a Dense projection) is refused by
    # name rather than skipped: its users get projected vectors elsewhere.
    dense = with_st_modules(causal_dir, tmp_path / "dense", {"pooling_mode": "lasttoken"})
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"module 'sentence_transformers\.models\.Dense' is not"):
        resolve(dense)
    with pytest.raises(ValueError, match="'maybe' is not one token"):
        resolve(causal_dir, {"is_original_qwen3_reranker": True,
                             "classifier_from_token": ["no", "maybe"]}, runner="pooling",
                convert="classify")  # fmt: skip
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match="hf_overrides is not valid JSON"):
        EngineConfig(hf_overrides="{is_matryoshka: true}")
    spec = resolve(causal_dir, runner="pooling")
    with pytest.raises(ValueError, match="speculative decoding cannot run with a pooling"):
        _check_pooling_config(spec, EngineConfig(speculative_config={"method": "ngram",
                                                                     "num_speculative_tokens": 2}))  # fmt: skip


def test_hf_overrides_reach_the_config(causal_dir):
    """JSON (the command line's form) or a dict; transformers normalises the merged fields as
    it would the file's (a legacy rope_scaling becomes rope_parameters: YaRN's spec reads it)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    config = EngineConfig(hf_overrides=json.dumps({"rope_scaling": yarn, "is_matryoshka": True}))
    spec = resolve(causal_dir, config.hf_overrides, runner="pooling")
    assert spec.rope.rope_type == "yarn" and spec.max_positions == 64
    assert spec.is_matryoshka


@pytest.mark.parametrize("layout", ["transformers-5", "legacy"])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_a_yarn_override_keeps_the_checkpoints_rope_theta(tmp_path, layout, key):
    """The model card's override names the scaling only (`rope_scaling`: type, factor,
    original length); the base frequency stays the checkpoint's, whichever config.json layout
    holds it (a transformers 5 re-save keeps it inside `rope_parameters`)."""
    fields = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=32,
                  hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, intermediate_size=32,
                  max_position_embeddings=64)  # fmt: skip
    if layout == "legacy":  # as Qwen publishes Qwen3
        fields.update(rope_theta=1e6, rope_scaling=None, transformers_version="4.51.0")
    else:
        fields.update(rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
                      transformers_version="5.24.0")  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert resolve(tmp_path).rope.theta == 1e6
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    spec = resolve(tmp_path, {key: yarn})
    assert (spec.rope.rope_type, spec.rope.theta, spec.max_positions) == ("yarn", 1e6, 64)
    # A rope_theta override is heard in either layout, with or without a scaling override.
    assert resolve(tmp_path, {"rope_theta": 5e5}).rope.theta == 5e5
    spec = resolve(tmp_path, {key: yarn, "rope_theta": 5e5})
    assert (spec.rope.rope_type, spec.rope.theta) == ("yarn", 5e5)
    assert "rope_theta" not in yarn  # the caller's overrides are left as given


def test_pooling_params_defaults_and_refusals(causal_dir):
    embed = resolve(causal_dir, {"is_matryoshka": True}, runner="pooling")
    assert PoolingParams().resolve(embed) == PoolingParams("embed", None, True, True)
    assert PoolingParams(dimensions=16).resolve(embed).dimensions == 16
    with pytest.raises(ValueError, match=r"dimensions in range \[1, 16\]"):
        PoolingParams(dimensions=17).resolve(embed)
    # A model trained on a list of sizes serves those only (vLLM's rule).
    listed = resolve(causal_dir, {"matryoshka_dimensions": [4, 8]}, runner="pooling")
    assert PoolingParams(dimensions=8).resolve(listed).dimensions == 8
    with pytest.raises(ValueError, match=r"only supports \[4, 8\] matryoshka dimensions"):
        PoolingParams(dimensions=6).resolve(listed)
    with pytest.raises(ValueError, match="Classify API is not supported"):
        PoolingParams(task="classify").resolve(embed)
    classify = resolve(causal_dir, {"architectures": ["Qwen3ForSequenceClassification"],
                                    "num_labels": 3})  # fmt: skip
    assert PoolingParams().resolve(classify).task == "classify"
    with pytest.raises(ValueError, match="score needs a model with one label"):
        PoolingParams(task="score").resolve(classify)
    with pytest.raises(ValueError, match="Embedding API is not supported"):
        PoolingParams(task="embed").resolve(classify)
    with pytest.raises(ValueError, match="only supported for pooling models"):
        PoolingParams().resolve(resolve(causal_dir))


def test_finish_pooled_applies_the_request_params():
    import torch

    from tp_engine.core.pooled_records import finish_pooled

    row = torch.tensor([3.0, 4.0, 12.0])
    cut = finish_pooled(row, PoolingParams("embed", 2, True, True))
    assert torch.allclose(cut, torch.tensor([0.6, 0.8]))  # cut, then renormalised
    assert finish_pooled(row, PoolingParams("embed", None, False, True)).tolist() == [3, 4, 12]
    probs = finish_pooled(row, PoolingParams("classify", None, None, True))
    assert torch.allclose(probs, torch.softmax(row, -1))  # several labels: softmax
    score = finish_pooled(torch.tensor([0.0]), PoolingParams("score", None, None, True))
    assert score.item() == 0.5  # one label: sigmoid
    raw = finish_pooled(row, PoolingParams("classify", None, None, False))
    assert raw.tolist() == [3, 4, 12]


def test_a_result_is_recorded_only_for_a_sequence_still_running():
    """Asynchronous scheduling applies a step after the next one was scheduled: a pooling
    sequence preempted (or aborted) meanwhile gets no result from it, so that its output
    carries one only when it ends with it (an aborted request's output has none)."""
    import torch

    from tp_engine.core.plan_builder import PooledRow
    from tp_engine.core.pooled_records import record_pooled
    from tp_engine.core.sequence import Sequence, SequenceStatus
    from tp_engine.sampling_params import SamplingParams

    seqs = [Sequence(name, [1, 2], SamplingParams(max_tokens=0), 0.0) for name in "abc"]
    statuses = (SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.FINISHED_ABORTED)
    for seq, status in zip(seqs, statuses, strict=True):
        seq.pooling_params = PoolingParams("embed", None, False, True)
        seq.status = status
    record_pooled(torch.eye(3), [PooledRow(seq, i) for i, seq in enumerate(seqs)])
    assert seqs[0].pooled is not None and seqs[0].pooled.tolist() == [1, 0, 0]
    assert seqs[1].pooled is None and seqs[2].pooled is None
