"""The RL trainer behind ``python -m megatron_gspo``.

``train(job)`` is the algorithm; every phase is one call and one timer:

    rollout -> rewards -> group advantages -> old log-probs (R2 record) -> K mini-batch updates
    -> weight sync -> metrics -> checkpoint

``setup`` builds the parts (parallel layout, model, optimizer, engine, data, logging) into a
``Run``; the phases live below the loop, the model passes in ``policy``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_gspo import comm, cpu_backend, router_losses, te
from megatron_gspo.advantages import (group_advantages, informative_groups, overlong_penalty,
                                      select_groups)
from megatron_gspo.checkpoint import CheckpointError, CheckpointManager
from megatron_gspo.config import ConfigError, JobConfig, job_to_dict
from megatron_gspo.correction import rollout_weights, weighted_advantages
from megatron_gspo.data.prompts import PromptDataset, PromptRecord, read_prompt_file
from megatron_gspo.data.synthetic import make_task
from megatron_gspo.data.tokenizer import Tokenizer, load_tokenizer
from megatron_gspo.drift_probe import DriftProbe
from megatron_gspo.evaluation import evaluate_records, score_samples
from megatron_gspo.faults import REQUEUE_MARKER, NonFiniteGuard, StopRequested, StopSignals
from megatron_gspo.hf_qwen3moe import SeededTensors, load_hf_weights
from megatron_gspo.metrics import RunLogger
from megatron_gspo.model import build_model
from megatron_gspo.optim import (OptimConfig, build_optimizer, build_scheduler, wrap_ddp)
from megatron_gspo.parallel import ParallelContext, init_parallel
from megatron_gspo.packing import plan_step
from megatron_gspo.policy import (logprob_pass, normalizer_for, policy_update, sft_micro_batches,
                                  sft_update)
from megatron_gspo.policy_io import export_hf_dir, hf_config_at
from megatron_gspo.rewards import get_reward
from megatron_gspo.rewards.pool import InlineScorer, RewardPool, make_scorer
from megatron_gspo.rl_batch import (build_batch, exchange_rows, forward_only_layouts, layouts_of,
                                    micro_batch, packed_layouts, prompt_shares, round_up,
                                    route_targets, row_width, width_multiple)
from megatron_gspo.rollout.local_engine import LocalEngine
from megatron_gspo.rollout.sglang_engine import (RetryPolicy, SGLangEngine, SGLangError,
                                                 destroy_weights_update_group,
                                                 init_weights_update_group)
from megatron_gspo.rollout.sglang_layout import ServerLayout
from megatron_gspo.rollout.share import share_samples
from megatron_gspo.rollout.types import SamplingParams
from megatron_gspo.weights import load_weights, save_weights
from moe.instrument import local_layers_of
from moe.replay import RoutingReplay


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
class Run:
    """Everything one training run holds."""

    job: JobConfig
    ctx: ParallelContext
    tokenizer: Tokenizer
    gpt: GPTModel
    ddp: DistributedDataParallel
    engine: Union[LocalEngine, SGLangEngine]
    replay: Optional[RoutingReplay]  # when routes are recorded or replayed
    train_data: PromptDataset
    eval_records: list[PromptRecord]
    scorer: Union[InlineScorer, RewardPool]  # rewards: in process, or a bounded worker pool
    logger: RunLogger
    ckpt: CheckpointManager
    guard: NonFiniteGuard
    signals: StopSignals
    drift: Optional[DriftProbe] = None
    ref_model: Optional[GPTModel] = None
    sync_group: Optional[torch.distributed.ProcessGroup] = None  # weight_sync=distributed
    optimizer: Optional[MegatronOptimizer] = None
    scheduler: Optional[OptimizerParamScheduler] = None
    step: int = 0  # RL steps done
    updates: int = 0  # optimizer updates done (RL)
    history: dict = field(default_factory=dict)


def train(job: JobConfig) -> dict:
    """Run (or resume) the job; returns held-out accuracy before and after RL and the last
    step's metrics."""
    run = setup(job)
    try:
        if resume(run):
            sync_weights(run)  # the engine starts from the trainer's weights
        else:
            warm_up(run)  # held-out accuracy before, SFT, accuracy after SFT, checkpoint 0
        for step in range(run.step + 1, job.trainer.steps + 1):
            metrics = rl_step(run, step)
            if job.trainer.eval_interval and step % job.trainer.eval_interval == 0:
                metrics["eval/accuracy"] = evaluate(run)
            run.logger.log(step, metrics)  # before the checkpoint: a resume never lacks this row
            run.logger.bar(step, _summary(metrics))
            stop = run.signals.agreed(run.ctx.device)
            due = job.trainer.save_interval and step % job.trainer.save_interval == 0
            if stop or due or step == job.trainer.steps:
                t0 = time.perf_counter()
                path = save(run, step)
                run.logger.scalar("perf/time/checkpoint_s", time.perf_counter() - t0, step)
            if stop:
                stop_for_requeue(run, stop, path)
        run.history["accuracy_after_rl"] = evaluate(run)
        run.logger.log(job.trainer.steps, {"eval/accuracy": run.history["accuracy_after_rl"]},
                       {"final": True})
        if job.trainer.export_hf_at_end:
            export_policy(run)
        report(run)
        return run.history
    finally:
        if run.sync_group is not None:
            destroy_weights_update_group(run.engine, run.sync_group)
        run.signals.uninstall()
        run.scorer.close()
        run.logger.close()


