"""Where a run resumes from, checked before its model is built: the newest complete checkpoint
(``trainer.resume``), its configuration compared with the job's. A model of another shape is one
line naming each differing key and the fix; the other differences are listed when it resumes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from megatron_gspo.checkpoint.manager import CheckpointError, CheckpointManager
from megatron_gspo.checkpoint.sources import training_config
from megatron_gspo.config import JobConfig
from megatron_gspo.config.errors import ConfigError
from megatron_gspo.config.load import job_to_dict


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from and ``(key, saved value, value now)`` of every key of
    the job's configuration that differs from the checkpoint's."""

    path: str
    changes: list


def resume_point(job: JobConfig, ckpt: CheckpointManager) -> Optional[ResumePoint]:
    """The checkpoint to resume from, None for a fresh run (every rank: the candidates are
    rank 0's, broadcast)."""
    mode = job.trainer.resume
    if mode == "never":
        return None
    candidates = ckpt.candidates() if mode == "auto" else [os.path.abspath(mode)]
    if not candidates:
        if mode != "auto":
            raise CheckpointError(f"trainer.resume={mode!r}: no such checkpoint")
        return None
    path = candidates[0]
    try:
        saved = training_config(path)
    except CheckpointError:  # (saved without its configuration: nothing to compare)
        saved = {}
    changes = config_changes(saved, job_to_dict(job)) if saved else []
    _check_model_shape(job, path, saved, [c for c in changes if c[0] in SHAPE_KEYS])
    return ResumePoint(path, changes)


# The model's keys that shape its weights: a checkpoint loads only into the same values.
SHAPE_KEYS = {f"model.{k}" for k in (
    "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
    "head_dim", "ffn_hidden_size", "moe_ffn_hidden_size", "num_experts", "first_k_dense",
    "shared_expert_ffn_hidden_size", "router_expert_bias")}


def _check_model_shape(job: JobConfig, path: str, saved: dict, differ: list) -> None:
    """One line where the model's shape keys ``differ`` from the checkpoint's: each of them,
    and the fix that brings them back (the model group or the checkpoint it was read from)."""
    if not differ:
        return
    key, _, now = differ[0]
    held = ", ".join(f"{k}={was!r}" for k, was, _ in differ)
    model, init = saved.get("model", {}), saved.get("trainer", {}).get("init_from")
    if job.model.name != model.get("name") and init and init != job.trainer.init_from:
        fix = f"trainer.init_from={init} (the model's checkpoint it started from)"
    elif job.model.name != model.get("name"):
        fix = f"model={model.get('name')}"
    else:
        fix = held
    other = ("name a checkpoint of this model (trainer.resume=...)"
             if job.trainer.resume != "auto" else "start another run directory (hydra.run.dir=...)")
    raise ConfigError(f"{key}={now!r}: the checkpoint {path} holds a model with {held}; fix: "
                      f"resume with {fix}, or {other}")


def config_changes(saved: dict, now: dict) -> list:
    """``(key, saved value, value now)`` for every dotted key the checkpoint's configuration
    has whose value differs (the run's directory and its resume setting aside; keys added
    since it was saved are not changes), in the order of ``now``."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    was, now = flat(saved), flat(json.loads(json.dumps(now)))  # (tuples as JSON keeps them)
    return [(k, was[k], v) for k, v in now.items()
            if k in was and k not in ("run_dir", "trainer.resume") and was[k] != v]
