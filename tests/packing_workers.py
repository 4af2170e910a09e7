"""Packed vs padded RL steps on spawned ranks: the same responses (synthetic, long-tailed lengths,
random rewards, engine log-probs and routes) through the trainer's own phases, once with padded
rows and once packed, from the same seeded weights."""

from __future__ import annotations

from tests.trainer_workers import SHORT, merge

# 4 prompts x 4 responses per data-parallel rank in 2 mini-batches; padded micro-batches of 2
# rows; packed micro-batches of at most 40 tokens (rows are 3 to 29 tokens).
PACKING = merge(SHORT, {"rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 24},
                        # the trainer's pass: these responses' engine log-probs are random
                        "algo": {"minibatches": 2, "old_logprobs": "recompute"},
                        "trainer": {"micro_batch_size": 2, "max_tokens_per_micro_batch": 40,
                                    "sft_steps": 0, "lr": 1e-3}})


def synthetic_samples(job, dp: int, dp_rank: int):
    """This data-parallel rank's responses: prompts of 3-6 tokens, one per group, responses of
    1-24 tokens (lognormal, capped), random engine log-probs and routes (a group's prompt tokens
    routed alike, as the engine's one prefill per prompt gives them), rewards in {0, 1}."""
    import torch

    from megatron_gspo.rollout.types import Sample

    g = torch.Generator().manual_seed(1000 + dp_rank)
    m, r = job.model, job.rollout
    n = (r.prompts_per_step // dp) * r.group_size
    samples = []
    for i in range(n):
        if i % r.group_size == 0:
            p = int(torch.randint(3, 7, (), generator=g))
            prompt = torch.randint(3, m.vocab_size, (p,), generator=g).tolist()
            prompt_routes = torch.rand(p, m.num_layers, m.num_experts,
                                       generator=g).argsort(-1)[..., :m.top_k]
        resp = int(min(r.max_new_tokens, max(1, torch.empty(()).log_normal_(1.5, 0.8,
                                                                              generator=g))))
        ids = prompt + torch.randint(3, m.vocab_size, (resp,), generator=g).tolist()
        routes = torch.cat([prompt_routes, torch.rand(resp - 1, m.num_layers, m.num_experts,
                                                      generator=g).argsort(-1)[..., :m.top_k]])
        samples.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:],
                              logprobs_R=-torch.rand(resp, generator=g) * 3,
                              finish_reason="length" if resp == r.max_new_tokens else "stop",
                              routes_TLK=routes, prompt_index=i // r.group_size))
    rewards = (torch.rand(n, generator=g) < 0.5).float()
    return samples, rewards


def _step_inputs(cfg: dict):
    """The run of ``cfg`` (seeded weights, the RL optimizer) and its batch of this rank's
    synthetic responses: (job, run, samples, rewards, batch)."""
    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.trainer.batching import make_batch
    from megatron_gspo.trainer.setup import build_rl_optimizer, setup
    from megatron_gspo.trainer.warmup import init_weights

    job = job_from_dict(cfg)
    run = setup(job)
    init_weights(run.policy.gpt, job, run.ctx, "")
    build_rl_optimizer(job, run.policy, run.ctx)
    samples, rewards = synthetic_samples(job, run.ctx.dp, run.ctx.dp_rank)
    batch, _ = make_batch(job, run.ctx, samples, rewards, pad_id=run.prompts.tokenizer.pad_id)
    return job, run, samples, rewards, batch


def _behaviour_and_updates(run, batch):
    """The step's behaviour phase, rollout correction and updates: (results, drift)."""
    from megatron_gspo.trainer.behaviour import (behaviour_logprobs, correct_for_the_engine,
                                                 step_plan)
    from megatron_gspo.trainer.updates import update

    plan = step_plan(run, batch)
    routes = behaviour_logprobs(run, batch, plan)
    correct_for_the_engine(run.job.algo, run.ctx, batch)
    return update(run, batch, plan, routes)


def _close(run) -> None:
    run.signals.uninstall()
    run.prompts.scorer.close()
    run.logger.close()


def rl_step_job(cfg: dict) -> dict:
    """One RL step of ``cfg`` on the synthetic responses; rank-local results: every update's loss
    and grad norm, and the updated policy's log-probs of this rank's responses (padded rows,
    response tokens)."""
    import torch

    from megatron_gspo.batch.layout import Layout
    from megatron_gspo.batch.micro_batch import micro_batch
    from megatron_gspo.batch.rollout_batch import build_batch
    from megatron_gspo.trainer.batching import minibatch_layouts
    from megatron_gspo.trainer.passes import logprob_pass

    job, run, samples, rewards, batch = _step_inputs(cfg)
    results, drift = _behaviour_and_updates(run, batch)
    pad = run.prompts.tokenizer.pad_id
    mine = build_batch(samples, rewards, torch.zeros(len(samples)), width=batch.width,
                       pad_id=pad, num_experts=job.model.num_experts)
    mbs = [micro_batch(mine, Layout(tuple(range(i, min(i + 4, mine.rows)))), pad)
           for i in range(0, mine.rows, 4)]
    after, _ = logprob_pass(run.policy.ddp, mbs, run.ctx, temperature=1.0)
    after = torch.cat(after)
    _close(run)
    return {"loss": [float(r.metrics["loss"]) for r in results],
            "grad_norm": [r.grad_norm for r in results],
            "clip_fraction": [float(r.metrics.get("clip_fraction", 0.0)) for r in results],
            "after": after[mine.mask_BS > 0], "drift": drift,
            "micro_batches": [len(per_k) for per_k in (batch.layouts or [])],
            "tokens": int(batch.lengths_B.sum()),
            "fed": sum(layout.fed_tokens(batch.lengths_B)
                       for per_k in minibatch_layouts(job, batch) for layout in per_k),
            "shared": sum(layout.shares_prompts for per_k in (batch.layouts or [])
                          for layout in per_k)}