def rl_step(run: Run, step: int) -> dict:
    """One rollout batch and its K policy updates; returns the step's metrics."""
    timers = Timers()
    t0 = time.perf_counter()
    samples, rewards, sampling = sample_batch(run, step, timers)  # rollout and reward phases
    batch, overlong = make_batch(run, samples, rewards)
    with timers("old_logprobs"):
        routes = old_logprobs(run, batch)
    with timers("update"):
        correction = correct_for_the_engine(run, batch)
        results, drift = update(run, batch, routes)
    with timers("weight_sync"):
        sync_weights(run)
    run.step = step
    return step_metrics(run, step, batch, samples, results,
                        {**drift, **correction, **sampling, **overlong}, timers,
                        time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Phases.
# ---------------------------------------------------------------------------------------------

def sample_batch(run: Run, step: int, timers: Timers):
    """The step's responses and rewards. With ``rollout.dynamic_sampling``, rounds of fresh
    prompts until every rank holds a full batch of groups whose rewards differ (at most
    ``rollout.max_sampling_rounds``; groups of equal rewards fill what is missing then)."""
    r, ctx = run.job.rollout, run.ctx
    g, wanted = r.group_size, r.prompts_per_step // ctx.dp
    kept, spare, failures, sampled = [], [], 0, 0
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    for attempt in range(rounds):
        with timers("rollout"):
            records, samples = rollout(run, step, attempt)
        with timers("reward"):
            rewards, failed = score(run, records, samples)
        failures += failed
        groups = [(samples[i:i + g], rewards[i:i + g]) for i in range(0, len(samples), g)]
        sampled += len(groups)
        if not r.dynamic_sampling:
            kept = groups
            break
        informative = informative_groups(rewards, g)
        keep, drop = select_groups(informative, g, wanted - len(kept))
        kept += [groups[i] for i in keep]
        spare += [groups[i] for i in drop if not informative[i * g]]  # equal rewards
        if comm.all_ranks(len(kept) >= wanted, device=ctx.device):  # every rank: same rounds
            break
    kept += spare[:wanted - len(kept)]
    metrics = reward_failures(run, failures)
    if r.dynamic_sampling:
        lead = ctx.is_replica_leader
        dropped = comm.reduce_sum(sampled - len(kept) if lead else 0, device=ctx.device)
        metrics.update({"rollout/sampling_rounds": attempt + 1, "rollout/dropped_groups": dropped})
    samples = [s for group, _ in kept for s in group]
    return samples, torch.cat([rw for _, rw in kept]), metrics


def rollout(run: Run, step: int, attempt: int = 0):
    """This data-parallel rank's prompts of the step and their responses (``attempt``: the round
    of dynamic sampling, with fresh prompts and seeds). The local engine runs on every rank of
    the replica (its model is sharded over them); an SGLang request goes out from the replica's
    leader only, and the responses reach the other ranks by broadcast."""
    r, ctx = run.job.rollout, run.ctx
    prompts = run.train_data.next_batch(r.prompts_per_step)  # the same global batch on every rank
    per_rank = r.prompts_per_step // ctx.dp
    mine = prompts[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
    ids = [run.tokenizer.render_prompt(p.prompt, p.messages) for p in mine]
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, top_k=r.top_k,
                            stop_token_ids=(run.tokenizer.eos_id,),
                            seed=run.job.seed * 100_003 + step + attempt * 1_000_003)
    samples = generate(run, ids, r.group_size, params,
                       first_row=ctx.dp_rank * per_rank * r.group_size)
    return [mine[s.prompt_index] for s in samples], samples


def generate(run: Run, ids, samples_per_prompt: int, params: SamplingParams, *,
             first_row: int = 0) -> list:
    ctx = run.ctx
    if run.job.rollout.engine == "local":
        return run.engine.generate(ids, samples_per_prompt, params, first_row=first_row)
    samples = (run.engine.generate(ids, samples_per_prompt, params, first_row=first_row)
               if ctx.is_replica_leader else None)
    return share_samples(samples, group=ctx.replica_group, device=ctx.device)


def score(run: Run, records, samples) -> tuple[torch.Tensor, int]:
    """Rewards, scored once per replica (by its leader) and broadcast to its other ranks; and how
    many rewards raised or timed out (scored 0; on the leader)."""
    return score_samples(records, samples, decode=run.tokenizer.decode, scorer=run.scorer,
                         ctx=run.ctx)


def reward_failures(run: Run, failures: int) -> dict:
    """``rollout/reward_failures``: rewards of the step that raised or timed out, every replica's
    (counted on its leader)."""
    total = comm.reduce_sum(failures if run.ctx.is_replica_leader else 0, device=run.ctx.device)
    return {"rollout/reward_failures": total}


def make_batch(run: Run, samples, rewards):
    """The step's rows with group advantages, after ``rollout.overlong`` (soft penalty on the
    rewards, or no loss on truncated responses); with ``trainer.packing``, the rows each
    data-parallel rank trains (balanced by tokens) and their packed micro-batches. Returns the
    batch and the overlong metrics."""
    r, ctx, metrics = run.job.rollout, run.ctx, {}
    if r.overlong == "soft_penalty":
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        penalty = overlong_penalty(lengths, r.max_new_tokens, r.overlong_buffer).float()
        rewards = rewards + penalty
        metrics["rollout/overlong_penalty"] = _dp_mean(run, float(penalty.sum()), len(samples))
    adv = group_advantages(rewards, r.group_size, scale=run.job.algo.scale_advantages)
    width = row_width(samples, device=ctx.device, multiple_of=width_multiple(ctx))
    batch = build_batch(samples, rewards, adv, width=width, pad_id=run.tokenizer.pad_id,
                        num_experts=run.job.model.num_experts)
    batch.informative_B = informative_groups(rewards, r.group_size).float()
    if r.overlong == "mask":
        cut = torch.tensor([s.finish_reason == "length" for s in samples])
        batch.mask_BS[cut] = 0.0
        metrics["rollout/overlong_masked"] = _dp_mean(run, float(cut.sum()), len(samples))
    if run.job.trainer.packing:
        batch = pack_batch(run, batch)
    return batch, metrics


def shares_prompts(run: Run) -> bool:
    """``trainer.share_prompts`` where it applies: packed rows without context parallelism, on
    this project's SDPA attention (not Transformer Engine's)."""
    t = run.job.trainer
    return (t.packing and t.share_prompts and run.ctx.cp == 1
            and not te.use_te_spec(run.ctx.device.type))


def pack_batch(run: Run, batch):
    """Packing: every rank plans the step from all ranks' row lengths (and, sharing prompts,
    which rows hold the same prompt), receives its rows and cuts them into packed
    micro-batches (``megatron_gspo.packing``)."""
    ctx, t = run.ctx, run.job.trainer
    lengths = comm.all_gather_vector(batch.lengths_B, device=ctx.device, group=ctx.dp_group)
    shares = None
    if shares_prompts(run):
        mine = torch.tensor(prompt_shares(batch), dtype=torch.long).reshape(-1)
        shares = [list(zip(v[0::2], v[1::2])) for v in
                  comm.all_gather_vector(mine, device=ctx.device, group=ctx.dp_group)]
    seq_multiple = 2 * ctx.cp if ctx.cp > 1 else 1
    row_multiple = width_multiple(ctx)
    plan = plan_step(lengths, minibatches=run.job.algo.minibatches,
                     budget=t.max_tokens_per_micro_batch, seq_multiple=seq_multiple,
                     row_multiple=row_multiple, shares=shares, group_size=split_groups(run))
    batch = exchange_rows(batch, plan, lengths, ctx, num_experts=run.job.model.num_experts)
    # Expert parallelism's all-gather dispatcher exchanges equal token counts: the k-th
    # micro-batch gets one length on every rank. Pipeline stages exchange activations of one
    # shape per pass (Megatron's variable sequence lengths need the all-to-all dispatcher):
    # there, all micro-batches share one length.
    batch.layouts = packed_layouts(plan, ctx.dp_rank, lengths, seq_multiple=seq_multiple,
                                   row_multiple=row_multiple, across_ranks=ctx.ep > 1,
                                   same_length=ctx.pp > 1, shares=shares)
    return batch


def _dp_mean(run: Run, total: float, count: int) -> float:
    total, count = comm.reduce_values([total, count], device=run.ctx.device,
                                      group=run.ctx.dp_group)
    return total / max(count, 1.0)


def split_groups(run: Run) -> int:
    """The group size when mini-batches take whole groups (``algo.minibatch_split``), else 0."""
    return run.job.rollout.group_size if run.job.algo.minibatch_split == "groups" else 0


def _layouts(run: Run, batch) -> list:
    """The micro-batch layouts of each mini-batch (packed, or padded rows)."""
    return layouts_of(batch, run.job.algo.minibatches, run.job.trainer.micro_batch_size,
                      split_groups(run))


def _micro_batches(run: Run, batch, layouts) -> list:
    return [micro_batch(batch, layout, run.tokenizer.pad_id) for layout in layouts]


def _targets(run: Run, batch, layouts) -> list:
    """Engine routes of each micro-batch for this rank's routers (R3 and rollout/train drift)."""
    layers = run.drift.layers if run.drift else _local_layers(run)
    return [route_targets(batch, layout, layers=layers, ctx=run.ctx) for layout in layouts]


def _unpack(batch, layouts, values: list) -> torch.Tensor:
    """Per-micro-batch values back in the batch's [B, S] rows."""
    out = torch.zeros(batch.rows, batch.width)
    for layout, v in zip(layouts, values):
        layout.scatter(out, v)
    return out


def reuses_first_minibatch(run: Run, batch) -> bool:
    """Whether the first mini-batch's behaviour log-probs come from its own update's forward
    (exactly the old policy's) instead of the pass or the engine. Not when something reads
    them before the updates (R2, rollout correction, the drift probe reading the pass), nor
    with ``algo.old_logprobs=engine`` asked for: the engine's on every row."""
    return (run.job.replay.mode != "r2" and run.job.algo.rollout_correction == "none"
            and run.job.algo.old_logprobs != "engine" and not _probe_reads_pass(run, batch))


def engine_behaviour(run: Run) -> bool:
    """Whether the behaviour log-probs are the engine's (``JobConfig.behaviour_source``): then
    no old-policy pass runs at all (R3's routes are the engine's; the drift probe runs its own
    forward)."""
    return run.job.behaviour_source(run.ctx.device.type) == "engine"


def _probe_reads_pass(run: Run, batch) -> bool:
    """Whether the drift probe takes the pass's first forward instead of one of its own."""
    return (run.drift is not None and not engine_behaviour(run)
            and run.drift.reads_old_pass(batch))


def old_logprobs(run: Run, batch):
    """Behaviour log-probs of the whole batch on the current (old) policy, and the routes of
    each micro-batch's forward (recorded; or under R3, the engine's, replayed), in the order
    the updates consume them: the engine's (``engine_behaviour``: no pass) or the trainer's
    pass's. When ``reuses_first_minibatch``, the first mini-batch's rows hold NaN until the
    first update fills them in from its own forward (``batch.first_minibatch_pending``), and the
    pass skips them."""
    job = run.job
    per_k = _layouts(run, batch)
    layouts = [layout for per in per_k for layout in per]
    temp = job.rollout.temperature
    routes = None
    skip = len(per_k[0]) if reuses_first_minibatch(run, batch) else 0
    r3 = _targets(run, batch, layouts) if job.replay.mode == "r3" else None
    batch.recomputed_rows_B = None
    if engine_behaviour(run):
        batch.old_logp_BS = batch.engine_logp_BS.clone()
        batch.recomputed_logp_BS = None
        if skip:  # the trainer's own log-probs: the first update's forward gives those rows'
            batch.recomputed_logp_BS = torch.full_like(batch.old_logp_BS, float("nan"))
            batch.recomputed_rows_B = torch.zeros(batch.rows, dtype=torch.bool)
            batch.recomputed_rows_B[[row for layout in per_k[0] for row in layout.rows]] = True
        routes = r3
    else:
        # Recorded routes serve R2 and the drift probe's first forward, which never skip.
        record = run.replay is not None and r3 is None and not skip
        # Routes recorded or replayed follow the updates' micro-batches; log-probs alone need not.
        passed = layouts[skip:] if record or r3 is not None else _forward_only(run, layouts[skip:])
        logp = []
        if passed:
            logp, routes = logprob_pass(run.ddp, _micro_batches(run, batch, passed), run.ctx,
                                        temperature=temp, replay=run.replay, record=record,
                                        targets=r3[skip:] if r3 is not None else None)
        logp = _unpack(batch, passed, logp)
        routes = r3 if r3 is not None else routes
        batch.old_logp_BS = batch.recomputed_logp_BS = logp
    for layout in layouts[:skip]:  # until the first update fills them: loud if read
        for values in (batch.old_logp_BS, batch.recomputed_logp_BS):  # (maybe one tensor)
            layout.scatter(values, torch.full_like(layout.gather(values), float("nan")))
    batch.first_minibatch_pending = bool(skip)
    if run.ref_model is not None:
        layouts = _forward_only(run, layouts)
        ref, _ = logprob_pass(run.ref_model, _micro_batches(run, batch, layouts), run.ctx,
                              temperature=temp)
        batch.ref_logp_BS = _unpack(batch, layouts, ref)
    return routes


def _forward_only(run: Run, layouts: list) -> list:
    return forward_only_layouts(layouts, run.job.trainer.max_tokens_per_micro_batch,
                                ep=run.ctx.ep, pp=run.ctx.pp)


def correct_for_the_engine(run: Run, batch) -> dict:
    """Rollout correction (``algo.rollout_correction``): importance weights of the old policy
    over the engine's sampling, carried by the advantages; returns the step's metrics of it."""
    a, ctx = run.job.algo, run.ctx
    if a.rollout_correction == "none":
        return {}
    weights, m = rollout_weights(batch.old_logp_BS.double(), batch.engine_logp_BS.double(),
                                 batch.mask_BS, mode=a.rollout_correction,
                                 cap=a.rollout_correction_cap, low=a.rollout_correction_low,
                                 high=a.rollout_correction_high)
    batch.advantages_B = weighted_advantages(a.name, batch.advantages_B.double(), weights,
                                             batch.mask_BS).float()
    tokens = float(batch.mask_BS.sum())
    seqs = float((batch.mask_BS.sum(-1) > 0).sum())
    weight_sum, token_sum, masked, seq_sum = comm.reduce_values(
        [m["mean_weight"] * tokens, tokens, m["masked_fraction"] * seqs, seqs],
        device=ctx.device, group=ctx.dp_group)
    return {"train/rollout_correction/mean_weight": weight_sum / max(token_sum, 1.0),
            "train/rollout_correction/masked_fraction": masked / max(seq_sum, 1.0)}


def update(run: Run, batch, routes):
    """K mini-batch updates; the first is on-policy (ratio 1; against the engine's log-probs
    with ``algo.old_logprobs=engine``), later ones are off-policy."""
    job = run.job
    results, drift = [], {}
    replaying = job.replay.mode in ("r2", "r3")
    step, done = run.step + 1, 0
    for k, layouts in enumerate(_layouts(run, batch)):
        mbs = _micro_batches(run, batch, layouts)
        if k == 0 and run.drift is not None:
            drift.update(run.drift.before_updates(run, batch, routes, step))
        targets = routes[done:done + len(mbs)] if replaying else None
        done += len(mbs)
        run.updates += 1
        on_policy = k == 0 and batch.first_minibatch_pending
        result = policy_update(
            run.ddp, run.optimizer, mbs, run.ctx, job.algo, temperature=job.rollout.temperature,
            normalizer=normalizer_for(job.algo, mbs, run.ctx), guard=run.guard,
            where=f"update {run.updates}", replay=run.replay, targets=targets,
            inject_nan=run.updates in job.trainer.nan_at_updates, on_policy=on_policy)
        if on_policy:  # the behaviour log-probs of the first mini-batch, from its own forward
            for layout, values in zip(layouts, result.extra.pop("old_logp")):
                layout.scatter(batch.old_logp_BS, values)
                layout.scatter(batch.recomputed_logp_BS, values)  # (maybe the same tensor)
            batch.first_minibatch_pending = False
        if result.applied:
            run.scheduler.step(1)
        results.append(result)
        if k == 0 and run.drift is not None:
            drift.update(run.drift.after_first_update(run, step))
    return results, drift


def sync_weights(run: Run) -> None:
    """Push the updated weights to the rollout engine (the local engine shares them)."""
    if run.job.rollout.engine == "local":
        run.engine.update_weights(None)
        return
    r = run.job.rollout
    if r.weight_sync == "distributed" and run.sync_group is None and run.ctx.rank == 0:
        # SGLang's servers join rank 0 of the trainer in one group for the broadcasts (NCCL on
        # GPUs; gloo on CPU, where only the test stand-in serves).
        run.sync_group = init_weights_update_group(
            run.engine, master_address=sync_address(run.job), master_port=r.weight_sync_port,
            engine_gpus=[r.sglang_gpus_per_server] * len(run.engine.clients),
            backend="nccl" if run.ctx.device.type == "cuda" else "gloo",
            timeout_s=r.sglang_update_timeout_s)
    stats = run.engine.sync_from_model(
        run.gpt, run.job.model, run.ctx, mode=r.weight_sync,
        disk_dir=os.path.join(run.job.run_dir, "weight_sync"), group=run.sync_group,
        bucket_bytes=int(r.weight_sync_bucket_mb * 2**20))
    if stats is not None:
        run.logger.say(stats.describe())


def evaluate(run: Run) -> float:
    """Held-out accuracy: greedy responses to the eval prompts, mean reward (split over DP)."""
    params = SamplingParams(max_new_tokens=run.job.rollout.max_new_tokens, temperature=0.0,
                            stop_token_ids=(run.tokenizer.eos_id,))
    return evaluate_records(
        run.eval_records, ctx=run.ctx, params=params, generate=functools.partial(generate, run),
        score=functools.partial(score, run),
        render=lambda p: run.tokenizer.render_prompt(p.prompt, p.messages)).accuracy


def step_metrics(run: Run, step, batch, samples, results, drift, timers, seconds) -> dict:
    """The step's scalars (the TensorBoard tags listed in ``megatron_gspo.metrics``)."""
    ctx = run.ctx
    applied = [r for r in results if r.applied]
    keys = ("loss", "policy_loss", "aux_loss", "clip_fraction", "ratio_mean", "ratio_min",
            "ratio_max", "entropy", "kl")
    m = {}
    for key in keys:
        vals = [float(r.metrics[key]) for r in results if key in r.metrics]
        if vals:
            agg = min if key == "ratio_min" else max if key == "ratio_max" else None
            m[f"train/{key}"] = agg(vals) if agg else sum(vals) / len(vals)
    m["train/grad_norm"] = (sum(r.grad_norm for r in applied) / len(applied)) if applied else float("nan")
    m["train/lr"] = run.optimizer.param_groups[0]["lr"]
    m["train/skipped_updates"] = run.guard.skipped
    # Rollout statistics over every data-parallel rank (context-parallel ranks hold the same).
    rewards = batch.rewards_B.double()
    mask = batch.mask_BS
    mismatch_sum, compared = batch.logprob_mismatch()
    informative = batch.informative_B.double()
    (reward_sum, reward_sq, length_sum, truncated, informative_sum, mismatch, compared_sum,
     tokens, fed, n) = comm.reduce_values(
        [rewards.sum(), (rewards ** 2).sum(), sum(len(s.response_ids) for s in samples),
         sum(s.finish_reason == "length" for s in samples), informative.sum(), mismatch_sum,
         compared, float(mask.sum()), sum(layout.fed_tokens(batch.lengths_B)
                                for per_k in _layouts(run, batch) for layout in per_k),
         len(samples)], device=ctx.device, group=ctx.dp_group)
    mean = reward_sum / n
    m["rollout/reward_mean"] = mean
    m["rollout/reward_std"] = max(reward_sq / n - mean * mean, 0.0) ** 0.5
    m["rollout/response_length"] = length_sum / n
    m["rollout/truncated_fraction"] = truncated / n
    m["rollout/informative_fraction"] = informative_sum / n
    if batch.recomputed_logp_BS is not None:
        m["rollout/logprob_mismatch"] = mismatch / max(compared_sum, 1.0)
    m.update(drift)
    for name, sec in timers.seconds.items():
        m[f"perf/time/{name}_s"] = sec
    m["perf/step_time_s"] = seconds
    m["perf/tokens_per_s"] = tokens / max(seconds, 1e-9)
    m["perf/model_tokens"] = fed
    m["minibatch/ratio_mean"] = [float(r.metrics.get("ratio_mean", float("nan"))) for r in results]
    m["minibatch/clip_fraction"] = [float(r.metrics.get("clip_fraction", float("nan")))
                                    for r in results]
    return m


def _summary(m: dict) -> str:
    parts = [f"reward {m['rollout/reward_mean']:.3f}", f"loss {m.get('train/loss', float('nan')):+.4f}",
             f"clip {m.get('train/clip_fraction', float('nan')):.3f}",
             f"len {m['rollout/response_length']:.1f}", f"{m['perf/step_time_s']:.2f}s/step"]
    if "moe/drift/update/mean" in m:
        parts.append(f"drift {m['moe/drift/update/mean']:.3f}")
    if "eval/accuracy" in m:
        parts.append(f"eval {m['eval/accuracy']:.3f}")
    return "  ".join(parts)


# ---------------------------------------------------------------------------------------------
# Setup, warm-up, checkpoints.
# ---------------------------------------------------------------------------------------------

def _local_layers(run: Run) -> list:
    return local_layers_of(run.job.model, run.ctx)


def setup(job: JobConfig) -> Run:
    # Data and tokenizer first: a bad file ends the job before any process group or model.
    tokenizer = load_tokenizer(job.data.tokenizer)
    if tokenizer.vocab_size > job.model.vocab_size:
        raise ConfigError(f"data.tokenizer={job.data.tokenizer!r}: its {tokenizer.vocab_size} ids "
                          f"do not fit model.vocab_size={job.model.vocab_size}; fix: use the "
                          "model's own tokenizer (the checkpoint's directory)")
    train_data, eval_records = load_data(job)
    ctx = init_parallel(job.parallel, job.model, seed=job.seed)
    job.check_layout(ctx.dp)
    cpu_backend.activate(ctx.device)
    run_dir = os.path.abspath(job.run_dir)
    m = job.model
    routes_needed = m.is_moe and (job.replay.mode != "none" or job.logging.drift)
    gpt = build_model(m, ctx, moe_enable_routing_replay=routes_needed)
    replay = RoutingReplay(gpt) if routes_needed else None
    ddp = wrap_ddp(gpt, ctx)
    engine = make_engine(job, gpt, ctx, replay, tokenizer)
    logger = RunLogger(run_dir, enabled=ctx.rank == 0, tensorboard=job.logging.tensorboard,
                       progress=job.logging.progress, total_steps=job.trainer.steps)
    if job.rollout.engine == "sglang":
        connect_servers(job, engine, ctx, logger.say)
    run = Run(job=job, ctx=ctx, tokenizer=tokenizer, gpt=gpt, ddp=ddp, engine=engine, replay=replay,
              train_data=train_data, eval_records=eval_records,
              scorer=make_scorer(get_reward(job.data.reward), workers=job.data.reward_workers,
                                 timeout_s=job.data.reward_timeout_s),
              logger=logger, ckpt=CheckpointManager(os.path.join(run_dir, "checkpoints"), ctx,
                                                    keep=job.trainer.keep_checkpoints,
                                                    fmt=job.trainer.checkpoint_format),
              guard=NonFiniteGuard(job.trainer.max_consecutive_skips),
              signals=StopSignals().install())
    if routes_needed and job.logging.drift:
        run.drift = DriftProbe(job, ctx, run_dir, logger.writer)
    if job.algo.kl_coef > 0:
        run.ref_model = build_model(m, ctx)
    rl_router_losses(run)
    logger.say(f"layout: {ctx.describe()} ({te.describe(ctx.device.type)}); model {m.name}: "
               f"{m.num_layers} layers, {m.num_experts} experts top-{m.top_k}; algo "
               f"{job.algo.name}, replay {job.replay.mode}, engine {job.rollout.engine}; run dir "
               f"{run_dir}")
    _save_config(job, run_dir, ctx.rank)
    return run


def rl_router_losses(run: Run) -> None:
    """The MoE router losses of the RL updates (``algo.aux_loss_coeff``, ``algo.z_loss_coeff``)."""
    router_losses.set_coefficients(run.gpt.config, aux_loss_coeff=run.job.algo.aux_loss_coeff,
                                   z_loss_coeff=run.job.algo.z_loss_coeff)


def _save_config(job: JobConfig, run_dir: str, rank: int) -> None:
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "resolved_config.json"), "w") as f:
            json.dump(job_to_dict(job), f, indent=1)


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


