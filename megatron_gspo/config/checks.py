"""The start-up checks that need more than the schema: option names against their registries
(losses, rollout correction, rewards), the built-in tokenizer against the model's vocabulary, and
the checkpoints on disk (the trainer, the SGLang servers and the tokenizer start from one; the
model section describes it; ``model=from_checkpoint`` reads it). ``config.load.job_from_dict``
runs them once each section is valid on its own; each failure is one ``ConfigError`` line."""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_gspo.algorithms.correction import MODES, SEQUENCE_MODES
from megatron_gspo.algorithms.losses import validate_options
from megatron_gspo.checkpoint.weights import read_model_config
from megatron_gspo.config.errors import invalid
from megatron_gspo.config.job import JobConfig
from megatron_gspo.config.model import ModelConfig
from megatron_gspo.data.tokenizer import CharTokenizer
from megatron_gspo.models.hf_config import HFCheckpointError, model_config_from_hf
from megatron_gspo.rewards import REWARDS, get_reward


FROM_CHECKPOINT = "from_checkpoint"
# What a checkpoint's config.json decides under model=from_checkpoint; the rest (dtype,
# recompute, router options outside the HF format) stays the job's.
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
              "head_dim", "ffn_hidden_size", "moe_ffn_hidden_size", "num_experts", "top_k",
              "norm_topk_prob", "first_k_dense", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "aux_loss_coeff")
# Model keys a checkpoint does not decide (``check_model_against``).
NOT_SHAPE = {"name", "params_dtype", "init_method_std", "aux_loss_coeff",
             "max_position_embeddings", "activation_recompute"}
# Files that define a Hugging Face tokenizer's vocabulary (its ids).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


def check_job(job: JobConfig) -> None:
    check_options(job)
    check_starting_point(job)
    checked = set()
    for key, path in (("trainer.init_from", job.trainer.init_from),
                      ("rollout.sglang_model_path", job.rollout.sglang_model_path
                       if job.rollout.engine == "sglang" else "")):
        if path and os.path.isdir(path) and os.path.realpath(path) not in checked:
            checked.add(os.path.realpath(path))
            check_model_against(job.model, key, path)


def check_options(job: JobConfig) -> None:
    """Names and options against the registries of losses, rollout correction and rewards; the
    built-in tokenizer against the model's vocabulary."""
    a = job.algo
    if a.rollout_correction not in MODES:
        raise invalid("algo.rollout_correction", a.rollout_correction, "is unknown",
                      f"use one of {', '.join(MODES)}")
    if a.name == "gspo" and a.rollout_correction not in SEQUENCE_MODES:
        raise invalid("algo.rollout_correction", a.rollout_correction,
                      "weighs each token; gspo weighs whole sequences",
                      f"use one of {', '.join(SEQUENCE_MODES)} with gspo")
    try:
        validate_options(a.name, a.clip_low, a.clip_high, a.loss_options())
    except ValueError as e:
        key = "algo.aggregation" if "aggregation" in str(e) else (
            "algo.dual_clip" if "dual_clip" in str(e) else "algo.clip_low")
        raise invalid(key, getattr(a, key.split(".")[1]), str(e).split(": ", 1)[-1],
                      "see DEFAULT_CLIP and the algo group's options") from None
    if ":" not in job.data.reward and job.data.reward not in REWARDS:
        raise invalid("data.reward", job.data.reward, "is unknown",
                      f"use one of {', '.join(sorted(REWARDS))}, or MODULE:FUNCTION for a reward "
                      "of your own")
    try:
        get_reward(job.data.reward)
    except ValueError as e:
        raise invalid("data.reward", job.data.reward, str(e).split(": ", 1)[-1],
                      "name an importable module (on PYTHONPATH or in the working directory) "
                      "and a function in it") from None
    if job.data.tokenizer == "builtin" and job.model.vocab_size < CharTokenizer().vocab_size:
        raise invalid("model.vocab_size", job.model.vocab_size, "is smaller than the built-in "
                      f"tokenizer's {CharTokenizer().vocab_size} ids", "raise model.vocab_size")


