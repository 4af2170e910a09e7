"""The RL trainer behind ``python -m megatron_gspo``: ``train(job)`` is the loop and
``rl_step`` the algorithm, every phase one call and one timer:

    rollout -> rewards -> group advantages -> behaviour log-probs (R2 records, R3 replays)
    -> K mini-batch updates -> weight sync -> metrics -> checkpoint

``setup`` builds the run's parts (parallel layout, policy, engine, prompts, logging); the phases
live in their own modules: ``generation``, ``batching``, ``behaviour``, ``updates``, ``engine``,
``step_metrics``, ``warmup``, ``checkpoints``, ``evaluation``.
"""

from __future__ import annotations

import time

from megatron_gspo.config import JobConfig
from megatron_gspo.trainer.batching import make_batch, minibatch_layouts
from megatron_gspo.trainer.behaviour import behaviour_logprobs, correct_for_the_engine, step_plan
from megatron_gspo.trainer.checkpoints import (export_policy, report, resume, save,
                                               stop_for_requeue)
from megatron_gspo.trainer.engine import close_engine, sync_weights
from megatron_gspo.trainer.evaluation import evaluate
from megatron_gspo.trainer.generation import sample_batch
from megatron_gspo.trainer.run import Run, Timers
from megatron_gspo.trainer.setup import setup
from megatron_gspo.trainer.step_metrics import progress_line, step_metrics
from megatron_gspo.trainer.updates import update
from megatron_gspo.trainer.warmup import warm_up


def train(job: JobConfig) -> dict:
    """Run (or resume) the job; returns the held-out accuracies and the run's history."""
    run = setup(job)
    try:
        if resume(run):
            sync_weights(run, run.step)  # the engine starts from the trainer's weights
        else:
            warm_up(run)  # held-out accuracy before, SFT, accuracy after SFT, checkpoint 0
        for step in range(run.step + 1, job.trainer.steps + 1):
            metrics = rl_step(run, step)
            if job.trainer.eval_interval and step % job.trainer.eval_interval == 0:
                metrics["eval/accuracy"] = evaluate(run)
            run.logger.log(step, metrics)  # before the checkpoint: a resume never lacks this row
            run.logger.bar(step, progress_line(metrics), keep="eval/accuracy" in metrics)
            stop = run.signals.agreed(run.ctx.device)
            if stop or step == job.trainer.steps or (
                    job.trainer.save_interval and step % job.trainer.save_interval == 0):
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
        close_engine(run)
        run.signals.uninstall()
        run.prompts.scorer.close()
        run.logger.close()


def rl_step(run: Run, step: int) -> dict:
    """One rollout batch and its K policy updates; returns the step's metrics."""
    timers, t0 = Timers(), time.perf_counter()
    samples, rewards, sampling = sample_batch(run, step, timers)  # rollout and reward phases
    batch, overlong = make_batch(run.job, run.ctx, samples, rewards,
                                 pad_id=run.prompts.tokenizer.pad_id)
    plan = step_plan(run, batch)
    with timers("old_logprobs"):
        routes = behaviour_logprobs(run, batch, plan)
    with timers("update"):
        correction = correct_for_the_engine(run.job.algo, run.ctx, batch)
        results, drift = update(run, batch, plan, routes)
    with timers("weight_sync"):
        overlap = sync_weights(run, step)
    run.step = step
    return step_metrics(run.ctx, run.policy, batch, samples, minibatch_layouts(run.job, batch),
                        results, {**drift, **correction, **sampling, **overlong, **overlap},
                        timers, time.perf_counter() - t0)
