"""Policy losses: GSPO, GSPO-token and GRPO, as pure functions registered by name.

Legend: ``N`` tokens held here, ``S`` sequences, ``K`` per-sequence statistics, ``B``/``T`` rows and
tokens of a padded batch.

Every loss works on a ``TokenShard`` (tokens tagged with their sequence) and goes through the same
steps, whatever the batch layout (padded, packed, context-parallel chunks, micro-batches):

1. per-token rows -> per-sequence sums ``[K, S]`` (``sequence_sums``);
2. one all-reduce of that table over the context-parallel group (``SequenceReducer.sum``);
3. optionally, totals from a pre-pass over other micro-batches replace the values while the
   gradient stays local (for sequences split across micro-batches);
4. a per-sequence loss, aggregated over sequences (or tokens), plus optional KL (k3) and entropy.

``policy_loss`` is the dense [B, T] entry point; ``shard_policy_loss`` the general one. Both return
``(loss, metrics)`` with metrics as detached tensors (no host syncs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_gspo.algorithms.correction import weighted_advantages
from megatron_gspo.distributed.seqshard import SequenceReducer, TokenShard, sequence_sums


# Paper defaults (GSPO, arXiv 2507.18071): GSPO clips at (3e-4, 4e-4), the GRPO baseline at (0.2, 0.27).
DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}

# Rows of the per-sequence statistics table.
LOGRATIO, COUNT, KL, ENTROPY, ALGO = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class LossOptions:
    clip_low: float
    clip_high: float
    aggregation: str = "seq_mean"  # seq_mean: token mean per sequence, then mean over sequences
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    normalizer: Optional[float] = None  # global count of sequences (seq_mean) or tokens (token_mean)
    allow_objective_change: bool = False


_COMMON = {"aggregation", "kl_coef", "entropy_coef", "normalizer", "allow_objective_change"}
_VALID_OPTIONS = {"gspo": _COMMON, "gspo_token": _COMMON, "grpo": _COMMON | {"dual_clip"}}

LOSSES: dict[str, Callable] = {}


def register_loss(name: str):
    def wrap(fn):
        LOSSES[name] = fn
        return fn
    return wrap


def _options(algo: str, clip_low, clip_high, options: dict) -> LossOptions:
    if algo not in LOSSES:
        raise ValueError(f"unknown algo {algo!r}; valid: {', '.join(sorted(LOSSES))}")
    unknown = set(options) - _VALID_OPTIONS[algo]
    if unknown:
        raise ValueError(f"{algo}: unknown option(s) {', '.join(sorted(unknown))}; valid: "
                         f"{', '.join(sorted(_VALID_OPTIONS[algo]))}")
    low, high = DEFAULT_CLIP[algo]
    opts = LossOptions(clip_low=low if clip_low is None else float(clip_low),
                       clip_high=high if clip_high is None else float(clip_high), **options)
    if opts.clip_low < 0 or opts.clip_high < 0 or opts.clip_low >= 1:
        raise ValueError(f"{algo}: clip_low={opts.clip_low}, clip_high={opts.clip_high}: need "
                         "0 <= clip_low < 1 and clip_high >= 0")
    if opts.aggregation not in ("seq_mean", "token_mean"):
        raise ValueError(f"{algo}: aggregation={opts.aggregation!r}; valid: seq_mean, token_mean")
    if algo != "grpo" and opts.aggregation != "seq_mean" and not opts.allow_objective_change:
        raise ValueError(f"{algo}: aggregation={opts.aggregation!r} length-weights sequences and "
                         "changes GSPO's objective; pass allow_objective_change=True to use it anyway")
    if opts.dual_clip is not None and opts.dual_clip <= 1.0:
        raise ValueError(f"grpo: dual_clip={opts.dual_clip} must be > 1")
    return opts


def validate_options(algo: str, clip_low=None, clip_high=None, options: Optional[dict] = None
                     ) -> LossOptions:
    """The loss options ``shard_policy_loss`` would use; raises ValueError naming a bad one."""
    return _options(algo, clip_low, clip_high, options or {})


def _k3(logp_N, ref_logp_N):
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp_N - logp_N
    return torch.exp(d) - d - 1.0


def _complete(rows_KN, shard: TokenShard, reducer: SequenceReducer, totals_KS):
    """Per-sequence sums over all shards; with ``totals``, values become the totals (no gradient
    through the difference) and a weight says how much of each sequence this micro-batch holds."""
    stats = reducer.sum(sequence_sums(rows_KN, shard.seq_N, shard.num_seqs))
    present = stats[COUNT].detach()
    if totals_KS is None:
        return stats, (present > 0).to(stats.dtype)
    stats = stats + (totals_KS.to(stats.dtype) - stats.detach())
    weight = torch.where(stats[COUNT] > 0, present / stats[COUNT].clamp_min(1), 0.0)
    return stats, weight.detach()


def _clip(ratio, adv, opts: LossOptions):
    """Clipped-surrogate loss per element and whether the clip (no gradient) applies."""
    low, high = 1.0 - opts.clip_low, 1.0 + opts.clip_high
    clipped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    bounded = torch.clamp(ratio, low, high).detach()
    loss = -adv * torch.where(clipped, bounded, ratio)
    if opts.dual_clip is not None:  # with A < 0 the loss is capped at -c * A
        dual = (adv < 0) & (ratio > opts.dual_clip)
        loss = torch.where(dual, -opts.dual_clip * adv, loss)
        clipped = clipped | dual
    return loss, clipped


def _token_rows(shard: TokenShard, opts: LossOptions, extra: list):
    m = shard.mask_N
    zero = torch.zeros_like(m)
    # Reported whenever given (the coefficients decide whether they enter the loss).
    kl = _k3(shard.logp_N, shard.ref_logp_N) * m if shard.ref_logp_N is not None else zero
    ent = shard.entropy_N * m if shard.entropy_N is not None else zero
    return torch.stack([m * (shard.logp_N - shard.old_logp_N), m, kl, ent, *extra])


def _finish(per_seq_S, stats, weight, opts: LossOptions, metrics: dict):
    """Aggregate per-sequence sums (already token-summed) into the loss and add KL / entropy."""
    count = stats[COUNT]
    valid = (count > 0).to(count.dtype)
    n = count.clamp_min(1)
    terms = per_seq_S + opts.kl_coef * stats[KL] - opts.entropy_coef * stats[ENTROPY]
    if opts.aggregation == "seq_mean":
        value_S = terms / n * valid
        default_norm = (weight * valid).sum()
    else:
        value_S = terms
        default_norm = (weight * count).sum()
    norm = default_norm if opts.normalizer is None else count.new_tensor(opts.normalizer)
    norm = torch.clamp(norm.to(count.dtype), min=1.0)
    contrib_S = weight * value_S.detach() + (value_S - value_S.detach())
    loss = contrib_S.sum() / norm
    tokens = (weight * count).sum().clamp_min(1)
    metrics.update(
        loss=loss.detach(),
        kl=(weight * stats[KL]).sum().detach() / tokens,
        entropy=(weight * stats[ENTROPY]).sum().detach() / tokens,
        num_seqs=(weight * valid).sum().detach(),
        num_tokens=(weight * count).sum().detach())
    return loss, metrics


def _ratio_metrics(ratio, keep, weight_or_mask, reducer: SequenceReducer, over_shards: bool):
    """Mean, min and max of ``ratio`` over the kept elements (min/max reduced across shards when
    the elements are local tokens; sequence values are already complete)."""
    w = weight_or_mask * keep
    total = w.sum()
    mean = (w * ratio).sum() / total.clamp_min(1e-12)
    big = torch.finfo(ratio.dtype).max
    hi = torch.where(keep, ratio, -big).max() if ratio.numel() else ratio.new_tensor(-big)
    lo = torch.where(keep, ratio, big).min() if ratio.numel() else ratio.new_tensor(big)
    if over_shards:
        hi, neg_lo = reducer.max(torch.stack([hi.detach(), -lo.detach()]))
        lo = -neg_lo
    any_kept = lo <= hi
    return {"ratio_mean": mean.detach(),
            "ratio_min": torch.where(any_kept, lo, 1.0).detach(),
            "ratio_max": torch.where(any_kept, hi, 1.0).detach()}


@register_loss("gspo")
def gspo_loss(shard: TokenShard, reducer: SequenceReducer, totals, opts: LossOptions):
    """J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t (logp - old_logp)) (the paper)."""
    if shard.advantages_S is None:
        raise ValueError("gspo: advantages must be one per sequence ([B]); use gspo_token for "
                         "per-token advantages")
    stats, weight = _complete(_token_rows(shard, opts, []), shard, reducer, totals)
    count = stats[COUNT]
    valid = count > 0
    s = torch.exp(stats[LOGRATIO] / count.clamp_min(1))
    loss_S, clipped = _clip(s, shard.advantages_S.to(s.dtype), opts)
    per_seq = torch.where(valid, loss_S * count, 0.0)  # _finish divides by the count again
    metrics = {"clip_fraction": ((clipped & valid) * weight).sum().detach()
               / (valid * weight).sum().clamp_min(1e-12)}
    metrics.update(_ratio_metrics(s, valid & (weight > 0), weight, reducer, over_shards=False))
    return _finish(per_seq, stats, weight, opts, metrics)


@register_loss("gspo_token")
def gspo_token_loss(shard: TokenShard, reducer: SequenceReducer, totals, opts: LossOptions):
    """s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]: GSPO's value, per-token advantages allowed."""
    adv_N = shard.token_advantages().to(shard.logp_N.dtype)
    m = shard.mask_N
    pos, neg = (adv_N > 0).to(m.dtype) * m, (adv_N < 0).to(m.dtype) * m
    rows = _token_rows(shard, opts, [adv_N.clamp_min(0) * m, adv_N.clamp_max(0) * m, pos, neg])
    stats, weight = _complete(rows, shard, reducer, totals)
    count = stats[COUNT]
    valid = count > 0
    s = torch.exp(stats[LOGRATIO] / count.clamp_min(1)).detach()
    low, high = 1.0 - opts.clip_low, 1.0 + opts.clip_high
    clip_pos, clip_neg = s > high, s < low  # clipped tokens: A > 0 above, A < 0 below the range
    bounded = torch.clamp(s, low, high)
    # Value per sequence: sum over tokens of -A_t * (s or its bound), from the completed sums.
    value_S = -(torch.where(clip_pos, bounded, s) * stats[ALGO]
                + torch.where(clip_neg, bounded, s) * stats[ALGO + 1])
    # Gradient: -A_t * s_i * dlogp_t on unclipped tokens, local to this shard.
    s_N = s[shard.seq_N]
    open_N = ~(((adv_N > 0) & clip_pos[shard.seq_N]) | ((adv_N < 0) & clip_neg[shard.seq_N]))
    surrogate_N = -adv_N * s_N * (shard.logp_N - shard.logp_N.detach()) * m * open_N
    grad_S = sequence_sums(surrogate_N[None], shard.seq_N, shard.num_seqs)[0]
    per_seq = value_S.detach() + grad_S
    n_clipped = clip_pos * stats[ALGO + 2] + clip_neg * stats[ALGO + 3]
    metrics = {"clip_fraction": (weight * n_clipped).sum().detach()
               / (weight * count).sum().clamp_min(1e-12)}
    metrics.update(_ratio_metrics(s, valid & (weight > 0), weight * count, reducer,
                                  over_shards=False))
    return _finish(per_seq, stats, weight, opts, metrics)


