"""A fresh run's start: initial weights, held-out accuracy, the supervised warm-up, the RL
optimizer, checkpoint 0."""

from __future__ import annotations

import os
import time

from megatron_gspo.batch.packing import round_up
from megatron_gspo.batch.rollout_batch import width_multiple
from megatron_gspo.checkpoint.weights import load_weights
from megatron_gspo.config import JobConfig
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.models import router_losses
from megatron_gspo.models.hf_io import SeededTensors
from megatron_gspo.models.hf_mapping import load_hf_weights
from megatron_gspo.trainer.checkpoints import save
from megatron_gspo.trainer.engine import sync_weights
from megatron_gspo.trainer.evaluation import evaluate
from megatron_gspo.trainer.optim import OptimConfig, build_optimizer
from megatron_gspo.trainer.passes import sft_micro_batches, sft_update
from megatron_gspo.trainer.run import Run
from megatron_gspo.trainer.setup import build_rl_optimizer, rl_router_losses


def warm_up(run: Run) -> None:
    """A fresh run: held-out accuracy, the supervised warm-up, accuracy again, checkpoint 0."""
    job, t, policy = run.job, run.job.trainer, run.policy
    run.logger.truncate_after(-1)  # a fresh run: no rows of an earlier attempt in this directory
    if init_weights(policy.gpt, job, run.ctx, t.init_from):
        run.logger.say(f"initial weights: {t.init_from}")
    sync_weights(run, 0)  # every evaluation and rollout sees the trainer's weights
    run.history["accuracy_initial"] = evaluate(run)
    run.logger.say(f"held-out accuracy before training: {run.history['accuracy_initial']:.3f} "
                   f"({len(run.prompts.held_out)} prompts)")
    if t.sft_steps:
        sft(run)
        sync_weights(run, 0)
        run.history["accuracy_before_rl"] = evaluate(run)
    else:  # the same weights, and evaluation is greedy: not evaluated twice
        run.history["accuracy_before_rl"] = run.history["accuracy_initial"]
    run.logger.say(f"held-out accuracy before RL: {run.history['accuracy_before_rl']:.3f}")
    run.logger.log(0, {"eval/accuracy": run.history["accuracy_before_rl"]})
    build_rl_optimizer(job, policy, run.ctx)
    if policy.ref_model is not None:  # the reference policy is the model RL starts from
        policy.ref_model.load_state_dict(policy.gpt.state_dict())
    save(run, 0)


def init_weights(gpt, job: JobConfig, ctx: ParallelContext, path: str) -> bool:
    """Starting weights from a HF Qwen3-MoE directory or a weights checkpoint (any layout), or
    random weights drawn per tensor from the seed (the same on every layout); whether they came
    from ``path``."""
    if not path:
        load_hf_weights(gpt, SeededTensors(job.model, job.seed), job.model, ctx)
        return False
    if os.path.isfile(os.path.join(path, "config.json")):
        load_hf_weights(gpt, path, job.model, ctx)
    else:
        load_weights(gpt, path)
    return True


def sft(run: Run) -> None:
    """Supervised warm-up: next-token loss on the answers of the training prompts (with the
    model's own router load-balancing coefficient)."""
    job, ctx, policy = run.job, run.ctx, run.policy
    t, tok = job.trainer, run.prompts.tokenizer
    optimizer = build_optimizer(policy.ddp, ctx, OptimConfig(lr=t.sft_lr, clip_grad=t.clip_grad))
    router_losses.set_coefficients(policy.gpt.config, aux_loss_coeff=job.model.aux_loss_coeff,
                                   z_loss_coeff=0.0)
    train = run.prompts.train
    data = type(train)([], seed=job.seed + 1, records=train.records)
    per_rank = t.sft_batch_size // ctx.dp
    t0 = time.perf_counter()
    for i in range(1, t.sft_steps + 1):
        recs = data.next_batch(t.sft_batch_size)[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
        prompts = [tok.render_prompt(r.prompt, r.messages) for r in recs]
        answers = [tok.encode(str(r.answer)) for r in recs]
        # One row width on every rank (expert-parallel collectives), split as the layout needs.
        widest = comm.reduce_max_int(max(len(p) + len(a) + 1 for p, a in zip(prompts, answers)),
                                     device=ctx.device)
        width = round_up(widest - 1, width_multiple(ctx)) + 1  # fed + 1
        mbs = sft_micro_batches(prompts, answers, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                size=t.micro_batch_size, width=width)
        tokens = comm.reduce_sum(sum(float(mb.loss_mask_BS.sum()) for mb in mbs),
                                 device=ctx.device, group=ctx.dp_group)
        loss, accuracy = sft_update(policy.ddp, optimizer, mbs, ctx, normalizer=tokens,
                                    guard=policy.guard, where=f"sft step {i}")
        run.logger.scalar("sft/loss", loss, i)
        run.logger.scalar("sft/accuracy", accuracy, i)
        done = accuracy >= t.sft_target_accuracy
        if i % max(1, t.sft_steps // 5) == 0 or i == t.sft_steps or done:
            run.logger.say(f"sft {i}/{t.sft_steps}  loss {loss:.4f}  batch accuracy {accuracy:.3f}"
                           f"  {time.perf_counter() - t0:.0f}s")
        if done:  # the warm-up's goal: a policy that is sometimes right, for RL to improve
            run.logger.say(f"sft: batch accuracy {accuracy:.3f} >= {t.sft_target_accuracy}, "
                           f"warm-up done after {i} steps")
            break
    del optimizer
    rl_router_losses(job, policy)
