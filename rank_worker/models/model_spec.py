"""What a checkpoint is served as, decided once on rank 0: task, head and context length.

`ModelSpec.resolve(model_dir, hf_config, runner, convert, token_id)` reads the checkpoint's
config.json (with `hf_overrides` already merged in, `load_hf_config`) and the
sentence-transformers files beside it, and decides, as vLLM's `--runner` / `--convert` do:

    runner "auto":  a `modules.json` (sentence-transformers)    -> pooling
                    architecture `*ForSequenceClassification`   -> pooling
                    otherwise                                   -> generate
    convert "auto": pooling + `*ForSequenceClassification`      -> classify
                    pooling + anything else (`*ForCausalLM`)    -> embed

and then which head the model ends in (`HeadSpec`):

    generate                                   LM head (vocab-parallel, gathered to rank 0)
    embed                                      last token's final-norm hidden state, fp32
    classify, `is_original_qwen3_reranker`     logit("yes") - logit("no") of the LM head
              (`classifier_from_token` names   (Qwen3-Reranker as published: a causal LM)
              the two tokens, false first)
    classify, otherwise                        `score.weight [num_labels, hidden]` (a converted
                                               seq-cls checkpoint, e.g. tomaarsen's rerankers)

Rank 0 ships the head and the overrides to every rank in `RunnerConfig` (`head`,
`hf_overrides`), so that every rank builds the same model from the same config whatever files
it reads. The head's token ids come from rank 0's tokenizer; the workers never load one.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rank_worker.models.layers.rope_spec import RopeSpec

Task = Literal["generate", "embed", "classify"]
HeadKind = Literal["lm", "last_token", "token_score", "seq_cls"]

# sentence-transformers' module type names, in its <= 5 and 6.x spellings (vLLM reads both).
_ST_POOLING_TYPES = (
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
)
_ST_NORMALIZE_TYPES = (
    "sentence_transformers.models.Normalize",
    "sentence_transformers.base.modules.normalize.Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize",
)


@dataclass(frozen=True)
class HeadSpec:
    """The output head every rank builds; the part of `ModelSpec` the ranks need."""

    kind: HeadKind = "lm"
    # token_score: the (false, true) token ids whose logit difference is the score.
    token_ids: tuple[int, int] | None = None
    # seq_cls: rows of `score.weight`.
    num_labels: int = 1

    @property
    def num_scores(self) -> int:
        """Numbers per row of a classifying head (a reranker's: one)."""
        return 1 if self.kind == "token_score" else self.num_labels

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "token_ids": None if self.token_ids is None else list(self.token_ids),
            "num_labels": self.num_labels,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> HeadSpec:
        if data is None:
            return cls()
        ids = data.get("token_ids")
        return cls(data["kind"], None if ids is None else (int(ids[0]), int(ids[1])),
                   int(data.get("num_labels", 1)))  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint as this engine serves it (see the module docstring)."""

    task: Task
    head: HeadSpec
    rope: RopeSpec
    hidden_size: int
    # Matryoshka: `dimensions` may cut an embedding (config `is_matryoshka` or
    # `matryoshka_dimensions`, or the same through hf_overrides).
    is_matryoshka: bool = False
    # The sizes it was trained to be cut to, when the config lists them: only those are served.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # embed: L2-normalise by default (`_normalizes`).
    normalize: bool = False
    # classify: the name of each class, by head row (`_class_labels`); empty: vLLM's LABEL_<i>.
    class_labels: tuple[str, ...] = ()

    @property
    def runner(self) -> str:
        return "generate" if self.task == "generate" else "pooling"

    @property
    def is_pooling(self) -> bool:
        return self.task != "generate"

    @property
    def max_positions(self) -> int:
        return self.rope.max_positions

    @classmethod
    def resolve(
        cls,
        model_dir: str | Path,
        hf_config: Any,
        runner: str = "auto",
        convert: str = "auto",
        token_id: Any = None,
    ) -> ModelSpec:
        """Decide task and head (module docstring). `token_id(text) -> int | None`: the
        tokenizer's id of a token (for `classifier_from_token`). ValueError says what does
        not fit. `runner` and `convert` take `EngineConfig`'s values, checked there."""
        model_dir = Path(model_dir)
        modules = _st_modules(model_dir)
        is_seq_cls = any(a.endswith("ForSequenceClassification") for a in _archs(hf_config))
        if runner == "auto":
            runner = "pooling" if modules is not None or is_seq_cls else "generate"
        task = _task(runner, convert, is_seq_cls)
        if task == "embed":
            _check_last_token_pooling(model_dir, modules)
        head = _head(task, hf_config, token_id)
        return cls(
            task=task,
            head=head,
            rope=RopeSpec.from_config(hf_config),
            hidden_size=int(hf_config.hidden_size),
            is_matryoshka=bool(
                getattr(hf_config, "is_matryoshka", False)
                or getattr(hf_config, "matryoshka_dimensions", None)
            ),
            matryoshka_dimensions=_matryoshka_dimensions(hf_config),
            normalize=_normalizes(modules),
            class_labels=_class_labels(hf_config, head) if task == "classify" else (),
        )


def _matryoshka_dimensions(hf_config: Any) -> tuple[int, ...] | None:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return None if not dims else tuple(int(d) for d in dims)


def load_hf_config(model_dir: str | Path, hf_overrides: dict[str, Any] | None = None) -> Any:
    """The checkpoint's `config.json` as a transformers config object, `hf_overrides` merged
    into the file's fields first (vLLM's `--hf-overrides`): transformers then normalises the
    result as it would the file (a legacy `rope_scaling` becomes `rope_parameters`)."""
    from transformers import AutoConfig, PretrainedConfig  # deferred: slow to import
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not hf_overrides:
        return AutoConfig.from_pretrained(str(model_dir))
    config_dict, _ = PretrainedConfig.get_config_dict(str(model_dir))
    config_dict = {**config_dict, **_with_base_rope_theta(hf_overrides, config_dict)}
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{model_dir}: config.json has no known model_type ({model_type!r})")
    return CONFIG_MAPPING[model_type].from_dict(config_dict)


def _with_base_rope_theta(overrides: dict[str, Any], config_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of `overrides` (transformers edits the dicts it is given in place) with the
    rope_theta they mean put where transformers reads it.

    transformers 5 takes the base frequency from `rope_parameters` when there is one (a
    transformers 5 config.json keeps it only there). So a rope override that names the
    scaling only (the model card's YaRN override) would lose the checkpoint's theta (10000,
    not Qwen3's 1e6), and a top-level `rope_theta` override would be ignored: silently wrong
    positions either way. The theta is the override's own, else the checkpoint's."""
    base = config_dict.get("rope_parameters")
    base = base if isinstance(base, dict) else None
    # A legacy config.json: transformers reads its top-level rope_theta itself.
    theta = overrides.get("rope_theta", None if base is None else base.get("rope_theta"))
    out = copy.deepcopy(overrides)
    ropes = [k for k in ("rope_parameters", "rope_scaling") if isinstance(out.get(k), dict)]
    if not ropes and "rope_theta" in overrides and base is not None:
        out["rope_parameters"] = {**base, "rope_theta": theta}
    for key in ropes:
        if theta is not None and ("rope_theta" not in out[key] or "rope_theta" in overrides):
            out[key]["rope_theta"] = theta
    return out


def _archs(hf_config: Any) -> list[str]:
    return list(getattr(hf_config, "architectures", None) or ())


def _st_modules(model_dir: Path) -> list[str] | None:
    """The module types of a sentence-transformers `modules.json`; None without one."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    return [str(m.get("type", "")) for m in json.loads(path.read_text())]


def _normalizes(modules: list[str] | None) -> bool:
    """Whether embeddings are L2-normalised by default. vLLM's embed default is yes; a
    sentence-transformers model says it through a Normalize module, and one without (its
    vectors are used raw there) is served raw too."""
    return modules is None or any(m in _ST_NORMALIZE_TYPES for m in modules)


def _task(runner: str, convert: str, is_seq_cls: bool) -> Task:
    if runner == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(f"convert {convert!r} needs runner 'pooling' (got 'generate')")
        return "generate"
    if convert == "auto":
        return "classify" if is_seq_cls else "embed"
    if convert == "none":
        if not is_seq_cls:
            raise ValueError(
                "runner 'pooling' with convert 'none' needs a pooling architecture "
                "(*ForSequenceClassification); use convert 'embed' or 'classify'"
            )
        return "classify"
    return convert  # type: ignore[return-value]


# What a served sentence-transformers pipeline may hold (by class name, whatever the
# version's module path): the body, its pooling and the L2 normalisation. Anything else (a
# Dense projection, a LayerNorm) would change the vector, and is not computed here.
_ST_SERVED_MODULES = ("Transformer", "Pooling", "Normalize")


def _check_last_token_pooling(model_dir: Path, modules: list[str] | None) -> None:
    """Only last-token pooling is served (Qwen3-Embedding's), with nothing after it but the
    normalisation; refuse another pooling mode or module rather than return vectors the
    checkpoint's users would not get elsewhere."""
    if modules is None:
        return
    for module in modules:
        if module.rsplit(".", 1)[-1] not in _ST_SERVED_MODULES:
            raise ValueError(
                f"{model_dir / 'modules.json'}: sentence-transformers module {module!r} is not "
                f"supported (only {', '.join(_ST_SERVED_MODULES)})"
            )
    entries = json.loads((model_dir / "modules.json").read_text())
    for entry in entries:
        if entry.get("type") not in _ST_POOLING_TYPES:
            continue
        config_path = model_dir / entry.get("path", "") / "config.json"
        if not config_path.is_file():
            continue
        config = json.loads(config_path.read_text())
        mode = config.get("pooling_mode")  # sentence-transformers >= 6
        if mode is None:  # <= 5: one `pooling_mode_<name>: true` flag
            modes = [k.removeprefix("pooling_mode_") for k, v in config.items()
                     if k.startswith("pooling_mode_") and v is True]  # fmt: skip
            mode = modes[0] if len(modes) == 1 else ",".join(modes)
        if mode != "lasttoken":
            raise ValueError(
                f"{config_path}: pooling mode {mode!r} is not supported (only 'lasttoken')"
            )


def _class_labels(hf_config: Any, head: HeadSpec) -> tuple[str, ...]:
    """A classifier's `id2label`, one name per number its head scores; none where the count
    differs (transformers gives a config without labels two LABEL_<i>, where a reranker's
    head scores one number)."""
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    if sorted(id2label) != list(range(head.num_scores)):
        return ()
    return tuple(id2label[i] for i in range(head.num_scores))


def _head(task: Task, hf_config: Any, token_id: Any) -> HeadSpec:
    if task == "generate":
        return HeadSpec("lm")
    if task == "embed":
        return HeadSpec("last_token")
    tokens = getattr(hf_config, "classifier_from_token", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False) or tokens:
        return HeadSpec("token_score", token_ids=_classifier_token_ids(tokens, token_id))
    return HeadSpec("seq_cls", num_labels=int(getattr(hf_config, "num_labels", 1)))


def _classifier_token_ids(tokens: Any, token_id: Any) -> tuple[int, int]:
    """The (false, true) ids of `classifier_from_token` (vLLM's order: false first)."""
    if not isinstance(tokens, list | tuple) or len(tokens) != 2:
        raise ValueError(
            "an original Qwen3 reranker needs classifier_from_token with two tokens, e.g. "
            f'["no", "yes"] (false first); got {tokens!r}'
        )
    if token_id is None:
        raise ValueError("classifier_from_token needs the tokenizer to find its ids")
    ids = []
    for text in tokens:
        tid = token_id(text)
        if tid is None:
            raise ValueError(f"classifier_from_token: {text!r} is not one token of the tokenizer")
        ids.append(int(tid))
    return ids[0], ids[1]
