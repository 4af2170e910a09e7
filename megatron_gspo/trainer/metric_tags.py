"""Every metric the trainer logs (TensorBoard scalars; the rows of ``metrics.jsonl``), with what it
means: the one list that docs/reference/metrics.md is generated from and that the end-to-end
tests hold a run's tags against. ``{name}`` in a tag stands for a family: ``{phase}`` (rollout,
reward, old_logprobs, update, weight_sync, checkpoint), ``{kind}`` (update, rollout_train),
``{layer}`` (an MoE layer, two digits), ``{k}`` (a number of MoE layers, two digits)."""

from __future__ import annotations

import re

TAGS: tuple[tuple[str, str], ...] = (
    # the policy updates
    ("train/loss", "the loss of the step's updates (policy + router aux), mean over its "
                   "mini-batches"),
    ("train/policy_loss", "the policy objective's part of train/loss"),
    ("train/aux_loss", "the MoE routers' load-balancing and z-losses times their coefficients "
                       "(algo.aux_loss_coeff, algo.z_loss_coeff)"),
    ("train/clip_fraction", "clipped ratios: of sequences for GSPO, of tokens for GRPO and "
                            "GSPO-token; mean over the mini-batches"),
    ("train/ratio_mean", "mean importance ratio (sequence ratio for GSPO)"),
    ("train/ratio_min", "smallest ratio of the step"),
    ("train/ratio_max", "largest ratio of the step"),
    ("train/entropy", "mean entropy of the policy over response tokens"),
    ("train/kl", "k3 estimate of KL(policy || reference) (algo.kl_coef > 0)"),
    ("train/grad_norm", "mean gradient norm of the step's applied updates"),
    ("train/lr", "learning rate"),
    ("train/skipped_updates", "non-finite updates skipped so far"),
    ("train/rollout_correction/mean_weight", "algo.rollout_correction: mean importance weight "
                                             "of the old policy over the engine's sampling"),
    ("train/rollout_correction/masked_fraction", "algo.rollout_correction: the fraction of "
                                                 "sequences weighted 0"),
    ("minibatch/ratio_mean", "metrics.jsonl only: each mini-batch's mean ratio (a list)"),
    ("minibatch/clip_fraction", "metrics.jsonl only: each mini-batch's clip fraction (a list)"),
    # the rollout
    ("rollout/reward_mean", "mean reward of the step's responses"),
    ("rollout/reward_std", "their standard deviation"),
    ("rollout/response_length", "mean response tokens"),
    ("rollout/truncated_fraction", "responses cut at rollout.max_new_tokens"),
    ("rollout/informative_fraction", "responses whose group has differing rewards (a non-zero "
                                     "advantage)"),
    ("rollout/logprob_mismatch", "mean |engine - trainer| log-prob over the response tokens the "
                                 "trainer computed on the old policy (not logged where it "
                                 "computed none)"),
    ("rollout/reward_failures", "rewards that raised or timed out (scored 0)"),
    ("rollout/sampling_rounds", "rollout.dynamic_sampling: rounds of fresh prompts"),
    ("rollout/dropped_groups", "rollout.dynamic_sampling: groups of equal rewards dropped"),
    ("rollout/overlong_masked", "rollout.overlong=mask: the fraction of responses masked for "
                                "being cut"),
    ("rollout/overlong_penalty", "rollout.overlong=soft_penalty: the mean penalty"),
    ("rollout/staleness/{k}", "rollout.mode one_step_off / async: the fraction of the batch's "
                              "responses whose oldest token is k policy versions older than "
                              "the policy the step trains (k up to the staleness bound)"),
    ("rollout/staleness_mean", "rollout.mode one_step_off / async: the mean of that lag"),
    ("rollout/staleness_max", "rollout.mode one_step_off / async: its largest value"),
    # evaluation and the warm-up
    ("eval/accuracy", "held-out accuracy (greedy), at trainer.eval_interval and at the end"),
    ("sft/loss", "the supervised warm-up's loss"),
    ("sft/accuracy", "the warm-up batch's accuracy"),
    # time
    ("perf/step_time_s", "wall time of the RL step"),
    ("perf/tokens_per_s", "trained (response) tokens per second of the step"),
    ("perf/model_tokens", "tokens one pass over the batch feeds (prompt and response but the "
                          "last token, no padding, a shared prompt once): update FLOPs = 6 x "
                          "active parameters x this"),
    ("perf/overlap_fraction", "asynchronous rollouts: the fraction of the trainer's time from "
                              "taking its batch to the weight sync during which the producer "
                              "generated (replica 0's leader; 0 with the local engine)"),
    ("perf/producer_idle_s", "asynchronous rollouts: the seconds of that time the producer "
                             "waited"),
    ("perf/time/{phase}_s", "wall time of a phase (checkpoint: TensorBoard only, the step's "
                            "row is written before its checkpoint)"),
    # expert drift (logging.drift; moe.instrument)
    ("moe/drift/{kind}/mean", "fraction of (token, layer) pairs whose top-k expert set changed: "
                              "after the first update (update), or between the engine's routes "
                              "and the trainer's forward of the same tokens (rollout_train)"),
    ("moe/drift/{kind}/layer_{layer}", "the same for one MoE layer"),
    ("moe/drift/{kind}/jaccard_mean", "mean Jaccard overlap of the top-k sets"),
    ("moe/drift/{kind}/tokens_changed", "fraction of tokens with any layer changed"),
    ("moe/drift/ratio_noise/changed", "mean |log ratio| after the first update of response "
                                      "tokens whose routes changed in some layer"),
    ("moe/drift/ratio_noise/unchanged", "the same of the tokens whose routes did not change"),
    ("moe/drift/ratio_noise/quotient", "changed / unchanged"),
    ("moe/drift/ratio_noise/changed_tokens", "fraction of the probed tokens whose routes "
                                             "changed"),
    ("moe/drift/ratio_noise/by_changed_layers_{k}", "mean |log ratio| of the tokens whose "
                                                    "routes changed in exactly k layers"),
    ("moe/load/max_share", "the largest share of the probed tokens any expert took"),
    ("moe/load/entropy/layer_{layer}", "entropy of the expert load of one MoE layer"),
    ("moe/load/imbalance/layer_{layer}", "max / mean expert share of one MoE layer"),
)


def _pattern(tag: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"\\\{[a-z_]+\\\}", "[A-Za-z0-9_]+", re.escape(tag)) + "$")


_PATTERNS = [_pattern(tag) for tag, _ in TAGS]


def known(tag: str) -> bool:
    """Whether ``tag`` is one of ``TAGS`` (or of a family of them)."""
    return any(p.match(tag) for p in _PATTERNS)
