"""The whole job: one section per component (``model``, ``parallel``, ``algo``, ``rollout``,
``replay``, ``data``, ``trainer``, ``logging``, ``cluster``, ``backend``), the checks of their
combinations, and those that depend on the data-parallel size.

The dataclasses of ``megatron_gspo.config`` are the Hydra schema (``config.load`` registers them
in a ConfigStore); YAML files under ``conf/`` only choose values. Every validation error is a
``ConfigError`` whose message is one line naming the key, the bad value and the fix, raised
before any process group exists. The schema imports nothing of the project: the checks that
need other modules (losses, rewards, checkpoints on disk) are ``config.checks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gspo.config.algo import AlgoConfig, ReplayConfig
from megatron_gspo.config.errors import invalid
from megatron_gspo.config.model import ModelConfig, ParallelConfig
from megatron_gspo.config.rollout import RolloutConfig
from megatron_gspo.config.run import (BackendConfig, ClusterConfig, DataConfig, LoggingConfig,
                                      TrainerConfig)


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
    backend: BackendConfig = field(default_factory=BackendConfig)
    seed: int = 1234
    run_dir: str = "."

    def validate(self) -> "JobConfig":
        """Each component's checks, then the combinations (the world size is checked by
        ``ParallelConfig.validate`` once it is known)."""
        for part in (self.model, self.algo, self.rollout, self.replay, self.data, self.trainer,
                     self.cluster, self.backend):
            part.validate()
        if self.replay.mode != "none" and not self.model.is_moe:
            raise invalid("replay.mode", self.replay.mode, "routing replay needs an MoE model",
                          "set replay=none")
        if self.replay.mode == "r3" and not self.rollout.engine_returns_routes:
            raise invalid("replay.mode", "r3", f"rollout.engine={self.rollout.engine} does not "
                          "return routed experts",
                          "set rollout.return_routes=true or use replay=r2")
        if self.algo.old_logprobs == "engine" and self.replay.mode == "r2":
            raise invalid("algo.old_logprobs", "engine", "r2 replays the routes of the trainer's "
                          "old-policy pass, which engine log-probs skip", "use algo.old_logprobs="
                          "recompute with r2")
        if self.algo.old_logprobs == "engine" and self.algo.rollout_correction != "none":
            raise invalid("algo.rollout_correction", self.algo.rollout_correction, "weighs the "
                          "trainer's old-policy log-probs against the engine's, and "
                          "algo.old_logprobs=engine takes the engine's for both (every weight 1)",
                          "use algo.old_logprobs=recompute or auto with rollout correction")
        if self.rollout.cuda_graphs and self.parallel.device != "cuda":
            raise invalid("rollout.cuda_graphs", True, "captures CUDA graphs of the GPU decoding "
                          f"step, and parallel.device={self.parallel.device}",
                          "set parallel.device=cuda (a GPU recipe) or rollout.cuda_graphs=false")
        if self.backend.compile_experts and self.parallel.device != "cuda":
            raise invalid("backend.compile_experts", True, "compiles the GPU backend's grouped "
                          f"experts (bf16), and parallel.device={self.parallel.device} (the CPU "
                          "backend runs its experts through its own kernel)",
                          "set parallel.device=cuda (a GPU recipe) or backend.compile_experts=false")
        if self.rollout.mode != "sync" and self.algo.rollout_correction == "none":
            raise invalid("rollout.mode", self.rollout.mode, "trains on samples of older policies, "
                          "which need an off-policy correction",
                          "set algo.rollout_correction=decoupled")
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        if rows % self.algo.minibatches:
            raise invalid("algo.minibatches", self.algo.minibatches, f"does not divide the "
                          f"{rows} responses of a step (prompts_per_step x group_size)",
                          "choose a divisor")
        return self

    def check_layout(self, dp: int) -> None:
        """Combinations that depend on the data-parallel size."""
        if self.rollout.prompts_per_step % dp:
            raise invalid("rollout.prompts_per_step", self.rollout.prompts_per_step,
                          f"does not split over {dp} data-parallel ranks",
                          f"use a multiple of {dp}")
        rows = self.rollout.prompts_per_step * self.rollout.group_size // dp
        prompts = self.rollout.prompts_per_step // dp
        if self.algo.minibatch_split == "groups" and prompts % self.algo.minibatches:
            raise invalid("algo.minibatch_split", "groups",
                          f"needs the {prompts} prompts of each of "
                          f"{dp} data-parallel ranks to divide into {self.algo.minibatches} "
                          "mini-batches of whole groups", "use interleaved, or a multiple of "
                          f"{dp * self.algo.minibatches} prompts per step")
        per_mb = rows // self.algo.minibatches
        if rows % self.algo.minibatches or per_mb % self.trainer.micro_batch_size:
            raise invalid("trainer.micro_batch_size", self.trainer.micro_batch_size,
                          f"does not divide the {per_mb} rows of a mini-batch on each of {dp} "
                          "data-parallel ranks", "choose a divisor")
        r = self.rollout
        if r.engine == "sglang":
            # A replica's other ranks wait in one broadcast while its leader waits for the
            # servers, generates (in waves of max_in_flight requests) or updates weights.
            waves = -(-rows // (r.sglang_rows_per_request * r.sglang_max_in_flight))
            waves *= r.staleness_bound + 1  # async: a batch's rounds under one version
            waits = {"rollout.sglang_startup_timeout_s": r.sglang_startup_timeout_s,
                     f"{waves} x rollout.sglang_generate_timeout_s":
                         waves * r.sglang_generate_timeout_s,
                     "rollout.sglang_update_timeout_s": r.sglang_update_timeout_s}
            what, longest = max(waits.items(), key=lambda kv: kv[1])
            if self.parallel.timeout_s < longest:
                raise invalid("parallel.timeout_s", self.parallel.timeout_s, f"is shorter than "
                              f"{what} ({longest:g} s), which the other ranks of a replica can "
                              "wait for its leader", f"set parallel.timeout_s >= {longest:g}")
        if self.trainer.sft_steps and self.trainer.sft_batch_size % dp:
            raise invalid("trainer.sft_batch_size", self.trainer.sft_batch_size,
                          f"does not split over {dp} data-parallel ranks",
                          f"use a multiple of {dp}")