def first_minibatch_job(cfg: dict) -> dict:
    """The old-policy pass and the updates of one RL step, and for reference the old policy's
    log-probs of every micro-batch by a pass of their own before anything changes: which
    micro-batches the trainer's pass fed, and whether the behaviour log-probs it ends up with
    (the first mini-batch's from its own update) are the reference's, bitwise."""
    import torch

    from megatron_gspo.algorithms.behaviour import behaviour_source
    from megatron_gspo.trainer.batching import (engine_routes, micro_batches_of,
                                                minibatch_layouts, unpack)
    from megatron_gspo.trainer.behaviour import (behaviour_logprobs, correct_for_the_engine,
                                                 step_plan)
    from megatron_gspo.trainer.passes import logprob_pass
    from megatron_gspo.trainer.run import Timers
    from megatron_gspo.trainer.step_metrics import step_metrics
    from megatron_gspo.trainer.updates import update
    from moe.instrument import local_layers_of

    job, run, samples, _, batch = _step_inputs(cfg)
    per_k = minibatch_layouts(job, batch)
    layouts = [layout for per in per_k for layout in per]
    mbs = micro_batches_of(batch, layouts, run.prompts.tokenizer.pad_id)
    targets = (engine_routes(batch, layouts, layers=local_layers_of(job.model, run.ctx),
                             ctx=run.ctx) if job.replay.mode == "r3" else None)
    policy = run.policy
    reference, _ = logprob_pass(policy.ddp, mbs, run.ctx, temperature=1.0, replay=policy.replay,
                                targets=targets)
    reference = unpack(batch, layouts, reference)
    fed = []
    hook = policy.ddp.module.register_forward_pre_hook(lambda *_: fed.append(1))
    plan = step_plan(run, batch)
    routes = behaviour_logprobs(run, batch, plan)
    hook.remove()
    correct_for_the_engine(job.algo, run.ctx, batch)
    results, _ = update(run, batch, plan, routes)
    metrics = step_metrics(run.ctx, policy, batch, samples, minibatch_layouts(job, batch),
                           results, {}, Timers(), 1.0)
    _close(run)
    # The first mini-batch's rows (every position of them) against the rest's response tokens.
    first = torch.zeros(batch.rows, dtype=torch.bool)
    first[[row for layout in per_k[0] for row in layout.rows]] = True
    rest = ~first[:, None] & (batch.mask_BS > 0)
    first_resp = first[:, None] & (batch.mask_BS > 0)
    recomputed = batch.trainer_logp_BS
    none = torch.full_like(reference, float("nan")) if recomputed is None else recomputed
    mismatch, compared = batch.logprob_mismatch()
    return {"source": behaviour_source(job, run.ctx.device.type),
            "old_pass_forwards": len(fed), "micro_batches": len(layouts),
            "first_equal": torch.equal(batch.old_logp_BS[first], reference[first]),
            "first_is_engine": torch.equal(batch.old_logp_BS[first_resp],
                                           batch.engine_logp_BS[first_resp]),
            "rest_is_engine": torch.equal(batch.old_logp_BS[rest], batch.engine_logp_BS[rest]),
            # the trainer's own log-probs: where it computed them, and only there
            "recomputed_none": recomputed is None,
            "recomputed_first": torch.equal(none[first_resp], reference[first_resp]),
            # ... and marked so: the trainer computed the first mini-batch's rows alone
            "trainer_rows_first_only": batch.trainer_rows_B is not None
            and torch.equal(batch.trainer_rows_B, first),
            # rollout/logprob_mismatch's terms: |engine - trainer| where the trainer has them
            "mismatch": mismatch, "compared": compared,
            "mismatch_metric": metrics.get("rollout/logprob_mismatch"),
            "first_mismatch": float((batch.engine_logp_BS - reference)[first_resp].abs().sum()),
            "first_tokens": float(first_resp.sum()), "tokens": float((batch.mask_BS > 0).sum()),
            "first_minibatch": len(per_k[0]),
            "old_equal": torch.equal(batch.old_logp_BS, reference),
            "recomputed_equal": torch.equal(none, reference),
            "old_max_diff": float((batch.old_logp_BS - reference).abs().max()),
            "recomputed_max_diff": float((none - reference).abs().max()),
            "ratio": [float(r.metrics["ratio_mean"]) for r in results],
            # the reference model's log-probs (KL term) at every response target
            "reference_filled": batch.ref_logp_BS is not None
            and bool((batch.ref_logp_BS[batch.mask_BS > 0] < 0).all())}
