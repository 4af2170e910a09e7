"""Data and rewards, the training loop, logging, where the job runs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_gspo.config.errors import invalid


@dataclass
class DataConfig:
    """Prompts and the verifiable reward. ``task`` is a built-in synthetic task (add, reverse,
    sort) or ``files`` for prompt files (jsonl / parquet) with ``reward`` naming the verifier."""

    task: str = "reverse"  # add | reverse | sort | files
    train_size: int = 2000  # synthetic tasks: training prompts
    eval_size: int = 200  # held-out prompts (files: at most this many of data.eval_files; 0: all)
    max_value: int = 9  # add: operand range
    min_len: int = 1  # reverse, sort: word / digit-string length range
    max_len: int = 4  # reverse, sort: longest word / digit string
    # task=files: training prompt files (.jsonl / .parquet)
    files: list = field(default_factory=list)
    eval_files: list = field(default_factory=list)  # held-out prompt files
    reward: str = "exact_match"  # exact_match | char_match | math | code
    # Rewards in a pool of worker processes (> 0; for code and slow verifiers), else in process;
    # a reward that raises or runs past the timeout scores 0 (rollout/reward_failures).
    reward_workers: int = 0
    reward_timeout_s: float = 30.0  # seconds one reward may take (then it scores 0)
    tokenizer: str = "builtin"  # builtin | a local Hugging Face tokenizer directory

    def validate(self) -> "DataConfig":
        if self.task not in ("add", "reverse", "sort", "files"):
            raise invalid("data.task", self.task, "is unknown", "use add, reverse, sort or files")
        if self.reward_workers < 0:
            raise invalid("data.reward_workers", self.reward_workers, "must be >= 0",
                          "use 0 to score in the trainer process")
        if not self.reward_timeout_s > 0:
            raise invalid("data.reward_timeout_s", self.reward_timeout_s, "must be > 0", "e.g. 30")
        if self.task == "files" and not self.files:
            raise invalid("data.files", self.files, "task=files needs prompt files",
                          "list .jsonl or .parquet files")
        if not 1 <= self.min_len <= self.max_len:
            raise invalid("data.min_len", self.min_len, f"must be in [1, max_len={self.max_len}]",
                          "lower min_len")
        if self.train_size < 1 or self.eval_size < 0:
            raise invalid("data.train_size" if self.train_size < 1 else "data.eval_size",
                          self.train_size if self.train_size < 1 else self.eval_size,
                          "is out of range", "use train_size >= 1 and eval_size >= 0")
        return self  # the reward's name against the registry: config.checks


@dataclass
class TrainerConfig:
    """The loop: steps, optimizer and LR schedule, SFT warm-up, checkpoints, fault handling."""

    steps: int = 60  # RL steps (rollout batches)
    micro_batch_size: int = 8  # rows per micro-batch per data-parallel rank (padded mode)
    # Packing: each mini-batch's rows balanced over the data-parallel ranks by tokens and packed
    # back to back (THD) into micro-batches of at most max_tokens_per_micro_batch tokens.
    packing: bool = True
    max_tokens_per_micro_batch: int = 8192  # packing: tokens of one packed micro-batch at most
    # Packed rows of one prompt in one mini-batch feed the prompt once (its tokens but the last,
    # as a prefix their segments attend to). Applies without context parallelism, on the SDPA
    # attention (not with Transformer Engine).
    share_prompts: bool = True
    lr: float = 1e-3  # the RL updates' learning rate
    min_lr: float = 0.0  # cosine schedule: the rate it ends at
    lr_warmup_steps: int = 0  # in optimizer updates
    lr_schedule: str = "constant"  # constant | cosine (after warmup)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # Adam's beta1
    adam_beta2: float = 0.999  # Adam's beta2
    clip_grad: float = 1.0  # gradient norm clip (0: off)
    init_from: str = ""  # starting weights: a HF Qwen3-MoE directory or a weights checkpoint
    export_hf_at_end: bool = False  # write RUN_DIR/hf (a Hugging Face directory) at the end
    sft_steps: int = 0  # supervised warm-up on the task's answers before RL (at most)
    sft_target_accuracy: float = 1.0  # stop the warm-up once a batch's accuracy reaches this
    sft_batch_size: int = 32  # warm-up prompts per step (global)
    sft_lr: float = 3e-3  # warm-up learning rate
    eval_interval: int = 0  # RL steps between held-out evaluations (0: only before and after)
    save_interval: int = 10  # RL steps between checkpoints (0: only at the end and on signals)
    keep_checkpoints: int = 2  # the newest N checkpoints are kept
    # Optimizer moments in checkpoints: auto (dp_reshardable on GPUs: each rank writes its shard,
    # nothing gathered, loads into another DP size; fully_reshardable on CPU) | dp_reshardable |
    # fully_reshardable (gathered onto each DP group's rank 0: loads into any layout)
    checkpoint_format: str = "auto"
    resume: str = "auto"  # auto (latest in the run directory, if any) | never | a checkpoint path
    max_consecutive_skips: int = 3  # non-finite updates in a row before the run stops
    nan_at_updates: list = field(default_factory=list)  # fault injection: NaN grads there
    kill_during_save: int = -1  # fault injection: SIGKILL while writing this step's checkpoint

    def validate(self) -> "TrainerConfig":
        for key in ("steps", "micro_batch_size", "sft_batch_size", "keep_checkpoints",
                    "max_consecutive_skips", "max_tokens_per_micro_batch"):
            if getattr(self, key) < 1:
                raise invalid(f"trainer.{key}", getattr(self, key), "must be >= 1",
                              "set a value >= 1")
        for key in ("lr", "sft_lr"):
            if getattr(self, key) <= 0:
                raise invalid(f"trainer.{key}", getattr(self, key), "must be > 0",
                              "set a positive rate")
        if self.checkpoint_format not in ("auto", "dp_reshardable", "fully_reshardable"):
            raise invalid("trainer.checkpoint_format", self.checkpoint_format, "is unknown",
                          "use auto, dp_reshardable or fully_reshardable")
        if self.lr_schedule not in ("constant", "cosine"):
            raise invalid("trainer.lr_schedule", self.lr_schedule, "is unknown",
                          "use constant or cosine")
        for key in ("sft_steps", "eval_interval", "save_interval", "lr_warmup_steps"):
            if getattr(self, key) < 0:
                raise invalid(f"trainer.{key}", getattr(self, key), "must be >= 0",
                              "use 0 to disable")
        if self.init_from and not os.path.isdir(self.init_from):
            raise invalid("trainer.init_from", self.init_from, "is not a directory",
                          "give a HF Qwen3-MoE directory or a weights checkpoint")
        if self.clip_grad < 0:
            raise invalid("trainer.clip_grad", self.clip_grad, "must be >= 0", "use 0 to disable")
        return self


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # TensorBoard scalars in RUN_DIR/tb
    drift: bool = True  # expert-drift instrumentation (moe/ tags, drift.jsonl, drift_report.html)
    progress: bool = True  # console progress bar


@dataclass
class ClusterConfig:
    """Where the job runs: ``local`` (this machine; torchrun for several ranks) or ``slurm``
    (Hydra's submitit launcher for sweeps; ``launch/submit.sh`` for multi-node sbatch jobs)."""

    name: str = "local"  # local | slurm
    partition: str = ""  # SLURM partition (empty: the cluster's default)
    account: str = ""  # SLURM account
    nodes: int = 1  # nodes per job
    gpus_per_node: int = 8  # GPUs (= ranks) per node
    cpus_per_task: int = 16  # CPU cores per rank
    time_min: int = 240  # job time limit in minutes
    signal_s: int = 300  # SIGUSR2 this many seconds before the limit: checkpoint, then requeue
    max_requeues: int = 20  # requeues of a job at most
    container_image: str = ""  # pyxis/enroot image (sqsh file or registry path); empty: none
    container_mounts: str = ""  # pyxis mounts (src:dst[,src:dst...])

    def validate(self) -> "ClusterConfig":
        if self.name not in ("local", "slurm"):
            raise invalid("cluster.name", self.name, "is unknown", "use local or slurm")
        if self.name == "slurm":
            for key in ("nodes", "gpus_per_node", "time_min"):
                if getattr(self, key) < 1:
                    raise invalid(f"cluster.{key}", getattr(self, key), "must be >= 1",
                                  "set a positive value")
            if not 0 <= self.signal_s < self.time_min * 60:
                raise invalid("cluster.signal_s", self.signal_s, "must be within the time limit",
                              "use a few minutes, e.g. 300")
        return self


@dataclass
class BackendConfig:
    """Kernel choices of the device's backend (``megatron_gspo.backends``): how the layers run,
    never what they compute."""

    # Without Transformer Engine: a layer's local experts as two grouped matmuls
    # (megatron_gspo/models/grouped_experts.py) instead of Megatron's loop over them.
    grouped_experts: bool = True
    # On CPU, fp32 SwiGLU experts through a C++ kernel built at first use (whole experts per
    # OpenMP thread; megatron_gspo/backends/cpu/kernels.py); where it cannot be built, or with
    # false, the PyTorch loop over the experts runs instead (same results, slower).
    cpu_experts_kernel: bool = True
    # On GPUs, the grouped experts under torch.compile: group padding, both grouped matmuls,
    # SwiGLU and the routing weights as one graph, the token count dynamic (one compilation for
    # every micro-batch length; the first training step pays it). Off: eager.
    compile_experts: bool = False

    def validate(self) -> "BackendConfig":
        if self.compile_experts and not self.grouped_experts:
            raise invalid("backend.compile_experts", True, "compiles the grouped experts, and "
                          "backend.grouped_experts=false runs Megatron's loop over them",
                          "set backend.grouped_experts=true or backend.compile_experts=false")
        return self

