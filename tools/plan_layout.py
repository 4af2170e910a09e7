"""Check a job's parallel layout against a world size before submitting, and print it.

    python -m tools.plan_layout --world-size 32 +experiment=qwen3_30b_a3b_gspo

Composes the Hydra config with the given overrides, validates it (the same checks the trainer makes
at start-up) and prints world = tp x pp x cp x dp, the expert layout and the rollout batch split.
Exit status 2 with a one-line error when the layout does not fit.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plan(world_size: int, overrides: list[str]) -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatron_gspo.config import job_from_dict, register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "run_dir=."])
    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)
    job = job_from_dict(data)
    p, m = job.parallel, job.model
    device = "cuda" if job.cluster.name == "slurm" or p.device == "cuda" else "cpu"
    dp = p.validate(world_size, m, device_type=device)
    job.check_layout(dp)
    return (f"world {world_size} = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {dp}; experts: ep {p.ep} "
            f"x etp {p.expert_tp} ({m.num_experts // p.ep} of {m.num_experts} experts per rank); "
            f"sequence parallel {p.sequence_parallel}; model {m.name}; algo {job.algo.name}, replay "
            f"{job.replay.mode}, engine {job.rollout.engine}; {job.rollout.prompts_per_step} prompts "
            f"x {job.rollout.group_size} per step, {job.algo.minibatches} updates per step")


def main(argv=None) -> int:
    from megatron_gspo.config import ConfigError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        print(f"layout: {plan(args.world_size, args.overrides)}")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