def make_engine(job: JobConfig, gpt, ctx, replay, tokenizer):
    if job.rollout.engine == "local":
        record = replay if (job.replay.mode == "r3" or job.logging.drift) else None
        # Expert parallelism spans data-parallel ranks, which generate different prompts: the
        # whole world decodes in lockstep then.
        lockstep = torch.distributed.group.WORLD if ctx.ep > 1 and ctx.dp > 1 else None
        return LocalEngine(gpt, ctx, replay=record, pad_id=tokenizer.pad_id,
                           lockstep_group=lockstep)
    r, m = job.rollout, job.model
    moe_layers = [i for i, x in enumerate(m.moe_layer_pattern) if x]
    direct = (ServerLayout(m, tp=r.sglang_gpus_per_server, ep=r.sglang_ep_per_server)
              if r.weight_sync == "tensor" and r.tensor_sync_format == "direct" else None)
    retry = RetryPolicy(timeout_s=r.sglang_control_timeout_s,
                        generate_timeout_s=r.sglang_generate_timeout_s,
                        update_timeout_s=r.sglang_update_timeout_s)
    return SGLangEngine(r.sglang_urls, num_hidden_layers=m.num_layers,
                        top_k=m.top_k, moe_layers=moe_layers, return_routes=r.return_routes,
                        router_url=r.sglang_router_url, rows_per_request=r.sglang_rows_per_request,
                        max_in_flight=r.sglang_max_in_flight, retry=retry,
                        server_tp=r.sglang_gpus_per_server, direct=direct,
                        first_server=ctx.dp_rank)


