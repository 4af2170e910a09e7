"""Per-rank functions of the asynchronous trainer tests: jobs against the async stand-in
(tests/async_standin.py), each step's batch recorded where the trainer builds it."""

from __future__ import annotations

import hashlib
import os

from tests.sglang_workers import SGLANG_JOB
from tests.trainer_workers import merge, read_metrics


def async_job(hf_dir: str, url: str, run_dir: str, **over) -> dict:
    """The tiny job against the stand-in at ``url``: asynchronous rollouts (eta 1), distributed
    weight sync, the decoupled correction with a band wide enough that the stand-in's known
    log-probs (unrelated to the policy's) still weigh every sequence, a reward by response
    length (the stand-in's long responses make the advantages)."""
    base = merge(SGLANG_JOB, {
        "rollout": {"sglang_urls": [url], "sglang_model_path": hf_dir, "mode": "async",
                    "max_staleness": 1, "weight_sync": "distributed",
                    "weight_sync_port": 0, "sglang_gpus_per_server": 1,
                    "max_new_tokens": 8},
        "algo": {"rollout_correction": "decoupled", "rollout_correction_low": 1e-6,
                 "rollout_correction_high": 1e6, "rollout_correction_cap": 1e6},
        "trainer": {"init_from": hf_dir, "steps": 3, "save_interval": 1, "keep_checkpoints": 5},
        # rewards by length: the stand-in's responses of differing lengths give advantages
        "data": {"eval_size": 0, "reward": "tests.reward_fixtures:length_reward"},
        "logging": {"drift": False, "progress": False}})
    cfg = merge(base, over)
    cfg["rollout"] = {**base["rollout"], **over.get("rollout", {})}
    cfg["run_dir"] = run_dir
    return cfg


def batch_hash(samples, versions: bool = True) -> str:
    """The step's batch as the trainer takes it: prompts, responses, each token's version and
    behaviour log-prob (``versions`` False: without the versions, which a synchronous run does
    not record)."""
    h = hashlib.sha256()
    for s in samples:
        per_token = None if s.versions_R is None or not versions else s.versions_R.tolist()
        h.update(repr((s.prompt_ids, s.response_ids, per_token, s.logprobs_R.tolist())).encode())
    return h.hexdigest()


def async_jobs(cfgs: list) -> list:
    """Run each job in turn in this process group; per job, this rank's batch hash of every RL
    step, every sample's staleness, the final parameters' checksum and (rank 0) the metrics."""
    import torch.distributed as dist

    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.distributed.parallel import destroy_parallel
    from megatron_gspo.rollout.producer import staleness_of
    from megatron_gspo.trainer import loop as trainer
    from megatron_gspo.trainer.optim import param_checksum

    out = []
    make_batch, setup = trainer.make_batch, trainer.setup
    for cfg in cfgs:
        steps, runs = [], []

        def spy(job, ctx, samples, rewards, **kw):
            step = runs[0].step + 1  # (the run's step counts the steps done)
            steps.append({"step": step, "hash": batch_hash(samples),
                          "tokens_and_logprobs": batch_hash(samples, versions=False),
                          "staleness": [staleness_of(step, s) for s in samples]})
            return make_batch(job, ctx, samples, rewards, **kw)

        def keep(job):
            run = setup(job)
            runs.append(run)
            return run

        trainer.make_batch, trainer.setup = spy, keep
        try:
            trainer.train(job_from_dict(cfg))
        finally:
            trainer.make_batch, trainer.setup = make_batch, setup
        rows = read_metrics(cfg["run_dir"]) if dist.get_rank() == 0 else None
        out.append({"steps": steps, "rows": rows, "rank": dist.get_rank(),
                    "params": float(param_checksum(runs[0].policy.gpt))})
        destroy_parallel(keep_process_group=True)
    return out


def kill_at(cfg: dict, step: int) -> None:
    """Run ``cfg`` in this process until it dies by SIGKILL while writing checkpoint ``step``
    (``trainer.kill_during_save``): the run is left as a killed job leaves it."""
    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.trainer import loop as trainer

    cfg = merge(cfg, {"trainer": {"kill_during_save": step}})
    trainer.train(job_from_dict(cfg))


def events_of(url: str) -> list:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/_events", timeout=30) as r:
        return json.loads(r.read())


def checkpoints(run_dir: str) -> list:
    root = os.path.join(run_dir, "checkpoints")
    return sorted(n for n in os.listdir(root) if n.startswith("step_")) if os.path.isdir(root) else []
