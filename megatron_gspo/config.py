"""Typed configuration of the stack: one small dataclass per component, validated where defined.

The dataclasses are the Hydra schema (registered in a ConfigStore by ``register_configs``); YAML files
under ``conf/`` only choose values. Every validation error is a ``ConfigError`` whose message is one
line naming the key, the bad value and the fix, raised before any process group exists.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional


def conf_dir() -> str:
    """The config groups: ``conf/`` shipped inside the installed package, else the checkout's."""
    here = os.path.dirname(os.path.abspath(__file__))
    shipped = os.path.join(here, "conf")
    return shipped if os.path.isdir(shipped) else os.path.join(os.path.dirname(here), "conf")


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
    aux_loss_coeff: float = 1e-3  # load-balancing loss of pretraining (used by the SFT warm-up)
    router_score_function: str = "softmax"  # softmax (Qwen3-MoE) | sigmoid
    # Aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias nudged after every update
    # towards equal load; needs router_score_function=sigmoid (Megatron's implementation).
    router_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3
    first_k_dense: int = 0  # leading dense layers (HF "mlp_only_layers" = [0 .. k-1])
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 2048
    init_method_std: float = 0.02
    params_dtype: str = "float32"  # float32 | bfloat16
    # Without Transformer Engine: a layer's local experts as two grouped matmuls
    # (megatron_gspo/grouped_experts.py) instead of Megatron's loop over them.
    grouped_experts: bool = True
    # On CPU, fp32 SwiGLU experts through a C++ kernel built at first use (whole experts per
    # OpenMP thread; megatron_gspo/cpu_kernels.py); where it cannot be built, or with false, the
    # PyTorch loop over the experts runs instead (same results, slower).
    cpu_experts_kernel: bool = True
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
        if self.router_score_function not in ("softmax", "sigmoid"):
            raise _err("model.router_score_function", self.router_score_function, "is unknown",
                       "use softmax or sigmoid")
        if self.router_expert_bias and self.router_score_function != "sigmoid":
            raise _err("model.router_expert_bias", True, "Megatron's aux-loss-free expert bias "
                       "needs sigmoid router scores", "set model.router_score_function=sigmoid")
        if self.aux_loss_coeff < 0:
            raise _err("model.aux_loss_coeff", self.aux_loss_coeff, "must be >= 0",
                       "use 0 to disable")
        if self.activation_recompute not in ("none", "full"):
            raise _err("model.activation_recompute", self.activation_recompute, "is unknown",
                       "use none or full")
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
            raise _err("parallel.timeout_s", self.timeout_s, "must be > 0", "e.g. 10800 (3 h)")
        if self.cp > 1 and device_type == "cuda" and not have_te:
            # The SDPA fallback (megatron_gspo/layers.py) all-gathers K and V and masks a dense
            # [Q, K] product over the whole packed row: quadratic in the row, no flash kernel.
            raise _err("parallel.cp", self.cp, "context parallelism on GPUs needs Transformer "
                       "Engine's attention (without it attention would be quadratic in the "
                       "packed row, with no flash kernel)", "install Transformer Engine (the "
                       "GPU image has it; pip install -e .[gpu]) or set parallel.cp=1")
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
        return dp


ALGOS = ("gspo", "gspo_token", "grpo")