def connect_servers(job: JobConfig, engine, ctx: ParallelContext, say) -> None:
    """SGLang: every replica's leader waits until each server generates (they load for minutes
    while the trainer starts) and checks that each serves ``rollout.sglang_model_path``; every
    rank agrees on the outcome before the first weight sync."""
    r = job.rollout
    problem, config_problem = None, None
    if ctx.is_replica_leader:
        t0 = time.perf_counter()
        try:
            engine.wait_ready(r.sglang_startup_timeout_s)
            for url, served in engine.model_paths().items():
                if os.path.normpath(served) != os.path.normpath(r.sglang_model_path):
                    config_problem = (f"rollout.sglang_model_path={r.sglang_model_path!r}: the "
                                      f"server at {url} serves {served!r}; fix: start every "
                                      "server from the trainer's checkpoint, or name the one "
                                      "they serve")
                    break
        except SGLangError as e:
            problem = str(e)
        if ctx.rank == 0 and problem is None and config_problem is None:
            say(f"sglang: {len(engine.clients)} server(s) ready after "
                f"{time.perf_counter() - t0:.1f} s, serving {r.sglang_model_path}")
    if comm.any_rank(config_problem is not None, device=ctx.device):
        raise ConfigError(config_problem or "rollout.sglang_model_path: a server serves another "
                          "checkpoint (named in its replica leader's log)")
    if comm.any_rank(problem is not None, device=ctx.device):
        raise SGLangError(problem or "an SGLang server is not ready (named in its replica "
                          "leader's log)")


