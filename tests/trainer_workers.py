"""Trainer runs on spawned ranks (importable by child processes), and shared short settings."""

from __future__ import annotations

import json
import os

# A short job: tiny MoE, 2 SFT steps, 3 RL steps of 4 prompts x 4 responses in 4 mini-batches.
SHORT = {
    "model": {"vocab_size": 128, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
              "num_query_groups": 2, "head_dim": 16, "ffn_hidden_size": 128,
              "moe_ffn_hidden_size": 32, "num_experts": 4, "top_k": 2},
    "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 5},
    "algo": {"minibatches": 4},
    "data": {"task": "reverse", "train_size": 64, "eval_size": 8},
    "trainer": {"steps": 3, "sft_steps": 2, "sft_batch_size": 8, "micro_batch_size": 2,
                "save_interval": 1, "lr": 1e-3},
    "logging": {"progress": False},
}


def merge(base: dict, over: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in over.items():
        if isinstance(v, dict):
            out[k] = {**out.get(k, {}), **v}
        else:
            out[k] = v
    return out


def to_overrides(cfg: dict) -> list[str]:
    """Hydra command-line overrides for the nested dict."""
    out = []
    for section, values in cfg.items():
        if isinstance(values, dict):
            for k, v in values.items():
                val = json.dumps(v) if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else v
                out.append(f"{section}.{k}={val}")
        else:
            out.append(f"{section}={values}")
    return out


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_job(cfg: dict) -> dict:
    """Run the trainer in this rank; rank 0 returns the metrics rows and the history."""
    import torch.distributed as dist

    from megatron_gspo.trainer import loop as trainer
    from megatron_gspo.config.load import job_from_dict

    history = trainer.train(job_from_dict(cfg))
    if dist.get_rank() != 0:
        return None
    return {"history": history, "rows": read_metrics(cfg["run_dir"])}


def _forced_micro_batches(run) -> list:
    """Step 1's rollout as micro-batches with behaviour log-probs and advantages spread over
    [-1, 1]: a gradient whatever the rewards."""
    import torch

    from megatron_gspo.batch.layout import Layout
    from megatron_gspo.batch.micro_batch import micro_batch
    from megatron_gspo.trainer.batching import make_batch, unpack
    from megatron_gspo.trainer.generation import rollout, score
    from megatron_gspo.trainer.passes import logprob_pass

    job, ctx, pad = run.job, run.ctx, run.prompts.tokenizer.pad_id
    records, samples = rollout(job, ctx, run.prompts, run.engine, 1)
    batch, _ = make_batch(job, ctx, samples, score(run.prompts, ctx, records, samples)[0],
                          pad_id=pad)
    batch.advantages_B = torch.linspace(-1, 1, batch.rows)
    size = job.trainer.micro_batch_size
    layouts = [Layout(tuple(range(i, min(i + size, batch.rows))))
               for i in range(0, batch.rows, size)]
    mbs = [micro_batch(batch, layout, pad) for layout in layouts]
    # every row's behaviour log-probs, by a pass of their own (these micro-batches are not the
    # trainer's mini-batches, whose first one takes them from its update)
    logp, _ = logprob_pass(run.policy.ddp, mbs, ctx, temperature=job.rollout.temperature)
    batch.old_logp_BS = unpack(batch, layouts, logp)
    return [micro_batch(batch, layout, pad) for layout in layouts]


def nan_update_job(cfg: dict) -> dict:
    """One normal update, then one with an injected NaN gradient (on rank 0 only): the second is
    skipped on every rank with the weights and the optimizer state bitwise unchanged."""
    import torch

    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.trainer.passes import normalizer_for, policy_update
    from megatron_gspo.trainer.setup import build_rl_optimizer, setup

    job = job_from_dict(cfg)
    run = setup(job)
    build_rl_optimizer(job, run.policy, run.ctx)
    policy = run.policy
    mbs = _forced_micro_batches(run)

    def snapshot():
        params = [p.detach().clone() for p in policy.gpt.parameters()]
        moments = [v.detach().clone() for o in getattr(policy.optimizer, "chained_optimizers",
                                                        [policy.optimizer])
                   for s in o.optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v)]
        return params, moments

    def step(inject):
        return policy_update(policy.ddp, policy.optimizer, mbs, run.ctx, job.algo,
                             temperature=1.0, normalizer=normalizer_for(job.algo, mbs, run.ctx),
                             guard=policy.guard, where="test", inject_nan=inject)

    first = step(False)
    p0, m0 = snapshot()
    second = step(True)
    p1, m1 = snapshot()
    out = {"first_applied": first.applied, "second_applied": second.applied,
           "skipped": policy.guard.skipped,
           "params_equal": all(torch.equal(a, b) for a, b in zip(p0, p1)),
           "moments_equal": len(m0) == len(m1) and all(torch.equal(a, b) for a, b in zip(m0, m1)),
           "num_moments": len(m0)}
    third = step(False)
    out["third_applied"] = third.applied
    out["params_changed_after"] = not all(torch.equal(a, p.detach())
                                          for a, p in zip(p1, policy.gpt.parameters()))
    run.signals.uninstall()
    run.logger.close()
    return out


def step0_resume_job(cfg: dict) -> dict:
    """Checkpoint 0 holds a fresh RL optimizer (no moments): two updates from it, then the same two
    updates after loading it into a new optimizer (the resume path) give bitwise the same weights
    and Adam steps (the loaded optimizer starts fresh: no state, no step taken)."""
    import torch

    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.trainer.checkpoints import save
    from megatron_gspo.trainer.passes import normalizer_for, policy_update
    from megatron_gspo.trainer.setup import build_rl_optimizer, setup

    job = job_from_dict(cfg)
    run = setup(job)
    policy = run.policy
    build_rl_optimizer(job, policy, run.ctx)
    path = save(run, 0)
    mbs = _forced_micro_batches(run)

    def params():
        return [p.detach().clone() for p in policy.gpt.parameters()]

    def adam_steps():
        return sorted({float(s["step"]) for o in getattr(policy.optimizer, "chained_optimizers",
                                                          [policy.optimizer])
                       for s in o.optimizer.state.values() if "step" in s})

    def two_updates():
        for _ in range(2):
            policy_update(policy.ddp, policy.optimizer, mbs, run.ctx, job.algo, temperature=1.0,
                          normalizer=normalizer_for(job.algo, mbs, run.ctx), guard=policy.guard,
                          where="test")

    start = params()
    two_updates()
    fresh, fresh_steps = params(), adam_steps()
    build_rl_optimizer(job, policy, run.ctx)
    run.ckpt.load(path, model=policy.gpt, optimizer=policy.optimizer)
    out = {"weights_restored": all(torch.equal(a, b) for a, b in zip(start, params())),
           "steps_after_load": adam_steps()}
    two_updates()
    out.update(fresh_steps=fresh_steps, resumed_steps=adam_steps(),
               moved=not all(torch.equal(a, b) for a, b in zip(start, fresh)),
               same_weights=all(torch.equal(a, b) for a, b in zip(fresh, params())))
    run.signals.uninstall()
    run.logger.close()
    return out


def scripted_code_job(cfg: dict) -> dict:
    """A run whose reward is tests.reward_fixtures.scripted_code (registered by the import)."""
    import tests.reward_fixtures  # noqa: F401  (registers the reward in this process)

    return train_job(cfg)
