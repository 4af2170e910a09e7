"""The trained policy in and out: any checkpoint as a source of weights, and HF export.

A source is a training checkpoint (``RUN_DIR/checkpoints/step_N``, the ``checkpoints/``
directory or ``RUN_DIR``: their newest complete checkpoint), a weights checkpoint
(``megatron_gspo.weights``) or a Hugging Face Qwen3-MoE directory. ``open_source`` reads what it
describes (model, HF config, tokenizer, the run's config) without touching weights;
``load_source`` fills a model of any layout; ``export_hf_dir`` writes a HF directory (sharded
safetensors with an index, config.json, the tokenizer files of a HF tokenizer) bucket by bucket.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

from megatron_gspo.checkpoint.sources import (load_model_only, resolve_weights_source,
                                              training_config)
from megatron_gspo.checkpoint.weights import load_weights, read_model_config
from megatron_gspo.config import ModelConfig
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.models.hf_config import model_config_from_hf
from megatron_gspo.models.hf_io import HFCheckpoint
from megatron_gspo.models.hf_mapping import export_hf, load_hf_weights


HF_CONFIG_FILE = "hf_config.json"  # beside a weights checkpoint imported from HF
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


@dataclass(frozen=True)
class PolicySource:
    kind: str  # training | weights | hf
    path: str  # the directory the weights are read from
    model: ModelConfig
    hf_config: Optional[dict]  # the HF config.json to write back, when known
    tokenizer: str  # "builtin" or a HF tokenizer directory
    job: Optional[dict] = None  # a training checkpoint's resolved job config

    def describe(self) -> str:
        return f"{self.kind} checkpoint {self.path}"


def hf_config_at(path: str) -> Optional[dict]:
    """The config.json of a HF directory, None when ``path`` is not one."""
    cfg = os.path.join(path, "config.json") if path else ""
    if cfg and os.path.isfile(cfg):
        with open(cfg) as f:
            return json.load(f)
    return None


def open_source(path: str) -> PolicySource:
    """Describe the checkpoint at ``path``; raises ``CheckpointError`` / ``HFCheckpointError`` /
    ``FileNotFoundError`` with a one-line message naming it."""
    kind, where = resolve_weights_source(path)
    if kind == "training":
        job = training_config(where)
        model = ModelConfig(**job["model"]).validate()
        init_from = job.get("trainer", {}).get("init_from", "")
        tokenizer = job.get("data", {}).get("tokenizer", "builtin")
        return PolicySource(kind, where, model, hf_config_at(init_from), tokenizer, job)
    if kind == "weights":
        saved = os.path.join(where, HF_CONFIG_FILE)
        hf_config = None
        if os.path.isfile(saved):
            with open(saved) as f:
                hf_config = json.load(f)
        return PolicySource(kind, where, read_model_config(where), hf_config, "builtin")
    config = HFCheckpoint(where).config
    tokenizer = where if os.path.isfile(os.path.join(where, "tokenizer_config.json")) else "builtin"
    return PolicySource(kind, where, model_config_from_hf(config, os.path.basename(where)),
                        config, tokenizer)


def load_source(gpt, src: PolicySource, ctx: ParallelContext) -> None:
    """All ranks call: the source's weights into this rank's shard of ``gpt``."""
    if src.kind == "training":
        load_model_only(gpt, src.path)
    elif src.kind == "weights":
        load_weights(gpt, src.path)
    else:
        load_hf_weights(gpt, src.path, src.model, ctx)


def copy_tokenizer_files(tokenizer: str, out_dir: str) -> list:
    """A HF tokenizer directory's files into ``out_dir`` (none for the built-in tokenizer)."""
    if not tokenizer or tokenizer == "builtin" or not os.path.isdir(tokenizer):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer, name)):
            shutil.copyfile(os.path.join(tokenizer, name), os.path.join(out_dir, name))
            copied.append(name)
    return copied


def export_hf_dir(gpt, model: ModelConfig, ctx: ParallelContext, out_dir: str, *,
                  hf_config: Optional[dict] = None, tokenizer: str = "builtin",
                  bucket_bytes: int = 1 << 30) -> None:
    """All ranks call; rank 0 writes a HF directory: safetensors shards with an index (one per
    bucket, so its memory stays near two buckets), config.json (``hf_config``, the one the run
    started from, else made from ``model``) and the tokenizer files of a HF tokenizer."""
    export_hf(gpt, model, ctx, out_dir, hf_config=hf_config, bucket_bytes=bucket_bytes)
    if ctx.rank == 0:
        copy_tokenizer_files(tokenizer, out_dir)