@register_loss("grpo")
def grpo_loss(shard: TokenShard, reducer: SequenceReducer, totals, opts: LossOptions):
    """Token ratio w_t, asymmetric clip (optional dual clip); token mean per sequence, then mean
    over sequences (the paper), or ``aggregation='token_mean'`` over the batch (DAPO)."""
    adv_N = shard.token_advantages().to(shard.logp_N.dtype)
    m = shard.mask_N
    w = torch.exp(shard.logp_N - shard.old_logp_N)
    loss_N, clipped_N = _clip(w, adv_N, opts)
    rows = _token_rows(shard, opts, [loss_N * m, clipped_N.to(m.dtype) * m, w.detach() * m])
    stats, weight = _complete(rows, shard, reducer, totals)
    count = stats[COUNT]
    tokens = (weight * count).sum().clamp_min(1e-12)
    metrics = {"clip_fraction": (weight * stats[ALGO + 1]).sum().detach() / tokens}
    ratio = _ratio_metrics(w.detach(), m > 0, m, reducer, over_shards=True)
    ratio["ratio_mean"] = (weight * stats[ALGO + 2]).sum().detach() / tokens
    metrics.update(ratio)
    return _finish(stats[ALGO], stats, weight, opts, metrics)


def shard_policy_loss(algo: str, shard: TokenShard, *, reducer: Optional[SequenceReducer] = None,
                      totals: Optional[torch.Tensor] = None, clip_low=None, clip_high=None,
                      **options):
    """Loss of the tokens in ``shard``; ``reducer`` completes sequences split over CP ranks,
    ``totals`` (from ``sequence_totals`` over all micro-batches) those split over micro-batches."""
    opts = _options(algo, clip_low, clip_high, options)
    if opts.kl_coef and shard.ref_logp_N is None:
        raise ValueError(f"{algo}: kl_coef={opts.kl_coef} needs ref_logprobs")
    if opts.entropy_coef and shard.entropy_N is None:
        raise ValueError(f"{algo}: entropy_coef={opts.entropy_coef} needs entropy")
    return LOSSES[algo](shard, reducer or SequenceReducer(), totals, opts)


