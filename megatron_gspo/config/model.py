"""The model's shape and the parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gspo.config.errors import invalid


@dataclass
class ModelConfig:
    """A Qwen3-MoE shaped decoder (RMSNorm, SwiGLU, RoPE, QK-norm, no bias, untied embeddings)."""

    # a label (the model group's file name; from_checkpoint: the checkpoint's)
    name: str = "tiny_moe"
    vocab_size: int = 256  # token ids (HF "vocab_size")
    hidden_size: int = 128  # HF "hidden_size"
    num_layers: int = 4  # HF "num_hidden_layers"
    num_attention_heads: int = 4  # query heads
    num_query_groups: int = 2  # key / value heads (GQA; HF "num_key_value_heads")
    head_dim: int = 32  # HF "head_dim"
    ffn_hidden_size: int = 256  # dense layers (leading dense layers, HF "intermediate_size")
    moe_ffn_hidden_size: int = 64  # per expert (HF "moe_intermediate_size")
    num_experts: int = 8  # 0 makes every layer dense
    top_k: int = 2  # experts per token (HF "num_experts_per_tok")
    norm_topk_prob: bool = True  # renormalise the top-k routing weights (HF "norm_topk_prob")
    aux_loss_coeff: float = 1e-3  # load-balancing loss of pretraining (used by the SFT warm-up)
    router_score_function: str = "softmax"  # softmax (Qwen3-MoE) | sigmoid
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias nudged after every update
    # towards equal load; needs router_score_function=sigmoid (Megatron's implementation).
    router_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3  # router_expert_bias: the bias's step per update
    first_k_dense: int = 0  # leading dense layers (HF "mlp_only_layers" = [0 .. k-1])
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    rms_norm_eps: float = 1e-6  # HF "rms_norm_eps"
    rope_theta: float = 1_000_000.0  # RoPE base (HF "rope_theta")
    max_position_embeddings: int = 2048  # longest sequence (prompt + response)
    # random initialisation's standard deviation (no trainer.init_from)
    init_method_std: float = 0.02
    params_dtype: str = "float32"  # float32 | bfloat16
    # none | full (Megatron's full recompute, one layer at a time: each layer keeps only its
    # input for the backward; about a third more compute, activations of one layer)
    activation_recompute: str = "none"

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
                raise invalid(f"model.{key}", getattr(self, key), "must be positive",
                              "set a value > 0")
        if self.num_attention_heads % self.num_query_groups:
            raise invalid("model.num_query_groups", self.num_query_groups,
                          f"does not divide num_attention_heads={self.num_attention_heads}",
                          "choose a divisor of the head count")
        if self.num_experts < 0:
            raise invalid("model.num_experts", self.num_experts, "is negative",
                          "use 0 for dense or >= 1")
        if self.is_moe:
            if not 1 <= self.top_k <= self.num_experts:
                raise invalid("model.top_k", self.top_k,
                              f"must be in [1, num_experts={self.num_experts}]",
                              "lower top_k or add experts")
            if self.moe_ffn_hidden_size <= 0:
                raise invalid("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size,
                              "must be positive",
                              "set the per-expert hidden size")
            if not 0 <= self.first_k_dense < self.num_layers:
                raise invalid("model.first_k_dense", self.first_k_dense,
                              f"must be in [0, num_layers={self.num_layers})",
                              "keep at least one MoE layer")
        if self.router_score_function not in ("softmax", "sigmoid"):
            raise invalid("model.router_score_function", self.router_score_function, "is unknown",
                          "use softmax or sigmoid")
        if self.router_expert_bias and self.router_score_function != "sigmoid":
            raise invalid("model.router_expert_bias", True, "Megatron's aux-loss-free expert bias "
                          "needs sigmoid router scores", "set model.router_score_function=sigmoid")
        if self.aux_loss_coeff < 0:
            raise invalid("model.aux_loss_coeff", self.aux_loss_coeff, "must be >= 0",
                          "use 0 to disable")
        if self.activation_recompute not in ("none", "full"):
            raise invalid("model.activation_recompute", self.activation_recompute, "is unknown",
                          "use none or full")
        if self.params_dtype not in ("float32", "bfloat16"):
            raise invalid("model.params_dtype", self.params_dtype, "is not supported",
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
    # split activations along the sequence over TP ranks (needed for tp > 1 with MoE)
    sequence_parallel: bool = False
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl
    # auto (a GPU when one is visible, else the CPU) | cpu | cuda (a GPU or a one-line error:
    # the GPU recipes say cuda, so that a job without GPUs never falls back to the CPU)
    device: str = "auto"
    # Seconds a collective may wait before the process groups give up (the world, Megatron's
    # groups, the replica groups). Generous: while a replica's leader generates (minutes for
    # long responses) or waits for SGLang servers to load, its other ranks wait in a broadcast.
    timeout_s: float = 10800.0

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def validate(self, world_size: int, model: ModelConfig, *, device_type: str = "cpu",
                 have_te: bool = False) -> int:
        """Check the layout against the world size and the model; returns the data parallel size.
        ``have_te``: Transformer Engine imports (its context-parallel attention)."""
        if not self.timeout_s > 0:
            raise invalid("parallel.timeout_s", self.timeout_s, "must be > 0", "e.g. 10800 (3 h)")
        if self.cp > 1 and device_type == "cuda" and not have_te:
            # The SDPA fallback (megatron_gspo/models/layers.py) all-gathers K and V and masks a dense
            # [Q, K] product over the whole packed row: quadratic in the row, no flash kernel.
            raise invalid("parallel.cp", self.cp, "context parallelism on GPUs needs Transformer "
                          "Engine's attention (without it attention would be quadratic in the "
                          "packed row, with no flash kernel)", "install Transformer Engine (the "
                          "GPU image has it; pip install -e .[gpu]) or set parallel.cp=1")
        for key in ("tp", "pp", "ep", "cp", "expert_tp"):
            if getattr(self, key) < 1:
                name = "etp" if key == "expert_tp" else key
                raise invalid(f"parallel.{name}", getattr(self, key), "must be >= 1",
                              "use 1 to disable")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise invalid("parallel.backend", self.backend, "is unknown", "use auto, gloo or nccl")
        if self.device not in ("auto", "cpu", "cuda"):
            raise invalid("parallel.device", self.device, "is unknown", "use auto, cpu or cuda")
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise invalid("parallel.tp*pp*cp", model_parallel,
                          f"does not divide the world size {world_size}",
                          "launch a multiple of tp*pp*cp ranks or shrink the layout")
        dp = world_size // model_parallel
        if self.ep > 1 and not model.is_moe:
            raise invalid("parallel.ep", self.ep, "needs an MoE model (model.num_experts > 0)",
                          "set ep=1")
        if model.is_moe:
            if model.num_experts % self.ep:
                raise invalid("parallel.ep", self.ep,
                              f"does not divide model.num_experts={model.num_experts}",
                              "choose ep dividing the expert count")
            expert_block = self.expert_tp * self.ep * self.pp
            if world_size % expert_block:
                raise invalid("parallel.ep*etp*pp", expert_block,
                              f"does not divide the world size {world_size}",
                              "launch a multiple of ep*etp*pp ranks")
            if (world_size // self.pp) % (self.ep * self.expert_tp):
                raise invalid("parallel.ep", self.ep, f"ep*etp does not divide tp*cp*dp="
                              f"{world_size // self.pp}", "launch more ranks or lower ep")
            if self.tp > 1 and not self.sequence_parallel:
                raise invalid("parallel.sequence_parallel", self.sequence_parallel,
                              f"tp={self.tp} with MoE requires sequence parallel",
                              "set parallel.sequence_parallel=true")
            if self.tp > 1 and self.ep == 1 and self.expert_tp == 1:
                # megatron-core marks expert weights as ordinary data-parallel weights when ep == 1,
                # so their gradients (from different sequence-parallel tokens on each TP rank)
                # would never be summed across the TP group.
                raise invalid("parallel.etp", self.etp,
                              f"etp=1 with tp={self.tp} and ep=1 leaves expert "
                              "gradients unreduced across the TP group",
                              "leave etp unset (= tp) or use ep > 1")
            if model.moe_ffn_hidden_size % self.expert_tp:
                raise invalid("parallel.etp", self.etp,
                              "does not divide model.moe_ffn_hidden_size="
                              f"{model.moe_ffn_hidden_size}",
                              "choose etp dividing it")
        if self.sequence_parallel and self.tp == 1:
            raise invalid("parallel.sequence_parallel", True, "needs tp > 1",
                          "set parallel.sequence_parallel=false or tp >= 2")
        if model.num_layers % self.pp:
            raise invalid("parallel.pp", self.pp,
                          f"does not divide model.num_layers={model.num_layers}",
                          "choose pp dividing the layer count")
        for key in ("num_attention_heads", "num_query_groups", "vocab_size", "ffn_hidden_size"):
            if getattr(model, key) % self.tp:
                raise invalid("parallel.tp", self.tp,
                              f"does not divide model.{key}={getattr(model, key)}",
                              f"choose tp dividing model.{key}")
        return dp
