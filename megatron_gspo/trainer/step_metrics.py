"""The step's metrics: the updates' statistics, the rollout's over every data-parallel rank (one
collective of named sums), wall times. Tags: docs/reference/metrics.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_gspo.batch.rollout_batch import RolloutBatch
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.trainer.run import Policy, Timers


@dataclass
class RolloutSums:
    """This rank's sums of the step's rollout statistics, summed over the data-parallel ranks
    (context-parallel ranks hold the same) in one collective."""

    rewards: float
    rewards_sq: float
    response_tokens: float  # generated tokens
    truncated: float  # responses cut at max_new_tokens
    informative: float  # responses whose group's rewards differ
    mismatch: float  # |engine - trainer| log-probs where the trainer has them
    compared: float  # response tokens in that sum
    trained_tokens: float  # response tokens the updates train on
    fed_tokens: float  # tokens one pass over the batch feeds
    responses: float

    def over_data_parallel(self, ctx: ParallelContext) -> "RolloutSums":
        values = comm.reduce_values(dataclasses.astuple(self), device=ctx.device,
                                    group=ctx.dp_group)
        return RolloutSums(*values)


def rollout_sums(batch: RolloutBatch, samples, layouts) -> RolloutSums:
    rewards = batch.rewards_B.double()
    mismatch, compared = batch.logprob_mismatch()
    return RolloutSums(
        rewards=rewards.sum(), rewards_sq=(rewards ** 2).sum(),
        response_tokens=sum(len(s.response_ids) for s in samples),
        truncated=sum(s.finish_reason == "length" for s in samples),
        informative=batch.informative_B.double().sum(), mismatch=mismatch, compared=compared,
        trained_tokens=float(batch.mask_BS.sum()),
        fed_tokens=sum(layout.fed_tokens(batch.lengths_B) for per_k in layouts
                       for layout in per_k),
        responses=len(samples))


def step_metrics(ctx: ParallelContext, policy: Policy, batch: RolloutBatch, samples, layouts,
                 results, extra: dict, timers: Timers, seconds: float) -> dict:
    """The step's scalars (the tags of docs/reference/metrics.md); ``layouts``: each
    mini-batch's micro-batch layouts; ``extra``: the phases' own metrics."""
    applied = [r for r in results if r.applied]
    keys = ("loss", "policy_loss", "aux_loss", "clip_fraction", "ratio_mean", "ratio_min",
            "ratio_max", "entropy", "kl")
    m = {}
    for key in keys:
        vals = [float(r.metrics[key]) for r in results if key in r.metrics]
        if vals:
            agg = min if key == "ratio_min" else max if key == "ratio_max" else None
            m[f"train/{key}"] = agg(vals) if agg else sum(vals) / len(vals)
    m["train/grad_norm"] = (sum(r.grad_norm for r in applied) / len(applied) if applied
                            else float("nan"))
    m["train/lr"] = policy.optimizer.param_groups[0]["lr"]
    m["train/skipped_updates"] = policy.guard.skipped
    s = rollout_sums(batch, samples, layouts).over_data_parallel(ctx)
    n = s.responses
    mean = s.rewards / n
    m["rollout/reward_mean"] = mean
    m["rollout/reward_std"] = max(s.rewards_sq / n - mean * mean, 0.0) ** 0.5
    m["rollout/response_length"] = s.response_tokens / n
    m["rollout/truncated_fraction"] = s.truncated / n
    m["rollout/informative_fraction"] = s.informative / n
    if batch.trainer_logp_BS is not None:
        m["rollout/logprob_mismatch"] = s.mismatch / max(s.compared, 1.0)
    m.update(extra)
    for name, sec in timers.seconds.items():
        m[f"perf/time/{name}_s"] = sec
    m["perf/step_time_s"] = seconds
    m["perf/tokens_per_s"] = s.trained_tokens / max(seconds, 1e-9)
    m["perf/model_tokens"] = s.fed_tokens
    m["minibatch/ratio_mean"] = [float(r.metrics.get("ratio_mean", float("nan"))) for r in results]
    m["minibatch/clip_fraction"] = [float(r.metrics.get("clip_fraction", float("nan")))
                                    for r in results]
    return m


def progress_line(m: dict) -> str:
    """The console's line of a step."""
    parts = [f"reward {m['rollout/reward_mean']:.3f}",
             f"loss {m.get('train/loss', float('nan')):+.4f}",
             f"clip {m.get('train/clip_fraction', float('nan')):.3f}",
             f"len {m['rollout/response_length']:.1f}", f"{m['perf/step_time_s']:.2f}s/step"]
    if "moe/drift/update/mean" in m:
        parts.append(f"drift {m['moe/drift/update/mean']:.3f}")
    if "eval/accuracy" in m:
        parts.append(f"eval {m['eval/accuracy']:.3f}")
    return "  ".join(parts)