def sync_address(job: JobConfig) -> str:
    """The address SGLang's servers reach trainer rank 0 at for the weight-update group:
    ``rollout.weight_sync_address``, else the address of this host's interface that routes to
    the first server (a connected UDP socket sends nothing; a host name can resolve to another
    interface, or not at all, on the servers' nodes)."""
    r = job.rollout
    if r.weight_sync_address:
        return r.weight_sync_address
    host = urllib.parse.urlparse(r.sglang_urls[0]).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def build_rl_optimizer(run: Run) -> None:
    t = run.job.trainer
    run.optimizer = build_optimizer(run.ddp, run.ctx, OptimConfig(
        lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad))
    run.scheduler = build_scheduler(run.optimizer, lr=t.lr, min_lr=t.min_lr,
                                    warmup=t.lr_warmup_steps,
                                    total=t.steps * run.job.algo.minibatches, style=t.lr_schedule)


def warm_up(run: Run) -> None:
    """A fresh run: held-out accuracy, the supervised warm-up, accuracy again, checkpoint 0."""
    t = run.job.trainer
    run.logger.truncate_after(-1)  # a fresh run: no rows of an earlier attempt in this directory
    init_weights(run, t.init_from)
    sync_weights(run)  # every evaluation and rollout sees the trainer's weights
    run.history["accuracy_initial"] = evaluate(run)
    run.logger.say(f"held-out accuracy before training: {run.history['accuracy_initial']:.3f} "
                   f"({len(run.eval_records)} prompts)")
    if t.sft_steps:
        sft(run)
        sync_weights(run)
    run.history["accuracy_before_rl"] = evaluate(run)
    run.logger.say(f"held-out accuracy before RL: {run.history['accuracy_before_rl']:.3f}")
    run.logger.log(0, {"eval/accuracy": run.history["accuracy_before_rl"]})
    build_rl_optimizer(run)
    if run.ref_model is not None:  # the reference policy is the model RL starts from
        run.ref_model.load_state_dict(run.gpt.state_dict())
    save(run, 0)