@dataclass
class AlgoConfig:
    """The policy objective (``megatron_gspo.losses``). Clip ranges default to the paper's:
    GSPO (3e-4, 4e-4), GRPO (0.2, 0.27)."""

    name: str = "gspo"  # gspo | gspo_token | grpo
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    aggregation: str = "seq_mean"  # seq_mean (the paper) | token_mean (GRPO only, DAPO-style)
    dual_clip: Optional[float] = None  # GRPO only
    kl_coef: float = 0.0  # > 0 builds a frozen reference model (k3 estimator)
    entropy_coef: float = 0.0
    minibatches: int = 4  # policy updates per rollout batch (the paper: 4; later ones off-policy)
    # Which rows make a mini-batch: interleaved (every minibatches-th row: each mini-batch holds
    # some rows of every prompt) | groups (every minibatches-th group, whole, as verl and slime
    # split a batch: a group's prompt is then fed once for all its rows, trainer.share_prompts).
    minibatch_split: str = "interleaved"
    scale_advantages: bool = True  # divide by the group's reward std
    # MoE router losses during RL (the warm-up uses model.aux_loss_coeff). Default 0: GSPO's
    # objective has no such term, its gradient does not scale with the advantages (it would
    # dominate the small clipped GSPO updates), and under R2 / R3 it would push routers that
    # the replayed routes override. Response tokens only (never prompt or padding) when on.
    aux_loss_coeff: float = 0.0  # load-balancing loss (Switch-style, per micro-batch)
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    # Behaviour (old-policy) log-probs: recompute (the trainer's forward-only pass on the old
    # policy) | engine (the rollout engine's on every row; no pass) | auto (engine where the
    # engine is the trainer's own fp32 model on CPU, so that its log-probs are the old
    # policy's to float rounding, but the first mini-batch's from its update's forward;
    # recompute elsewhere: SGLang, GPU, bf16, R2, R3, rollout correction).
    old_logprobs: str = "auto"
    # Rollout correction for the engine/trainer mismatch (megatron_gspo.correction): none |
    # token_tis | seq_tis (weights min(ratio, cap)) | seq_mis (sequences outside [low, high]
    # dropped); gspo takes the sequence modes only.
    rollout_correction: str = "none"
    rollout_correction_cap: float = 2.0
    rollout_correction_low: float = 0.5
    rollout_correction_high: float = 2.0

    def validate(self) -> "AlgoConfig":
        from megatron_gspo.correction import MODES, SEQUENCE_MODES
        from megatron_gspo.losses import validate_options

        if self.rollout_correction not in MODES:
            raise _err("algo.rollout_correction", self.rollout_correction, "is unknown",
                       f"use one of {', '.join(MODES)}")
        if self.name == "gspo" and self.rollout_correction not in SEQUENCE_MODES:
            raise _err("algo.rollout_correction", self.rollout_correction,
                       "weighs each token; gspo weighs whole sequences",
                       f"use one of {', '.join(SEQUENCE_MODES)} with gspo")
        if not (0 < self.rollout_correction_low <= 1 <= self.rollout_correction_high
                and self.rollout_correction_cap >= 1):
            raise _err("algo.rollout_correction_low", self.rollout_correction_low,
                       "needs 0 < low <= 1 <= high and cap >= 1",
                       "e.g. low 0.5, high 2.0, cap 2.0")

        if self.name not in ALGOS:
            raise _err("algo.name", self.name, "is unknown", f"use one of {', '.join(ALGOS)}")
        if self.minibatches < 1:
            raise _err("algo.minibatches", self.minibatches, "must be >= 1", "use 1 for on-policy")
        if self.minibatch_split not in ("interleaved", "groups"):
            raise _err("algo.minibatch_split", self.minibatch_split, "is unknown",
                       "use interleaved or groups")
        if self.old_logprobs not in ("auto", "recompute", "engine"):
            raise _err("algo.old_logprobs", self.old_logprobs, "is unknown",
                       "use auto, recompute or engine")
        for key in ("aux_loss_coeff", "z_loss_coeff"):
            if getattr(self, key) < 0:
                raise _err(f"algo.{key}", getattr(self, key), "must be >= 0", "use 0 to disable")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise _err("algo.kl_coef" if self.kl_coef < 0 else "algo.entropy_coef",
                       min(self.kl_coef, self.entropy_coef), "must be >= 0", "use 0 to disable")
        if self.dual_clip is not None and self.name != "grpo":
            raise _err("algo.dual_clip", self.dual_clip, f"applies to grpo only, not {self.name}",
                       "remove algo.dual_clip")
        try:
            validate_options(self.name, self.clip_low, self.clip_high, self.loss_options())
        except ValueError as e:
            key = "algo.aggregation" if "aggregation" in str(e) else (
                "algo.dual_clip" if "dual_clip" in str(e) else "algo.clip_low")
            raise _err(key, getattr(self, key.split(".")[1]), str(e).split(": ", 1)[-1],
                       "see DEFAULT_CLIP and the algo group's options") from None
        return self

    def loss_options(self) -> dict:
        out = {"aggregation": self.aggregation, "kl_coef": self.kl_coef,
               "entropy_coef": self.entropy_coef}
        if self.name == "grpo":
            out["dual_clip"] = self.dual_clip
        return out


