"""What one training run holds, as typed parts: the policy being trained, the prompts and their
rewards, the rollout engine, the run's logging, checkpoints and signals."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_gspo.checkpoint.manager import CheckpointManager
from megatron_gspo.config import JobConfig
from megatron_gspo.data.prompts import PromptDataset, PromptRecord
from megatron_gspo.data.tokenizer import Tokenizer
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.rewards.pool import InlineScorer, RewardPool
from megatron_gspo.rollout.local_engine import LocalEngine
from megatron_gspo.rollout.producer import Producer
from megatron_gspo.rollout.sglang.engine import SGLangEngine
from megatron_gspo.trainer.drift_probe import DriftProbe
from megatron_gspo.trainer.resume_point import ResumePoint
from megatron_gspo.trainer.faults import NonFiniteGuard, StopSignals
from megatron_gspo.trainer.logger import RunLogger
from moe.replay import RoutingReplay

Engine = Union[LocalEngine, SGLangEngine]


class Timers:
    """Wall time per phase of one step (each phase also a profiler range, ``phase:NAME``)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase:{name}"):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class Policy:
    """The model being trained and what updates it."""

    gpt: GPTModel
    ddp: DistributedDataParallel
    replay: Optional[RoutingReplay]  # when routes are recorded or replayed
    guard: NonFiniteGuard
    ref_model: Optional[GPTModel] = None  # the policy RL starts from (algo.kl_coef > 0)
    optimizer: Optional[MegatronOptimizer] = None
    scheduler: Optional[OptimizerParamScheduler] = None
    updates: int = 0  # optimizer updates done (RL)


@dataclass
class Prompts:
    """Where the step's prompts come from and how their responses are scored."""

    tokenizer: Tokenizer
    train: PromptDataset
    held_out: list[PromptRecord]
    scorer: Union[InlineScorer, RewardPool]  # rewards: in process, or a bounded worker pool


@dataclass
class Run:
    """Everything one training run holds."""

    job: JobConfig
    ctx: ParallelContext
    policy: Policy
    prompts: Prompts
    engine: Engine
    logger: RunLogger
    ckpt: CheckpointManager
    signals: StopSignals
    resume_from: Optional[ResumePoint] = None  # setup's resume_point
    drift: Optional[DriftProbe] = None
    sync_group: Optional[torch.distributed.ProcessGroup] = None  # weight_sync=distributed
    producer: Optional[Producer] = None  # rollout.mode one_step_off / async
    trained_from: float = 0.0  # when the trainer took the step's batch (async: overlap)
    step: int = 0  # RL steps done
    history: dict = field(default_factory=dict)