def sequence_totals(algo: str, shards: list[TokenShard], *, reducer=None, clip_low=None,
                    clip_high=None, **options) -> torch.Tensor:
    """[K, S] statistics of whole sequences from every micro-batch's shard (no gradient): run the
    shards forward-only, then pass the result as ``totals`` to each micro-batch's loss."""
    captured = []

    class _Capture(SequenceReducer):
        def sum(self, stats_KS):
            out = (reducer or SequenceReducer()).sum(stats_KS)
            captured.append(out.detach())
            return out

    total = None
    with torch.no_grad():
        for shard in shards:
            captured.clear()
            shard_policy_loss(algo, shard, reducer=_Capture(), clip_low=clip_low,
                              clip_high=clip_high, **options)
            total = captured[0] if total is None else total + captured[0]
    return total


# Metrics averaged over sequences (the rest of the averages are over response tokens).
_SEQUENCE_LEVEL = {"gspo": {"clip_fraction", "ratio_mean"}, "gspo_token": set(), "grpo": set()}


def metric_kind(algo: str, key: str) -> str:
    """How a loss metric combines over micro-batches and ranks: ``sum`` (the loss is the sum of
    shares; counts), ``min`` / ``max`` (ratio extremes), or the name of the count that weights
    its mean (``num_seqs`` or ``num_tokens``)."""
    if key in ("loss", "num_seqs", "num_tokens"):
        return "sum"
    if key in ("ratio_min", "ratio_max"):
        return key[-3:]
    return "num_seqs" if key in _SEQUENCE_LEVEL[algo] else "num_tokens"