@dataclass
class RolloutConfig:
    """Generation: prompts per step, responses per prompt (the group), sampling."""

    engine: str = "local"  # local (in-process Megatron) | sglang (HTTP servers)
    prompts_per_step: int = 16  # global, split over data-parallel ranks
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    sglang_urls: list = field(default_factory=list)  # servers (engine=sglang)
    sglang_router_url: Optional[str] = None
    # The Hugging Face checkpoint the servers were started from (launch/submit.sh --model-path
    # sets it): the trainer must start from the same weights (trainer.init_from) and tokenizer
    # (data.tokenizer), and every server must report it (/model_info) before the first step.
    sglang_model_path: str = ""
    # Seconds: servers' start-up (loading a large checkpoint), one batched /generate request,
    # one weight-update call (never retried: a repeated distributed update would wait for a
    # broadcast that never comes), other calls (health, pause, flush; retried).
    sglang_startup_timeout_s: float = 1800.0
    sglang_generate_timeout_s: float = 3600.0
    sglang_update_timeout_s: float = 1800.0
    sglang_control_timeout_s: float = 60.0
    # sglang: disk | distributed (NCCL broadcast from trainer rank 0 to every server rank) |
    # tensor (CUDA IPC handles: colocated servers only, which this release refuses)
    weight_sync: str = "disk"
    # Each server's GPUs (its tensor-parallel size): ranks it adds to the weight_sync=distributed
    # group, payloads of weight_sync=tensor.
    sglang_gpus_per_server: int = 8
    sglang_ep_per_server: int = 1  # each server's --ep-size (its expert layout, for direct sync)
    # weight_sync=tensor: hf (every server TP rank gets the bucket's full HF tensors and cuts its
    # slice) | direct (each rank gets only its own shards, in SGLang's parameter layout of the
    # default MoE runner on Hopper GPUs: sglang_layout.py).
    tensor_sync_format: str = "hf"
    sglang_rows_per_request: int = 64  # rows of one batched /generate request
    sglang_max_in_flight: int = 32  # requests in flight at once (per replica leader)
    weight_sync_bucket_mb: float = 512.0  # weights go out in buckets of about this size
    weight_sync_port: int = 29600  # weight_sync=distributed: the trainer's (rank 0) store port
    # weight_sync=distributed: the address servers reach trainer rank 0 at; empty: the address
    # of rank 0's interface that routes to the first server
    weight_sync_address: str = ""
    return_routes: bool = False  # sglang: ask the servers for routed experts (R3, drift)
    # DAPO's dynamic sampling: drop groups whose rewards are all equal and sample more prompts
    # until the step's batch is full, at most max_sampling_rounds rounds (then groups of equal
    # rewards fill the rest: they carry no advantage).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    # Responses cut at max_new_tokens: keep (trained as finished ones) | mask (no loss) |
    # soft_penalty (DAPO: reward ramps down by up to 1 over the last overlong_buffer tokens).
    overlong: str = "keep"
    overlong_buffer: int = 4

    def validate(self) -> "RolloutConfig":
        if self.engine not in ("local", "sglang"):
            raise _err("rollout.engine", self.engine, "is unknown", "use local or sglang")
        for key in ("prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise _err(f"rollout.{key}", getattr(self, key), "must be >= 1", "set a value >= 1")
        if self.group_size < 2:
            raise _err("rollout.group_size", self.group_size, "a group of one has no baseline "
                       "(advantage 0 for every response)", "use group_size >= 2")
        if self.temperature <= 0:
            raise _err("rollout.temperature", self.temperature, "RL needs sampled responses",
                       "use a temperature > 0")
        if not 0 < self.top_p <= 1:
            raise _err("rollout.top_p", self.top_p, "must be in (0, 1]", "use 1.0 to disable")
        if self.engine == "sglang" and not self.sglang_urls:
            raise _err("rollout.sglang_urls", self.sglang_urls, "engine=sglang needs the servers' "
                       "URLs (weight updates and pauses go to every server; a router does not "
                       "relay them)", "list them, e.g. rollout.sglang_urls=[http://node1:30000]")
        for key in ("sglang_gpus_per_server", "sglang_ep_per_server", "sglang_rows_per_request",
                    "sglang_max_in_flight"):
            if getattr(self, key) < 1:
                raise _err(f"rollout.{key}", getattr(self, key), "must be >= 1", "set a value >= 1")
        if not self.weight_sync_bucket_mb > 0:
            raise _err("rollout.weight_sync_bucket_mb", self.weight_sync_bucket_mb, "must be > 0",
                       "e.g. 512")
        if self.max_sampling_rounds < 1:
            raise _err("rollout.max_sampling_rounds", self.max_sampling_rounds, "must be >= 1",
                       "e.g. 4")
        if self.overlong not in ("keep", "mask", "soft_penalty"):
            raise _err("rollout.overlong", self.overlong, "is unknown",
                       "use keep, mask or soft_penalty")
        if self.overlong == "soft_penalty" and not 1 <= self.overlong_buffer <= self.max_new_tokens:
            raise _err("rollout.overlong_buffer", self.overlong_buffer,
                       f"must be in [1, max_new_tokens={self.max_new_tokens}]", "e.g. 4")
        if self.weight_sync not in ("disk", "distributed", "tensor"):
            raise _err("rollout.weight_sync", self.weight_sync, "is unknown",
                       "use disk, distributed or tensor")
        if self.engine == "sglang" and self.weight_sync == "tensor":
            raise _err("rollout.weight_sync", "tensor", "hands the servers CUDA IPC handles of "
                       "trainer rank 0's GPU, which only servers on that node (colocated) can "
                       "open, and colocated servers are not supported (they would share GPUs "
                       "with the trainer without releasing their memory)",
                       "run the servers on their own nodes (launch/submit.sh --sglang separate) "
                       "and use rollout.weight_sync=distributed")
        for key in ("sglang_startup_timeout_s", "sglang_generate_timeout_s",
                    "sglang_update_timeout_s", "sglang_control_timeout_s"):
            if not getattr(self, key) > 0:
                raise _err(f"rollout.{key}", getattr(self, key), "must be > 0",
                           "give seconds (see conf/rollout/sglang.yaml)")
        if self.tensor_sync_format not in ("direct", "hf"):
            raise _err("rollout.tensor_sync_format", self.tensor_sync_format, "is unknown",
                       "use direct or hf")
        if self.sglang_gpus_per_server % self.sglang_ep_per_server:
            raise _err("rollout.sglang_ep_per_server", self.sglang_ep_per_server,
                       f"does not divide sglang_gpus_per_server={self.sglang_gpus_per_server}",
                       "SGLang's --ep-size divides its --tp-size")
        return self

    @property
    def engine_returns_routes(self) -> bool:
        return self.engine == "local" or self.return_routes


@dataclass
class ReplayConfig:
    """Routing Replay: none, r2 (routes of the trainer's old-policy pass) or r3 (routes of the
    rollout engine)."""

    mode: str = "none"  # none | r2 | r3

    def validate(self) -> "ReplayConfig":
        if self.mode not in ("none", "r2", "r3"):
            raise _err("replay.mode", self.mode, "is unknown", "use none, r2 or r3")
        return self


@dataclass
class DataConfig:
    """Prompts and the verifiable reward. ``task`` is a built-in synthetic task (add, reverse, sort) or
    ``files`` for prompt files (jsonl / parquet) with ``reward`` naming the verifier."""

    task: str = "reverse"  # add | reverse | sort | files
    train_size: int = 2000
    eval_size: int = 200
    max_value: int = 9  # add: operand range
    min_len: int = 1  # reverse, sort: word / digit-string length range
    max_len: int = 4
    files: list = field(default_factory=list)
    eval_files: list = field(default_factory=list)
    reward: str = "exact_match"  # exact_match | char_match | math | code
    # Rewards in a pool of worker processes (> 0; for code and slow verifiers), else in process;
    # a reward that raises or runs past the timeout scores 0 (rollout/reward_failures).
    reward_workers: int = 0
    reward_timeout_s: float = 30.0
    tokenizer: str = "builtin"  # builtin | a local Hugging Face tokenizer directory

    def validate(self) -> "DataConfig":
        if self.task not in ("add", "reverse", "sort", "files"):
            raise _err("data.task", self.task, "is unknown", "use add, reverse, sort or files")
        if self.reward_workers < 0:
            raise _err("data.reward_workers", self.reward_workers, "must be >= 0",
                       "use 0 to score in the trainer process")
        if not self.reward_timeout_s > 0:
            raise _err("data.reward_timeout_s", self.reward_timeout_s, "must be > 0", "e.g. 30")
        if self.task == "files" and not self.files:
            raise _err("data.files", self.files, "task=files needs prompt files",
                       "list .jsonl or .parquet files")
        if not 1 <= self.min_len <= self.max_len:
            raise _err("data.min_len", self.min_len, f"must be in [1, max_len={self.max_len}]",
                       "lower min_len")
        if self.train_size < 1 or self.eval_size < 0:
            raise _err("data.train_size" if self.train_size < 1 else "data.eval_size",
                       self.train_size if self.train_size < 1 else self.eval_size,
                       "is out of range", "use train_size >= 1 and eval_size >= 0")
        from megatron_gspo.rewards import REWARDS, get_reward

        try:
            get_reward(self.reward)
        except ValueError:
            raise _err("data.reward", self.reward, "is unknown",
                       f"use one of {', '.join(sorted(REWARDS))}") from None
        return self


@dataclass
class TrainerConfig:
    """The loop: steps, optimizer and LR schedule, SFT warm-up, checkpoints, fault handling."""

    steps: int = 60  # RL steps (rollout batches)
    micro_batch_size: int = 8  # rows per micro-batch per data-parallel rank (padded mode)
    # Packing: each mini-batch's rows balanced over the data-parallel ranks by tokens and packed
    # back to back (THD) into micro-batches of at most max_tokens_per_micro_batch tokens.
    packing: bool = True
    max_tokens_per_micro_batch: int = 8192
    # Packed rows of one prompt in one mini-batch feed the prompt once (its tokens but the last,
    # as a prefix their segments attend to). Applies without context parallelism, on the SDPA
    # attention (not with Transformer Engine).
    share_prompts: bool = True
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_warmup_steps: int = 0  # in optimizer updates
    lr_schedule: str = "constant"  # constant | cosine (after warmup)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    init_from: str = ""  # starting weights: a HF Qwen3-MoE directory or a weights checkpoint
    export_hf_at_end: bool = False  # write RUN_DIR/hf (a Hugging Face directory) after the last step
    sft_steps: int = 0  # supervised warm-up on the task's answers before RL (at most)
    sft_target_accuracy: float = 1.0  # stop the warm-up once a batch's accuracy reaches this
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    eval_interval: int = 0  # RL steps between held-out evaluations (0: only before and after)
    save_interval: int = 10  # RL steps between checkpoints (0: only at the end and on signals)
    keep_checkpoints: int = 2
    # Optimizer moments in checkpoints: auto (dp_reshardable on GPUs: each rank writes its shard,
    # nothing gathered, loads into another DP size; fully_reshardable on CPU) | dp_reshardable |
    # fully_reshardable (gathered onto each DP group's rank 0: loads into any layout)
    checkpoint_format: str = "auto"
    resume: str = "auto"  # auto (latest in the run directory, if any) | never | a checkpoint path
    max_consecutive_skips: int = 3  # non-finite updates in a row before the run stops
    nan_at_updates: list = field(default_factory=list)  # fault injection: NaN grads at these updates
    kill_during_save: int = -1  # fault injection: SIGKILL while writing this step's checkpoint

    def validate(self) -> "TrainerConfig":
        for key in ("steps", "micro_batch_size", "sft_batch_size", "keep_checkpoints",
                    "max_consecutive_skips", "max_tokens_per_micro_batch"):
            if getattr(self, key) < 1:
                raise _err(f"trainer.{key}", getattr(self, key), "must be >= 1", "set a value >= 1")
        for key in ("lr", "sft_lr"):
            if getattr(self, key) <= 0:
                raise _err(f"trainer.{key}", getattr(self, key), "must be > 0", "set a positive rate")
        if self.checkpoint_format not in ("auto", "dp_reshardable", "fully_reshardable"):
            raise _err("trainer.checkpoint_format", self.checkpoint_format, "is unknown",
                       "use auto, dp_reshardable or fully_reshardable")
        if self.lr_schedule not in ("constant", "cosine"):
            raise _err("trainer.lr_schedule", self.lr_schedule, "is unknown", "use constant or cosine")
        for key in ("sft_steps", "eval_interval", "save_interval", "lr_warmup_steps"):
            if getattr(self, key) < 0:
                raise _err(f"trainer.{key}", getattr(self, key), "must be >= 0", "use 0 to disable")
        if self.init_from and not os.path.isdir(self.init_from):
            raise _err("trainer.init_from", self.init_from, "is not a directory",
                       "give a HF Qwen3-MoE directory or a weights checkpoint")
        if self.clip_grad < 0:
            raise _err("trainer.clip_grad", self.clip_grad, "must be >= 0", "use 0 to disable")
        return self


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    drift: bool = True  # expert-drift instrumentation (moe/ tags, drift.jsonl, drift_report.html)
    progress: bool = True  # console progress bar


@dataclass
class ClusterConfig:
    """Where the job runs: ``local`` (this machine; torchrun for several ranks) or ``slurm``
    (Hydra's submitit launcher for sweeps; ``launch/submit.sh`` for multi-node sbatch jobs)."""

    name: str = "local"  # local | slurm
    partition: str = ""
    account: str = ""
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 16
    time_min: int = 240  # job time limit in minutes
    signal_s: int = 300  # SIGUSR2 this many seconds before the limit: checkpoint, then requeue
    max_requeues: int = 20
    container_image: str = ""  # pyxis/enroot image (sqsh file or registry path); empty: none
    container_mounts: str = ""

    def validate(self) -> "ClusterConfig":
        if self.name not in ("local", "slurm"):
            raise _err("cluster.name", self.name, "is unknown", "use local or slurm")
        if self.name == "slurm":
            for key in ("nodes", "gpus_per_node", "time_min"):
                if getattr(self, key) < 1:
                    raise _err(f"cluster.{key}", getattr(self, key), "must be >= 1",
                               "set a positive value")
            if not 0 <= self.signal_s < self.time_min * 60:
                raise _err("cluster.signal_s", self.signal_s, "must be within the time limit",
                           "use a few minutes, e.g. 300")
        return self


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 1234
    run_dir: str = "."

    def validate(self) -> "JobConfig":
        """Each component's checks, then the combinations (the world size is checked by
        ``ParallelConfig.validate`` once it is known)."""
        for part in (self.model, self.algo, self.rollout, self.replay, self.data, self.trainer,
                     self.cluster):
            part.validate()
        if self.replay.mode != "none" and not self.model.is_moe:
            raise _err("replay.mode", self.replay.mode, "routing replay needs an MoE model",
                       "set replay=none")
        if self.replay.mode == "r3" and not self.rollout.engine_returns_routes:
            raise _err("replay.mode", "r3", f"rollout.engine={self.rollout.engine} does not "
                       "return routed experts", "set rollout.return_routes=true or use replay=r2")
        if self.algo.old_logprobs == "engine" and self.replay.mode == "r2":
            raise _err("algo.old_logprobs", "engine", "r2 replays the routes of the trainer's "
                       "old-policy pass, which engine log-probs skip", "use algo.old_logprobs="
                       "recompute with r2")
        if self.algo.old_logprobs == "engine" and self.algo.rollout_correction != "none":
            raise _err("algo.rollout_correction", self.algo.rollout_correction, "weighs the "
                       "trainer's old-policy log-probs against the engine's, and "
                       "algo.old_logprobs=engine takes the engine's for both (every weight 1)",
                       "use algo.old_logprobs=recompute or auto with rollout correction")
        r = self.rollout
        if r.engine == "sglang" and r.weight_sync == "tensor" and r.tensor_sync_format == "direct":
            from megatron_gspo.rollout.sglang_layout import ServerLayout

            try:
                ServerLayout(self.model, tp=r.sglang_gpus_per_server, ep=r.sglang_ep_per_server)
            except ValueError as e:
                raise _err("rollout.sglang_gpus_per_server", r.sglang_gpus_per_server,
                           f"(ep {r.sglang_ep_per_server}) {e}",
                           "match the servers' --tp-size / --ep-size, or use "
                           "rollout.tensor_sync_format=hf") from None
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        if rows % self.algo.minibatches:
            raise _err("algo.minibatches", self.algo.minibatches, f"does not divide the "
                       f"{rows} responses of a step (prompts_per_step x group_size)",
                       "choose a divisor")
        if self.data.tokenizer == "builtin":
            from megatron_gspo.data.tokenizer import CharTokenizer

            if self.model.vocab_size < CharTokenizer().vocab_size:
                raise _err("model.vocab_size", self.model.vocab_size, "is smaller than the built-in "
                           f"tokenizer's {CharTokenizer().vocab_size} ids", "raise model.vocab_size")
        return self

    def check_starting_point(self) -> None:
        """The trainer, the SGLang servers and the tokenizer start from one checkpoint: a
        pretrained ``trainer.init_from`` is not fed the built-in tokenizer's ids, and with SGLang
        the trainer starts from the weights (``trainer.init_from``) and the vocabulary
        (``data.tokenizer``) the servers serve (``rollout.sglang_model_path``)."""
        init, tok = self.trainer.init_from, self.data.tokenizer
        hf_init = bool(init) and os.path.isfile(os.path.join(init, "config.json"))
        if hf_init and tok == "builtin" and _tokenizer_files(init):
            raise _err("data.tokenizer", tok, f"trainer.init_from={init} has its own tokenizer, "
                       "and the built-in character tokenizer would feed the model ids of another "
                       "vocabulary", f"set data.tokenizer={init}")
        if self.rollout.engine != "sglang":
            return
        served = self.rollout.sglang_model_path
        if not served:
            raise _err("rollout.sglang_model_path", served, "engine=sglang needs the checkpoint "
                       "the servers were started from", "set it to the servers' --model-path "
                       "(launch/submit.sh --model-path sets it)")
        if not init:
            raise _err("trainer.init_from", init, f"the SGLang servers serve {served}, and the "
                       "trainer would start from random weights", f"set trainer.init_from={served}")
        if hf_init and not _same_path(init, served):
            raise _err("trainer.init_from", init, "the trainer and the SGLang servers "
                       f"(rollout.sglang_model_path={served}) would start from different weights",
                       f"set trainer.init_from={served}")
        if not os.path.isdir(served):
            return  # not visible here: the servers check it (/model_info) at start-up
        if tok == "builtin":
            if _tokenizer_files(served):
                raise _err("data.tokenizer", tok, f"the SGLang servers serve {served}, which has "
                           "its own tokenizer", f"set data.tokenizer={served}")
        elif not _same_path(tok, served):
            differs = _tokenizer_difference(tok, served)
            if differs:
                raise _err("data.tokenizer", tok, f"its {differs} differs from the one of "
                           f"rollout.sglang_model_path={served} (the servers' vocabulary)",
                           f"set data.tokenizer={served}")

    def check_init_model(self) -> None:
        """The model section must describe the checkpoint ``trainer.init_from`` holds, and the
        one the SGLang servers serve."""
        self.check_starting_point()
        checked = set()
        for key, path in (("trainer.init_from", self.trainer.init_from),
                          ("rollout.sglang_model_path", self.rollout.sglang_model_path
                           if self.rollout.engine == "sglang" else "")):
            if path and os.path.isdir(path) and os.path.realpath(path) not in checked:
                checked.add(os.path.realpath(path))
                self._check_model_against(key, path)

    def _check_model_against(self, key: str, path: str) -> None:
        import json

        if os.path.isfile(os.path.join(path, "config.json")):
            from megatron_gspo.hf_qwen3moe import model_config_from_hf

            with open(os.path.join(path, "config.json")) as f:
                saved = model_config_from_hf(json.load(f))
        else:
            from megatron_gspo.weights import read_model_config

            saved = read_model_config(path)
        skip = {"name", "params_dtype", "init_method_std", "aux_loss_coeff",
                "max_position_embeddings", "grouped_experts", "cpu_experts_kernel",
                "activation_recompute"}
        for f in dataclasses.fields(ModelConfig):
            if f.name not in skip and getattr(saved, f.name) != getattr(self.model, f.name):
                raise _err(f"model.{f.name}", getattr(self.model, f.name),
                           f"{key}={path} holds {getattr(saved, f.name)!r}",
                           f"set model.{f.name}={getattr(saved, f.name)!r}")

    def behaviour_source(self, device_type: str) -> str:
        """Where the behaviour log-probs come from (``algo.old_logprobs``): "engine" or
        "recompute". ``auto`` takes the engine's where the engine is the trainer's own model in
        fp32 on CPU (the local engine shares its parameters and computes the same log-probs to
        float rounding: a pass would recompute them), the trainer's pass elsewhere: a separate
        engine (SGLang), GPU kernels or bf16 (decoding and the full forward round differently,
        at times by more than GSPO's clip range), R2 and R3 (which record or replay routes in
        the pass), rollout correction (which weighs the engine's log-probs against the
        pass's)."""
        a = self.algo
        if a.old_logprobs != "auto":
            return a.old_logprobs
        same_model = (self.rollout.engine == "local" and device_type == "cpu"
                      and self.model.params_dtype == "float32")
        return ("engine" if same_model and self.replay.mode == "none"
                and a.rollout_correction == "none" else "recompute")

    def check_layout(self, dp: int) -> None:
        """Combinations that depend on the data-parallel size."""
        if self.rollout.prompts_per_step % dp:
            raise _err("rollout.prompts_per_step", self.rollout.prompts_per_step,
                       f"does not split over {dp} data-parallel ranks", f"use a multiple of {dp}")
        rows = self.rollout.prompts_per_step * self.rollout.group_size // dp
        prompts = self.rollout.prompts_per_step // dp
        if self.algo.minibatch_split == "groups" and prompts % self.algo.minibatches:
            raise _err("algo.minibatch_split", "groups", f"needs the {prompts} prompts of each of "
                       f"{dp} data-parallel ranks to divide into {self.algo.minibatches} "
                       "mini-batches of whole groups", "use interleaved, or a multiple of "
                       f"{dp * self.algo.minibatches} prompts per step")
        per_mb = rows // self.algo.minibatches
        if rows % self.algo.minibatches or per_mb % self.trainer.micro_batch_size:
            raise _err("trainer.micro_batch_size", self.trainer.micro_batch_size,
                       f"does not divide the {per_mb} rows of a mini-batch on each of {dp} "
                       "data-parallel ranks", "choose a divisor")
        r = self.rollout
        if r.engine == "sglang":
            # A replica's other ranks wait in one broadcast while its leader waits for the
            # servers, generates (in waves of max_in_flight requests) or updates weights.
            waves = -(-rows // (r.sglang_rows_per_request * r.sglang_max_in_flight))
            waits = {"rollout.sglang_startup_timeout_s": r.sglang_startup_timeout_s,
                     f"{waves} x rollout.sglang_generate_timeout_s":
                         waves * r.sglang_generate_timeout_s,
                     "rollout.sglang_update_timeout_s": r.sglang_update_timeout_s}
            what, longest = max(waits.items(), key=lambda kv: kv[1])
            if self.parallel.timeout_s < longest:
                raise _err("parallel.timeout_s", self.parallel.timeout_s, f"is shorter than "
                           f"{what} ({longest:g} s), which the other ranks of a replica can "
                           "wait for its leader", f"set parallel.timeout_s >= {longest:g}")
        if self.trainer.sft_steps and self.trainer.sft_batch_size % dp:
            raise _err("trainer.sft_batch_size", self.trainer.sft_batch_size,
                       f"does not split over {dp} data-parallel ranks", f"use a multiple of {dp}")


# Files that define a Hugging Face tokenizer's vocabulary (its ids).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


def _tokenizer_files(path: str) -> list:
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]


def _tokenizer_difference(a: str, b: str) -> str:
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


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    cs.store(group="algo", name="algo_schema", node=AlgoConfig)
    cs.store(group="rollout", name="rollout_schema", node=RolloutConfig)
    cs.store(group="replay", name="replay_schema", node=ReplayConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="logging", name="logging_schema", node=LoggingConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)


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


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "algo": AlgoConfig,
            "rollout": RolloutConfig, "replay": ReplayConfig, "data": DataConfig,
            "trainer": TrainerConfig, "logging": LoggingConfig, "cluster": ClusterConfig}