def init_weights(run: Run, path: str) -> None:
    """Starting weights from a HF Qwen3-MoE directory or a weights checkpoint (any layout), or
    random weights drawn per tensor from the seed (the same on every layout)."""
    if not path:
        load_hf_weights(run.gpt, SeededTensors(run.job.model, run.job.seed), run.job.model, run.ctx)
        return
    if os.path.isfile(os.path.join(path, "config.json")):
        load_hf_weights(run.gpt, path, run.job.model, run.ctx)
    else:
        load_weights(run.gpt, path)
    run.logger.say(f"initial weights: {path}")


def sft(run: Run) -> None:
    """Supervised warm-up: next-token loss on the answers of the training prompts (with the
    model's own router load-balancing coefficient)."""
    t, ctx, tok = run.job.trainer, run.ctx, run.tokenizer
    optimizer = build_optimizer(run.ddp, ctx, OptimConfig(lr=t.sft_lr, clip_grad=t.clip_grad))
    router_losses.set_coefficients(run.gpt.config, aux_loss_coeff=run.job.model.aux_loss_coeff,
                                   z_loss_coeff=0.0)
    data = type(run.train_data)([], seed=run.job.seed + 1, records=run.train_data.records)
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
        loss, accuracy = sft_update(run.ddp, optimizer, mbs, ctx, normalizer=tokens,
                                    guard=run.guard, where=f"sft step {i}")
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
    rl_router_losses(run)


