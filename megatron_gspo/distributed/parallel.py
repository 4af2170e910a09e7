"""Distributed setup: torch.distributed plus Megatron's parallel state, handed out as one context.

Everything that communicates receives a ``ParallelContext`` (or one of its groups) explicitly; no code
outside this module reads Megatron's ``parallel_state`` getters. The layout is validated against the
world size and the model before any process group is created.
"""

from __future__ import annotations

import atexit
import math
import os
import random
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.backends import backend_for
from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig
from megatron_gspo.distributed import comm
from megatron_gspo.models import te


@dataclass(frozen=True)
class ParallelContext:
    """Sizes, this rank's coordinates and the process groups of one parallel layout."""

    world_size: int
    rank: int
    device: torch.device
    tp: int
    pp: int
    ep: int
    cp: int
    etp: int
    dp: int
    sequence_parallel: bool
    tp_rank: int
    pp_rank: int
    ep_rank: int
    cp_rank: int
    etp_rank: int
    dp_rank: int
    edp_rank: int  # rank among the replicas of this rank's experts
    pg: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    # The ranks of this rank's model replica (one data-parallel index: every TP, CP and PP rank of
    # it), lowest first; its first rank leads the replica's rollouts (SGLang, rewards).
    replica_ranks: tuple = (0,)
    replica_group: Any = None

    @property
    def is_replica_leader(self) -> bool:
        return self.rank == self.replica_ranks[0]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def tp_group(self):
        return self.pg.tp

    @property
    def cp_group(self):
        return self.pg.cp

    @property
    def pp_group(self):
        return self.pg.pp

    @property
    def dp_group(self):
        return self.pg.dp

    @property
    def dp_cp_group(self):
        """Data x context-parallel ranks: every rank that holds a distinct part of the batch."""
        return self.pg.dp_cp

    @property
    def ep_group(self):
        return self.pg.ep

    def describe(self) -> str:
        return (f"world={self.world_size} tp={self.tp} pp={self.pp} ep={self.ep} cp={self.cp} "
                f"etp={self.etp} dp={self.dp} sp={self.sequence_parallel} device={self.device.type}")


def resolve_device(cfg: ParallelConfig) -> torch.device:
    """This rank's device; ``parallel.device=cuda`` without a visible GPU is a ``ConfigError``
    (a GPU job never falls back to the CPU)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"parallel.device='cuda': no CUDA GPU is visible to this process (torch "
            f"{torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r}); fix: ask the scheduler "
            "for GPUs (launch/submit.sh --gpus-per-node) or set parallel.device=cpu")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"parallel.device={cfg.device!r}: local rank {local_rank} has no GPU (this node "
                f"shows {torch.cuda.device_count()}); fix: start at most that many ranks per "
                "node (torchrun --nproc-per-node)")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_backend(cfg: ParallelConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_from_slurm(environ=None) -> dict:
    """torchrun-style variables for a SLURM job step that runs one task per rank (srun or
    Hydra's submitit launcher) and was not started by torchrun; empty when they are set already
    or the step has a single task. The head node (first of the job's nodes) hosts the store."""
    env = os.environ if environ is None else environ
    if "RANK" in env or int(env.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in env:
        return {}
    nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, check=True).stdout.split()
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
            "MASTER_ADDR": nodes[0],
            "MASTER_PORT": env.get("MASTER_PORT", str(20000 + int(env["SLURM_JOB_ID"]) % 20000))}


def init_parallel(cfg: ParallelConfig, model: ModelConfig, *, seed: Optional[int] = None
                  ) -> ParallelContext:
    """Initialise torch.distributed (torchrun env or a single process) and Megatron's groups.

    Raises ``ConfigError`` before creating any process group when the layout is invalid.
    """
    os.environ.update(env_from_slurm())
    device = resolve_device(cfg)
    world_size = world_size_from_env()
    dp = cfg.validate(world_size, model, device_type=device.type, have_te=te.HAVE_TE)
    backend = resolve_backend(cfg, device)
    timeout = timedelta(seconds=cfg.timeout_s)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Before any process group exists (the CPU backend pins torch's OpenMP threads: gloo's work
    # threads must take one each).
    backend_for(device).activate()

    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        else:
            # One process: its store listens on a port the system picks as it binds.
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                    timeout=timeout)
        # A process that exits with its world still up has torch destroy the process group
        # during interpreter finalization, where gloo's work threads can abort it
        # ("terminate called without an active exception", SIGABRT after the work is done).
        # Tearing down at exit, while the interpreter is whole, covers every entry point and
        # script; one registration however often the world is made again.
        atexit.unregister(_destroy_at_exit)
        atexit.register(_destroy_at_exit)

    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.expert_tp,
        distributed_timeout_minutes=max(1, math.ceil(cfg.timeout_s / 60)),
    )
    ctx = ParallelContext(
        world_size=world_size, rank=dist.get_rank(), device=device,
        tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp, etp=cfg.expert_tp, dp=dp,
        sequence_parallel=cfg.sequence_parallel,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        pg=ProcessGroupCollection.use_mpu_process_groups(),
        **_replica_groups(ps.get_data_parallel_rank(), dp, device, timeout),
    )
    if seed is not None:
        seed_all(ctx, seed)
    return ctx


def _replica_groups(dp_rank: int, dp: int, device: torch.device, timeout: timedelta) -> dict:
    """One process group per model replica (the ranks that share a data-parallel index); every
    rank creates all of them, in the same order, as ``new_group`` requires."""
    owners = comm.gather_ints(dp_rank, device=device)
    mine = None
    for index in range(dp):
        ranks = tuple(r for r, d in enumerate(owners) if d == index)
        group = dist.new_group(list(ranks), timeout=timeout)
        if index == dp_rank:
            mine = {"replica_ranks": ranks, "replica_group": group}
    return mine


def seed_all(ctx: ParallelContext, seed: int) -> None:
    """Seed Python, numpy, torch and Megatron's RNG tracker the way Megatron offsets them per rank."""
    # Same offsets as megatron's model_parallel_cuda_manual_seed: pipeline stages differ, and the
    # tensor/expert-parallel streams differ per rank so that dropout masks are independent.
    stage_seed = seed + 100 * ctx.pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    backend_for(ctx.device).seed(stage_seed, tp_rank=ctx.tp_rank, ep_rank=ctx.ep_rank,
                                 etp_rank=ctx.etp_rank)


def _destroy_at_exit() -> None:
    """``destroy_parallel()`` if the world is still up (registered with ``atexit``)."""
    if dist.is_initialized():
        destroy_parallel()


def destroy_parallel(*, keep_process_group: bool = False) -> None:
    """Tear down Megatron's groups and torch.distributed (for tests and clean exits); with
    ``keep_process_group`` the world stays, ready for another layout."""
    ps.destroy_model_parallel()
    if dist.is_initialized() and not keep_process_group:
        dist.destroy_process_group()
