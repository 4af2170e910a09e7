"""A run's checkpoints as sources of weights: the newest complete one, what a path holds, the config a run saved, the model's weights alone."""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron_gspo.checkpoint.manager import (LATEST, STATE, STEP_DIR, CheckpointError,
                                              check_complete)


def latest_complete(root: str) -> Optional[str]:
    """The newest complete checkpoint under a ``checkpoints/`` directory (``latest`` first), read
    from the file system alone (every rank finds the same one)."""
    names = []
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            names.append(f.read().strip())
    if os.path.isdir(root):
        names += sorted((n for n in os.listdir(root) if STEP_DIR.match(n)), reverse=True)
    for name in names:
        path = os.path.join(root, name)
        if name and os.path.isdir(path) and check_complete(path) is None:
            return path
    return None


def resolve_weights_source(path: str) -> tuple[str, str]:
    """What ``path`` holds: ("training", step dir) for a training checkpoint, a run's
    ``checkpoints/`` directory or a run directory (their newest complete checkpoint);
    ("weights", dir) for a weights checkpoint; ("hf", dir) for a HF directory. Anything else is a
    ``CheckpointError`` naming the path."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if os.path.isfile(os.path.join(path, STATE)):
        problem = check_complete(path)
        if problem:
            raise CheckpointError(f"{path}: incomplete training checkpoint ({problem})")
        return "training", path
    for root in (path, os.path.join(path, "checkpoints")):
        if os.path.isfile(os.path.join(root, LATEST)) or any(
                STEP_DIR.match(n) for n in (os.listdir(root) if os.path.isdir(root) else [])):
            found = latest_complete(root)
            if found is None:
                raise CheckpointError(f"{root}: no complete checkpoint")
            return "training", found
    if os.path.isfile(os.path.join(path, "model_config.json")):
        return "weights", path
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    raise CheckpointError(f"{path}: not a training checkpoint, run directory, weights checkpoint "
                          "or Hugging Face directory")


def training_config(path: str) -> dict:
    """The resolved job config (a dict) a training checkpoint was saved with."""
    with open(os.path.join(path, STATE)) as f:
        state = json.load(f)
    if "config" not in state:
        raise CheckpointError(f"{path}: {STATE} has no config")
    return state["config"]


def load_model_only(model, path: str) -> None:
    """All ranks call: the model weights of a training checkpoint (saved from any layout) into
    this rank's ``model``; the optimizer's shards are not read."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    missing, _ = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