def save(run: Run, step: int) -> str:
    state = {"scheduler": run.scheduler.state_dict(), "data": run.train_data.state_dict(),
             "guard": run.guard.state_dict(), "updates": run.updates, "history": run.history,
             "config": job_to_dict(run.job)}
    path = run.ckpt.save(step, model=run.gpt, optimizer=run.optimizer, state=state,
                         before_commit=_kill if run.job.trainer.kill_during_save == step else None)
    if step == 0 and run.ref_model is not None:
        save_weights(run.ref_model, os.path.join(run.job.run_dir, "reference"), run.job.model)
    return path


def _kill() -> None:
    """Fault injection (``trainer.kill_during_save``): die with the shards written, nothing
    committed."""
    os.kill(os.getpid(), signal.SIGKILL)


def resume(run: Run) -> bool:
    """Load the newest complete checkpoint (``trainer.resume``); False for a fresh run."""
    mode = run.job.trainer.resume
    if mode == "never":
        return False
    candidates = run.ckpt.candidates() if mode == "auto" else [os.path.abspath(mode)]
    if not candidates:
        if mode != "auto":
            raise CheckpointError(f"trainer.resume={mode!r}: no such checkpoint")
        return False
    build_rl_optimizer(run)
    path = candidates[0]
    state = run.ckpt.load(path, model=run.gpt, optimizer=run.optimizer)
    run.scheduler.load_state_dict(state["scheduler"])
    run.train_data.load_state_dict(state["data"])
    run.guard.load_state_dict(state["guard"])
    run.updates, run.step = int(state["updates"]), int(state["step"])
    run.history = dict(state.get("history", {}))
    if run.ref_model is not None:
        load_weights(run.ref_model, os.path.join(run.job.run_dir, "reference"))
    run.logger.truncate_after(run.step)
    _clear_requeue_marker(run)
    run.logger.say(f"resumed from {path} (step {run.step}, {run.updates} updates)")
    return True


