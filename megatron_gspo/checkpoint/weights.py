"""Layout-independent model weights through Megatron dist_checkpointing.

A checkpoint written from any TP/PP/EP layout loads into any other: every rank saves its shards of
``sharded_state_dict()`` with global offsets, and loading reads back exactly the slices a rank owns.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from megatron_gspo.config import ModelConfig


MODEL_CONFIG_FILE = "model_config.json"


def save_weights(gpt, path: str, model: ModelConfig) -> None:
    """All ranks call; writes a sharded checkpoint of ``gpt`` and its ModelConfig to ``path``."""
    import dataclasses

    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(gpt.sharded_state_dict(), path)
    if dist.get_rank() == 0:
        with open(os.path.join(path, MODEL_CONFIG_FILE), "w") as f:
            json.dump(dataclasses.asdict(model), f, indent=2)
    dist.barrier()


def read_model_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, MODEL_CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: not a weights checkpoint (no {MODEL_CONFIG_FILE})")
    with open(cfg_path) as f:
        return ModelConfig(**json.load(f)).validate()


def load_weights(gpt, path: str) -> None:
    """All ranks call; loads this rank's shards of a checkpoint written from any layout."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise FileNotFoundError(f"weights checkpoint {path!r} does not exist")
    state = dist_checkpointing.load(gpt.sharded_state_dict(), path)
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise KeyError(f"{path}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
