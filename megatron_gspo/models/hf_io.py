"""Hugging Face checkpoints read and written: safetensors shards (with an index) and config.json; HF-named tensors held in memory or drawn from a seed, read like a checkpoint."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.models.hf_config import HFCheckpointError


def _checked(path: str, name: str, tensor: torch.Tensor, shape: Optional[tuple]) -> torch.Tensor:
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise HFCheckpointError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                f"expected {tuple(shape)}")
    return tensor


class HFCheckpoint:
    """Lazy reader of a HF checkpoint directory: config.json + *.safetensors (+ index)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise HFCheckpointError(f"{path}: no config.json")
        try:
            with open(cfg_path) as f:
                self.config = json.load(f)
        except json.JSONDecodeError as e:
            raise HFCheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise HFCheckpointError(f"{path}: no .safetensors files")
            self.weight_map = {}
            for fname in files:
                with safe_open(os.path.join(path, fname), "pt") as f:
                    self.weight_map.update({k: fname for k in f.keys()})
        self._open = {}
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str, shape: Optional[tuple] = None) -> torch.Tensor:
        if name not in self.weight_map:
            raise HFCheckpointError(f"{self.path}: missing tensor {name!r}")
        fname = self.weight_map[name]
        if fname not in self._open:
            full = os.path.join(self.path, fname)
            if not os.path.isfile(full):
                raise HFCheckpointError(f"{self.path}: tensor {name!r} points to missing {fname}")
            self._open[fname] = self._safe_open(full, "pt")
        return _checked(self.path, name, self._open[fname].get_tensor(name), shape)


def write_hf_checkpoint(tensors: dict, config: dict, out_dir: str,
                        max_shard_bytes: int = 4 << 30) -> None:
    """Write ``tensors`` as safetensors shards of at most ``max_shard_bytes`` (by name order, a
    larger tensor alone), with an index, and config.json (``ShardWriter``)."""
    writer, shard, size = ShardWriter(out_dir), [], 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            writer.write(shard)
            shard, size = [], 0
        shard.append((name, t))
        size += nbytes
    writer.write(shard)
    writer.close(config)


class TensorSource:
    """HF-named tensors held in memory (e.g. received from a trainer), read like a checkpoint."""

    def __init__(self, tensors: dict, config: Optional[dict] = None, path: str = "<tensors>"):
        self.tensors, self.config, self.path = tensors, config or {}, path

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: Optional[tuple] = None) -> torch.Tensor:
        if name not in self.tensors:
            raise HFCheckpointError(f"{self.path}: missing tensor {name!r}")
        return _checked(self.path, name, self.tensors[name], shape)


class ShardWriter:
    """A HF checkpoint written one bucket (one safetensors shard) at a time, then its index (shards
    renamed ``model-0000i-of-0000N.safetensors``) and config.json: the host holds one bucket at a
    time. The same buckets give byte-identical files."""

    def __init__(self, out_dir: str):
        self.out_dir, self.weight_map, self.total, self.shards = out_dir, {}, 0, 0
        os.makedirs(out_dir, exist_ok=True)
        for f in os.listdir(out_dir):  # shards of an earlier write
            if f.endswith(".safetensors") or f == "model.safetensors.index.json":
                os.remove(os.path.join(out_dir, f))

    def write(self, bucket) -> None:
        from safetensors.torch import save_file

        self.shards += 1
        fname = f"part-{self.shards:05d}.safetensors"
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
        save_file(tensors, os.path.join(self.out_dir, fname), metadata={"format": "pt"})
        self.weight_map.update({n: fname for n in tensors})
        self.total += sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self, config: dict) -> None:
        names = {}
        for i in range(1, self.shards + 1):
            names[f"part-{i:05d}.safetensors"] = f"model-{i:05d}-of-{self.shards:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f"part-{i:05d}.safetensors"),
                       os.path.join(self.out_dir, names[f"part-{i:05d}.safetensors"]))
        weight_map = {n: names[f] for n, f in self.weight_map.items()}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f,
                      indent=2)
        with open(os.path.join(self.out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


class SeededTensors(TensorSource):
    """Random HF-named weights, each a pure function of (seed, tensor name): loading them with
    ``load_hf_weights`` initialises a model identically on every parallel layout (Megatron's own
    init draws per-rank streams). Normal(0, std) for matrices, std / sqrt(2 * layers) for the
    output projections (as Megatron scales them), ones for norms. Builds each full tensor on every
    rank: meant for models trained from scratch, not for pretrained sizes."""

    def __init__(self, m: ModelConfig, seed: int):
        super().__init__({}, {"tie_word_embeddings": False}, path=f"<seeded init {seed}>")
        self.m, self.seed = m, seed

    def __contains__(self, name: str) -> bool:
        return True

    def get(self, name: str, shape: Optional[tuple] = None) -> torch.Tensor:
        import math
        import zlib

        if shape is None:
            raise HFCheckpointError(f"{self.path}: tensor {name!r} needs a shape")
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        std = self.m.init_method_std
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2.0 * self.m.num_layers)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g) * std
