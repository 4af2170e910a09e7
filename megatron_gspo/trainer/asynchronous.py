"""The trainer's side of asynchronous rollouts (``rollout.mode`` one_step_off / async): the
producer built from the job, each step's batch taken from it and shared with the replica, the
staleness bound checked on every sample, and the metrics of the schedule."""

from __future__ import annotations

import time
from typing import Optional

from megatron_gspo.config import JobConfig
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.rollout.producer import Producer, Schedule, staleness_of
from megatron_gspo.rollout.share import share_samples
from megatron_gspo.rollout.types import RolloutError, SamplingParams
from megatron_gspo.trainer.run import Prompts


def step_seed(run_seed: int, step: int, attempt: int = 0) -> int:
    """The sampling seed of a step's batch (each row's: ``row_seed(step_seed, row)``)."""
    return run_seed * 100_003 + step + attempt * 1_000_003


def sampling_params(job: JobConfig, prompts: Prompts, seed: Optional[int] = None):
    r = job.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                          top_p=r.top_p, top_k=r.top_k,
                          stop_token_ids=(prompts.tokenizer.eos_id,), seed=seed)


def make_producer(job: JobConfig, ctx: ParallelContext, engine, prompts: Prompts
                  ) -> Optional[Producer]:
    """The producer of this rank (``rollout.mode`` one_step_off / async): in a thread on each
    replica's leader for SGLang, inline on every rank for the local engine; None otherwise."""
    r = job.rollout
    if r.mode == "sync" or not (engine.runs_on_every_rank or ctx.is_replica_leader):
        return None
    per_rank = r.prompts_per_step // ctx.dp
    first = ctx.dp_rank * per_rank

    def draw(step: int) -> list:
        batch = prompts.train.next_batch(r.prompts_per_step)  # every leader: the same batch
        mine = batch[first:first + per_rank]
        return [(rec, prompts.tokenizer.render_prompt(rec.prompt, rec.messages),
                 (first + i) * r.group_size) for i, rec in enumerate(mine)]

    threaded = not engine.runs_on_every_rank
    schedule = Schedule(staleness=r.staleness_bound,
                        segment=r.partial_segment_tokens if r.partial else 0,
                        abort_at_sync=r.partial and r.partial_segment_tokens == 0,
                        last_step=job.trainer.steps)
    return Producer(engine, draw=draw, seed_of=lambda step: step_seed(job.seed, step),
                    params=sampling_params(job, prompts), group_size=r.group_size,
                    schedule=schedule, threaded=threaded, wait_s=job.parallel.timeout_s)


def take_batch(job: JobConfig, ctx: ParallelContext, producer: Optional[Producer],
               engine, step: int):
    """The records and samples of ``step`` on every rank of the replica (the leader's producer
    shares them; a failure there ends the step on every rank of the replica), and when the
    trainer took them (the start of the overlap)."""
    if engine.runs_on_every_rank:
        records, samples = producer.batch(step)
        return records, samples, time.monotonic()
    records, samples, error = None, None, None
    if producer is not None:
        try:
            records, samples = producer.batch(step)
        except RolloutError as e:
            error = e
    shared = share_samples(samples if error is None else None, group=ctx.replica_group,
                           device=ctx.device, failed=error is not None and ctx.is_replica_leader)
    if error is not None:
        raise error
    return records if records is not None else [None] * len(shared), shared, time.monotonic()


def check_staleness(job: JobConfig, step: int, samples) -> list[int]:
    """Every sample's staleness (the version step ``step`` trains minus the oldest version of
    its tokens); a sample past ``rollout`` 's bound is a broken schedule, never trained."""
    bound = job.rollout.staleness_bound
    lags = [staleness_of(step, s) for s in samples]
    worst = max(lags, default=0)
    if worst > bound:
        raise RolloutError(f"step {step}: a sample is {worst} policy versions old, past the "
                           f"bound of {bound} (rollout.mode={job.rollout.mode}): the schedule "
                           "is broken")
    return lags


def staleness_metrics(job: JobConfig, ctx: ParallelContext, lags: list[int]) -> dict:
    """The histogram of the batch's staleness over every data-parallel rank's samples (the
    replica's ranks hold the same), its mean and largest value."""
    bound = job.rollout.staleness_bound
    counts = [float(sum(lag == k for lag in lags)) for k in range(bound + 1)]
    totals = comm.reduce_values([*counts, float(sum(lags)), float(len(lags))],
                                device=ctx.device, group=ctx.dp_group)
    largest = comm.reduce_max_int(max(lags, default=0), device=ctx.device, group=ctx.dp_group)
    n = max(totals[-1], 1.0)
    out = {f"rollout/staleness/{k:02d}": totals[k] / n for k in range(bound + 1)}
    out.update({"rollout/staleness_mean": totals[-2] / n, "rollout/staleness_max": largest})
    return out


def overlap_metrics(producer: Optional[Producer], trained_from: float, now: float) -> dict:
    """Generation inside training: the fraction of the trainer's time between taking its batch
    and the weight sync during which a round ran, and the producer's idle seconds there (on the
    replica's leader; rank 0's are logged)."""
    if producer is None or now <= trained_from:
        return {}
    busy = producer.busy_within(trained_from, now)
    return {"perf/overlap_fraction": busy / (now - trained_from),
            "perf/producer_idle_s": (now - trained_from) - busy}