def combine_metrics(algo: str, parts: list[dict]) -> dict:
    """A batch's metrics from its micro-batches': sums for the loss (each micro-batch returns its
    share) and counts, min / max for the ratio extremes, weighted means for the rest."""
    out = {}
    for key in parts[0]:
        values = torch.stack([p[key] for p in parts])
        kind = metric_kind(algo, key)
        if kind == "sum":
            out[key] = values.sum()
        elif kind == "min":
            out[key] = values.min()
        elif kind == "max":
            out[key] = values.max()
        else:
            weight = torch.stack([p[kind] for p in parts])
            out[key] = (weight * values).sum() / weight.sum().clamp_min(1e-12)
    return out


def policy_loss(algo: str, logprobs, old_logprobs, advantages, mask, *, clip_low=None,
                clip_high=None, ref_logprobs=None, entropy=None,
                reducer: Optional[SequenceReducer] = None, weights=None, **options):
    """Loss for a padded batch: logprobs, old_logprobs, mask [B, T] (mask 1 on response tokens),
    advantages [B] (or [B, T] for gspo_token / grpo). Under context parallelism T is this rank's
    share of every row and ``reducer`` completes the rows' sums over the group. ``weights`` [B, T]
    (``correction.rollout_weights``) multiply the per-token policy terms (gspo_token, grpo) or
    each sequence's term (gspo: one weight per sequence). Returns ``(loss, metrics)``."""
    if weights is not None:
        advantages = weighted_advantages(algo, advantages, weights, mask)
    shard = TokenShard.from_dense(logprobs, old_logprobs, advantages, mask, ref_logp_BT=ref_logprobs,
                                  entropy_BT=entropy)
    return shard_policy_loss(algo, shard, reducer=reducer, clip_low=clip_low, clip_high=clip_high,
                             **options)