def job_from_dict(data: dict) -> JobConfig:
    """A validated JobConfig from plain data; unknown sections and keys are errors."""
    known = set(SECTIONS) | {"seed", "run_dir"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise _err(unknown[0], data[unknown[0]], "is not a config section",
                   f"use one of {', '.join(sorted(known))}")
    parts = {}
    for name, cls in SECTIONS.items():
        try:
            parts[name] = to_dataclass(cls, data.get(name) or {})
        except ConfigError as e:
            raise ConfigError(f"{name}.{e}") from None
        except TypeError as e:
            raise ConfigError(f"{name}: {e}") from None
    job = JobConfig(**parts, seed=int(data.get("seed", 1234)), run_dir=str(data.get("run_dir", ".")))
    if job.model.name == FROM_CHECKPOINT:
        job.model = model_from_checkpoint(job)
    job.validate()
    job.check_init_model()
    return job


FROM_CHECKPOINT = "from_checkpoint"
# What a checkpoint's config.json decides under model=from_checkpoint; the rest (dtype, kernels,
# recompute, router options outside the HF format) stays the job's.
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
              "head_dim", "ffn_hidden_size", "moe_ffn_hidden_size", "num_experts", "top_k",
              "norm_topk_prob", "first_k_dense", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "aux_loss_coeff")


