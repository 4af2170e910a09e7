"""Typed configuration of the stack: one small dataclass per component, validated where defined.

The dataclasses are the Hydra schema (registered in a ConfigStore by ``register_configs``); YAML files
under ``conf/`` only choose values. Every validation error is a ``ConfigError`` whose message is one
line naming the key, the bad value and the fix, raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key and the fix."""


def _err(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {problem}; fix: {fix}")


@dataclass
class ModelConfig:
    """A Qwen3-MoE shaped decoder (RMSNorm, SwiGLU, RoPE, QK-norm, no bias, untied embeddings)."""

    name: str = "tiny_moe"
    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 32
    ffn_hidden_size: int = 256  # dense layers (leading dense layers, HF "intermediate_size")
    moe_ffn_hidden_size: int = 64  # per expert (HF "moe_intermediate_size")
    num_experts: int = 8  # 0 makes every layer dense
    top_k: int = 2
    norm_topk_prob: bool = True
    aux_loss_coeff: float = 1e-3
    first_k_dense: int = 0  # leading dense layers (HF "mlp_only_layers" = [0 .. k-1])
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 2048
    init_method_std: float = 0.02
    params_dtype: str = "float32"  # float32 | bfloat16

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE layer, 0 for a dense one, per layer."""
        if not self.is_moe:
            return [0] * self.num_layers
        return [0 if i < self.first_k_dense else 1 for i in range(self.num_layers)]

    def validate(self) -> "ModelConfig":
        positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                    "num_query_groups", "head_dim", "ffn_hidden_size")
        for key in positive:
            if getattr(self, key) <= 0:
                raise _err(f"model.{key}", getattr(self, key), "must be positive", "set a value > 0")
        if self.num_attention_heads % self.num_query_groups:
            raise _err("model.num_query_groups", self.num_query_groups,
                       f"does not divide num_attention_heads={self.num_attention_heads}",
                       "choose a divisor of the head count")
        if self.num_experts < 0:
            raise _err("model.num_experts", self.num_experts, "is negative", "use 0 for dense or >= 1")
        if self.is_moe:
            if not 1 <= self.top_k <= self.num_experts:
                raise _err("model.top_k", self.top_k, f"must be in [1, num_experts={self.num_experts}]",
                           "lower top_k or add experts")
            if self.moe_ffn_hidden_size <= 0:
                raise _err("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size, "must be positive",
                           "set the per-expert hidden size")
            if not 0 <= self.first_k_dense < self.num_layers:
                raise _err("model.first_k_dense", self.first_k_dense,
                           f"must be in [0, num_layers={self.num_layers})", "keep at least one MoE layer")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise _err("model.params_dtype", self.params_dtype, "is not supported",
                       "use float32 or bfloat16")
        return self


@dataclass
class ParallelConfig:
    """Parallel layout. Data parallel size is what is left of the world size."""

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    ep: int = 1  # expert parallel
    cp: int = 1  # context parallel
    etp: Optional[int] = None  # expert tensor parallel; None means tp (megatron-core's default)
    sequence_parallel: bool = False
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def validate(self, world_size: int, model: ModelConfig, *, device_type: str = "cpu") -> int:
        """Check the layout against the world size and the model; returns the data parallel size."""
        for key in ("tp", "pp", "ep", "cp", "expert_tp"):
            if getattr(self, key) < 1:
                name = "etp" if key == "expert_tp" else key
                raise _err(f"parallel.{name}", getattr(self, key), "must be >= 1", "use 1 to disable")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise _err("parallel.backend", self.backend, "is unknown", "use auto, gloo or nccl")
        if self.device not in ("auto", "cpu", "cuda"):
            raise _err("parallel.device", self.device, "is unknown", "use auto, cpu or cuda")
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise _err("parallel.tp*pp*cp", model_parallel,
                       f"does not divide the world size {world_size}",
                       "launch a multiple of tp*pp*cp ranks or shrink the layout")
        dp = world_size // model_parallel
        if self.ep > 1 and not model.is_moe:
            raise _err("parallel.ep", self.ep, "needs an MoE model (model.num_experts > 0)", "set ep=1")
        if model.is_moe:
            if model.num_experts % self.ep:
                raise _err("parallel.ep", self.ep,
                           f"does not divide model.num_experts={model.num_experts}",
                           "choose ep dividing the expert count")
            expert_block = self.expert_tp * self.ep * self.pp
            if world_size % expert_block:
                raise _err("parallel.ep*etp*pp", expert_block,
                           f"does not divide the world size {world_size}",
                           "launch a multiple of ep*etp*pp ranks")
            if (world_size // self.pp) % (self.ep * self.expert_tp):
                raise _err("parallel.ep", self.ep, f"ep*etp does not divide tp*cp*dp="
                           f"{world_size // self.pp}", "launch more ranks or lower ep")
            if self.tp > 1 and not self.sequence_parallel:
                raise _err("parallel.sequence_parallel", self.sequence_parallel,
                           f"tp={self.tp} with MoE requires sequence parallel",
                           "set parallel.sequence_parallel=true")
            if self.tp > 1 and self.ep == 1 and self.expert_tp == 1:
                # megatron-core marks expert weights as ordinary data-parallel weights when ep == 1,
                # so their gradients (from different sequence-parallel tokens on each TP rank)
                # would never be summed across the TP group.
                raise _err("parallel.etp", self.etp, f"etp=1 with tp={self.tp} and ep=1 leaves expert "
                           "gradients unreduced across the TP group",
                           "leave etp unset (= tp) or use ep > 1")
            if model.moe_ffn_hidden_size % self.expert_tp:
                raise _err("parallel.etp", self.etp,
                           f"does not divide model.moe_ffn_hidden_size={model.moe_ffn_hidden_size}",
                           "choose etp dividing it")
        if self.sequence_parallel and self.tp == 1:
            raise _err("parallel.sequence_parallel", True, "needs tp > 1",
                       "set parallel.sequence_parallel=false or tp >= 2")
        if model.num_layers % self.pp:
            raise _err("parallel.pp", self.pp, f"does not divide model.num_layers={model.num_layers}",
                       "choose pp dividing the layer count")
        for key in ("num_attention_heads", "num_query_groups", "vocab_size", "ffn_hidden_size"):
            if getattr(model, key) % self.tp:
                raise _err("parallel.tp", self.tp, f"does not divide model.{key}={getattr(model, key)}",
                           f"choose tp dividing model.{key}")
        if self.cp > 1 and device_type == "cpu":
            raise _err("parallel.cp", self.cp, "context-parallel attention needs Transformer Engine "
                       "on GPU", "set parallel.cp=1 on CPU")
        return dp


@dataclass
class DemoConfig:
    """The model smoke run that ``python -m megatron_gspo`` performs."""

    batch_size: int = 4
    seq_length: int = 32
    steps: int = 2
    lr: float = 1e-3
    updates_per_batch: int = 2  # optimizer steps on each batch (update drift compares their routes)
    drift: bool = True  # expert-drift instrumentation (TensorBoard, drift.jsonl, drift_report.html)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    seed: int = 1234
    run_dir: str = "."


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)


def to_dataclass(cls, node) -> Any:
    """Build the flat dataclass ``cls`` from an OmegaConf node or dict; unknown keys are errors."""
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        key = sorted(unknown)[0]
        raise _err(key, data[key], f"is not a field of {cls.__name__}",
                   f"use one of {', '.join(f.name for f in dataclasses.fields(cls))}")
    return cls(**kwargs)


def job_from_omegaconf(node) -> JobConfig:
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(node, resolve=True)
    return JobConfig(
        model=to_dataclass(ModelConfig, data.get("model", {})).validate(),
        parallel=to_dataclass(ParallelConfig, data.get("parallel", {})),
        demo=to_dataclass(DemoConfig, data.get("demo", {})),
        seed=int(data.get("seed", 1234)),
        run_dir=str(data.get("run_dir", ".")),
    )