def export_policy(run: Run) -> str:
    """The trained policy as a Hugging Face directory, ``RUN_DIR/hf`` (bucket by bucket)."""
    job = run.job
    out = os.path.join(job.run_dir, "hf")
    export_hf_dir(run.gpt, job.model, run.ctx, out, hf_config=hf_config_at(job.trainer.init_from),
                  tokenizer=job.data.tokenizer,
                  bucket_bytes=int(job.rollout.weight_sync_bucket_mb * 2**20))
    run.logger.say(f"exported the policy to {out}")
    return out


def stop_for_requeue(run: Run, signame: str, path: str) -> None:
    """The checkpoint for a stop signal is written: leave the requeue marker, give the signal to
    an earlier handler (a launcher's), else exit with the requeue code."""
    if run.ctx.rank == 0:
        with open(os.path.join(run.job.run_dir, REQUEUE_MARKER), "w") as f:
            f.write(f"{signame} {path}\n")
    run.logger.close()
    run.signals.chain()
    raise StopRequested(signame, path)


def _clear_requeue_marker(run: Run) -> None:
    marker = os.path.join(run.job.run_dir, REQUEUE_MARKER)
    if run.ctx.rank == 0 and os.path.exists(marker):
        os.remove(marker)


def report(run: Run) -> None:
    h = run.history
    run.logger.say(f"held-out accuracy: {h.get('accuracy_before_rl', float('nan')):.3f} before RL "
                   f"-> {h['accuracy_after_rl']:.3f} after {run.job.trainer.steps} RL steps")
    if run.drift is not None:
        run.drift.close(run.ctx)
