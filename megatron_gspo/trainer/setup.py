"""A run's parts, built from the job: data and tokenizer first (a bad file ends the job before
any process group or model), the parallel layout, the policy, the engine, logging, checkpoints."""

from __future__ import annotations

import json
import os

from megatron_gspo.checkpoint.manager import CheckpointManager
from megatron_gspo.config import ConfigError, JobConfig
from megatron_gspo.config.load import job_to_dict
from megatron_gspo.data.prompts import PromptDataset, read_prompt_file
from megatron_gspo.data.synthetic import make_task
from megatron_gspo.data.tokenizer import load_tokenizer
from megatron_gspo.distributed.parallel import init_parallel
from megatron_gspo.backends import backend_for
from megatron_gspo.models import router_losses
from megatron_gspo.models.model import build_model
from megatron_gspo.rewards import get_reward
from megatron_gspo.rewards.pool import make_scorer
from megatron_gspo.trainer.asynchronous import make_producer
from megatron_gspo.trainer.drift_probe import DriftProbe
from megatron_gspo.trainer.engine import connect_servers, make_engine
from megatron_gspo.trainer.faults import NonFiniteGuard, StopSignals
from megatron_gspo.trainer.logger import RunLogger
from megatron_gspo.trainer.optim import OptimConfig, build_optimizer, build_scheduler, wrap_ddp
from megatron_gspo.trainer.resume_point import resume_point
from megatron_gspo.trainer.run import Policy, Prompts, Run
from moe.replay import RoutingReplay


def setup(job: JobConfig) -> Run:
    prompts = load_prompts(job)
    ctx = init_parallel(job.parallel, job.model, seed=job.seed)
    job.check_layout(ctx.dp)
    run_dir = os.path.abspath(job.run_dir)
    ckpt = CheckpointManager(os.path.join(run_dir, "checkpoints"), ctx,
                             keep=job.trainer.keep_checkpoints, fmt=job.trainer.checkpoint_format)
    resume_from = resume_point(job, ckpt)  # (a model of another shape: before building one)
    m = job.model
    routes_needed = m.is_moe and (job.replay.mode != "none" or job.logging.drift)
    gpt = build_model(m, ctx, kernels=job.backend, moe_enable_routing_replay=routes_needed)
    policy = Policy(gpt=gpt, ddp=wrap_ddp(gpt, ctx),
                    replay=RoutingReplay(gpt) if routes_needed else None,
                    guard=NonFiniteGuard(job.trainer.max_consecutive_skips))
    engine = make_engine(job, gpt, ctx, policy.replay, prompts.tokenizer.pad_id)
    logger = RunLogger(run_dir, enabled=ctx.rank == 0, tensorboard=job.logging.tensorboard,
                       progress=job.logging.progress, total_steps=job.trainer.steps)
    if job.rollout.engine == "sglang":
        connect_servers(job, engine, ctx, logger.say)
    run = Run(job=job, ctx=ctx, policy=policy, prompts=prompts, engine=engine, logger=logger,
              ckpt=ckpt, resume_from=resume_from, signals=StopSignals().install(),
              producer=make_producer(job, ctx, engine, prompts))
    if routes_needed and job.logging.drift:
        run.drift = DriftProbe(job, ctx, run_dir, logger.writer, model=policy.ddp,
                               replay=policy.replay, pad_id=prompts.tokenizer.pad_id)
    if job.algo.kl_coef > 0:
        policy.ref_model = build_model(m, ctx, kernels=job.backend)
    rl_router_losses(job, policy)
    logger.say(f"layout: {ctx.describe()} ({backend_for(ctx.device).layers()}); model {m.name}: "
               f"{m.num_layers} layers, {m.num_experts} experts top-{m.top_k}; algo "
               f"{job.algo.name}, replay {job.replay.mode}, engine {job.rollout.engine}; run dir "
               f"{run_dir}")
    save_config(job, run_dir, ctx.rank)
    return run


def load_prompts(job: JobConfig) -> Prompts:
    """The tokenizer (its vocabulary must fit the model's), the training prompts, the held-out
    records and the reward's scorer."""
    tokenizer = load_tokenizer(job.data.tokenizer)
    if tokenizer.vocab_size > job.model.vocab_size:
        raise ConfigError(f"data.tokenizer={job.data.tokenizer!r}: its {tokenizer.vocab_size} ids "
                          f"do not fit model.vocab_size={job.model.vocab_size}; fix: use the "
                          "model's own tokenizer (the checkpoint's directory)")
    train, held_out = load_data(job)
    scorer = make_scorer(get_reward(job.data.reward), workers=job.data.reward_workers,
                         timeout_s=job.data.reward_timeout_s)
    return Prompts(tokenizer=tokenizer, train=train, held_out=held_out, scorer=scorer)


def load_data(job: JobConfig):
    """Training prompts (a resumable PromptDataset) and held-out records."""
    d = job.data
    if d.task == "files":
        train = PromptDataset(d.files, seed=job.seed)
        held = [r for f in d.eval_files for r in read_prompt_file(f)][:d.eval_size or None]
        return train, held
    kw = dict(max_value=d.max_value, max_len=d.max_len, min_len=d.min_len)
    # The held-out set is drawn first, from the task's own distribution; training prompts are
    # drawn from another stream, without the held-out ones.
    held = make_task(d.task, d.eval_size, seed=job.seed + 7919, **kw)
    unseen = {r.prompt for r in held}
    pool = make_task(d.task, d.train_size + 4 * d.eval_size, seed=job.seed, **kw)
    records = [r for r in pool if r.prompt not in unseen][:d.train_size]
    return PromptDataset([], seed=job.seed, records=records), held


def rl_router_losses(job: JobConfig, policy: Policy) -> None:
    """The MoE router losses of the RL updates (``algo.aux_loss_coeff``, ``algo.z_loss_coeff``)."""
    router_losses.set_coefficients(policy.gpt.config, aux_loss_coeff=job.algo.aux_loss_coeff,
                                   z_loss_coeff=job.algo.z_loss_coeff)


def build_rl_optimizer(job: JobConfig, policy: Policy, ctx) -> None:
    """The RL updates' optimizer and LR schedule (over ``steps x minibatches`` updates)."""
    t = job.trainer
    policy.optimizer = build_optimizer(policy.ddp, ctx, OptimConfig(
        lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad))
    policy.scheduler = build_scheduler(policy.optimizer, lr=t.lr, min_lr=t.min_lr,
                                       warmup=t.lr_warmup_steps,
                                       total=t.steps * job.algo.minibatches, style=t.lr_schedule)


def save_config(job: JobConfig, run_dir: str, rank: int) -> None:
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "resolved_config.json"), "w") as f:
            json.dump(job_to_dict(job), f, indent=1)