def model_from_checkpoint(job: JobConfig) -> ModelConfig:
    """``model=from_checkpoint``: the model's shape read from the Hugging Face checkpoint the job
    starts from (``trainer.init_from``, else ``rollout.sglang_model_path``)."""
    import json

    from megatron_gspo.hf_qwen3moe import HFCheckpointError, model_config_from_hf

    path = job.trainer.init_from or job.rollout.sglang_model_path
    config = os.path.join(path, "config.json") if path else ""
    if not config or not os.path.isfile(config):
        raise _err("model", FROM_CHECKPOINT, "reads the model's shape from the config.json of "
                   f"trainer.init_from, and {path or 'it'!r} has none",
                   "set trainer.init_from to a Hugging Face checkpoint directory, or pick a "
                   "model group option")
    try:
        with open(config) as f:
            shape = model_config_from_hf(json.load(f), name=os.path.basename(path.rstrip("/")))
    except (HFCheckpointError, ValueError) as e:
        raise _err("model", FROM_CHECKPOINT, f"{config}: {e}", "use a Qwen3-MoE checkpoint") from None
    return dataclasses.replace(job.model, name=shape.name,
                               **{k: getattr(shape, k) for k in SHAPE_KEYS})


def job_from_omegaconf(node) -> JobConfig:
    from omegaconf import OmegaConf

    return job_from_dict(OmegaConf.to_container(node, resolve=True))


def job_to_dict(job: JobConfig) -> dict:
    return dataclasses.asdict(job)
