"""The rollout and reward phases: the step's prompts, their responses from the engine, their
rewards; with dynamic sampling, rounds of fresh prompts until every group's rewards differ."""

from __future__ import annotations

import torch

from megatron_gspo.algorithms.advantages import informative_groups, select_groups
from megatron_gspo.config import JobConfig
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.rewards.scoring import score_samples
from megatron_gspo.rollout.share import share_samples
from megatron_gspo.rollout.types import SamplingParams
from megatron_gspo.trainer.run import Engine, Prompts, Run, Timers


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
            records, samples = rollout(run.job, ctx, run.prompts, run.engine, step, attempt)
        with timers("reward"):
            rewards, failed = score(run.prompts, ctx, records, samples)
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
    metrics = reward_failures(ctx, failures)
    if r.dynamic_sampling:
        lead = ctx.is_replica_leader
        dropped = comm.reduce_sum(sampled - len(kept) if lead else 0, device=ctx.device)
        metrics.update({"rollout/sampling_rounds": attempt + 1, "rollout/dropped_groups": dropped})
    samples = [s for group, _ in kept for s in group]
    return samples, torch.cat([rw for _, rw in kept]), metrics


def rollout(job: JobConfig, ctx: ParallelContext, prompts: Prompts, engine: Engine, step: int,
            attempt: int = 0):
    """This data-parallel rank's prompts of the step and their responses (``attempt``: the round
    of dynamic sampling, with fresh prompts and seeds). The local engine runs on every rank of
    the replica (its model is sharded over them); an SGLang request goes out from the replica's
    leader only, and the responses reach the other ranks by broadcast."""
    r = job.rollout
    batch = prompts.train.next_batch(r.prompts_per_step)  # the same global batch on every rank
    per_rank = r.prompts_per_step // ctx.dp
    mine = batch[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
    tok = prompts.tokenizer
    ids = [tok.render_prompt(p.prompt, p.messages) for p in mine]
    params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, top_k=r.top_k, stop_token_ids=(tok.eos_id,),
                            seed=job.seed * 100_003 + step + attempt * 1_000_003)
    samples = generate(engine, ctx, ids, r.group_size, params,
                       first_row=ctx.dp_rank * per_rank * r.group_size)
    return [mine[s.prompt_index] for s in samples], samples


def generate(engine: Engine, ctx: ParallelContext, ids, samples_per_prompt: int,
             params: SamplingParams, *, first_row: int = 0) -> list:
    """Responses on every rank of the replica: the engine's own where it runs on every rank
    (the local engine), else its leader's, broadcast to the others."""
    if engine.runs_on_every_rank:
        return engine.generate(ids, samples_per_prompt, params, first_row=first_row)
    samples = (engine.generate(ids, samples_per_prompt, params, first_row=first_row)
               if ctx.is_replica_leader else None)
    return share_samples(samples, group=ctx.replica_group, device=ctx.device)


def score(prompts: Prompts, ctx: ParallelContext, records, samples) -> tuple[torch.Tensor, int]:
    """Rewards, scored once per replica (by its leader) and broadcast to its other ranks; and how
    many rewards raised or timed out (scored 0; on the leader)."""
    return score_samples(records, samples, decode=prompts.tokenizer.decode,
                         scorer=prompts.scorer, ctx=ctx)


def reward_failures(ctx: ParallelContext, failures: int) -> dict:
    """``rollout/reward_failures``: rewards of the step that raised or timed out, every replica's
    (counted on its leader)."""
    total = comm.reduce_sum(failures if ctx.is_replica_leader else 0, device=ctx.device)
    return {"rollout/reward_failures": total}