def check_starting_point(job: JobConfig) -> None:
    """The trainer, the SGLang servers and the tokenizer start from one checkpoint: a
    pretrained ``trainer.init_from`` is not fed the built-in tokenizer's ids, and with SGLang
    the trainer starts from the weights (``trainer.init_from``) and the vocabulary
    (``data.tokenizer``) the servers serve (``rollout.sglang_model_path``)."""
    init, tok = job.trainer.init_from, job.data.tokenizer
    hf_init = bool(init) and os.path.isfile(os.path.join(init, "config.json"))
    if hf_init and tok == "builtin" and tokenizer_files(init):
        raise invalid("data.tokenizer", tok, f"trainer.init_from={init} has its own tokenizer, "
                      "and the built-in character tokenizer would feed the model ids of "
                      "another vocabulary", f"set data.tokenizer={init}")
    if job.rollout.engine != "sglang":
        return
    served = job.rollout.sglang_model_path
    if not served:
        raise invalid("rollout.sglang_model_path", served, "engine=sglang needs the checkpoint "
                      "the servers were started from", "set it to the servers' --model-path "
                      "(launch/submit.sh --model-path sets it)")
    if not init:
        raise invalid("trainer.init_from", init, f"the SGLang servers serve {served}, and the "
                      "trainer would start from random weights",
                      f"set trainer.init_from={served}")
    if hf_init and not same_path(init, served):
        raise invalid("trainer.init_from", init, "the trainer and the SGLang servers "
                      f"(rollout.sglang_model_path={served}) would start from different "
                      "weights", f"set trainer.init_from={served}")
    if not os.path.isdir(served):
        return  # not visible here: the servers check it (/model_info) at start-up
    if tok == "builtin":
        if tokenizer_files(served):
            raise invalid("data.tokenizer", tok, f"the SGLang servers serve {served}, which has "
                          "its own tokenizer", f"set data.tokenizer={served}")
    elif not same_path(tok, served):
        differs = tokenizer_difference(tok, served)
        if differs:
            raise invalid("data.tokenizer", tok, f"its {differs} differs from the one of "
                          f"rollout.sglang_model_path={served} (the servers' vocabulary)",
                          f"set data.tokenizer={served}")


def check_model_against(model: ModelConfig, key: str, path: str) -> None:
    """The model section describes the checkpoint at ``path`` (a HF directory, or a weights
    checkpoint) in every key that decides its shape."""
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            saved = model_config_from_hf(json.load(f))
    else:
        saved = read_model_config(path)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in NOT_SHAPE and getattr(saved, f.name) != getattr(model, f.name):
            raise invalid(f"model.{f.name}", getattr(model, f.name),
                          f"{key}={path} holds {getattr(saved, f.name)!r}",
                          f"set model.{f.name}={getattr(saved, f.name)!r}")


def model_from_checkpoint(job: JobConfig) -> ModelConfig:
    """``model=from_checkpoint``: the model's shape read from the Hugging Face checkpoint the job
    starts from (``trainer.init_from``, else ``rollout.sglang_model_path``)."""
    path = job.trainer.init_from or job.rollout.sglang_model_path
    config = os.path.join(path, "config.json") if path else ""
    if not config or not os.path.isfile(config):
        raise invalid("model", FROM_CHECKPOINT, "reads the model's shape from the config.json of "
                      f"trainer.init_from, and {path or 'it'!r} has none",
                      "set trainer.init_from to a Hugging Face checkpoint directory, or pick a "
                      "model group option")
    try:
        with open(config) as f:
            shape = model_config_from_hf(json.load(f), name=os.path.basename(path.rstrip("/")))
    except (HFCheckpointError, ValueError) as e:
        raise invalid("model", FROM_CHECKPOINT, f"{config}: {e}",
                      "use a Qwen3-MoE checkpoint") from None
    return dataclasses.replace(job.model, name=shape.name,
                               **{k: getattr(shape, k) for k in SHAPE_KEYS})


def tokenizer_files(path: str) -> list:
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]


def tokenizer_difference(a: str, b: str) -> str:
    """The first vocabulary file in which tokenizer directories ``a`` and ``b`` differ, or ""."""
    for name in TOKENIZER_FILES:
        fa, fb = os.path.join(a, name), os.path.join(b, name)
        if os.path.isfile(fa) != os.path.isfile(fb):
            return f"{name} (in one of them only)"
        if os.path.isfile(fa):
            with open(fa, "rb") as x, open(fb, "rb") as y:
                if x.read() != y.read():
                    return name
    return ""


def same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
