"""Rollout correction: importance weights for the mismatch between the engine that sampled the
responses and the trainer's old policy (pure functions).

With an external engine (SGLang) the sampling distribution is not exactly the trainer's: other
kernels, other precision and, on MoE models, other routing. ``rollout_weights`` turns the two
log-probs of every response token into weights that ``losses.policy_loss(..., weights=W)`` applies
to the policy-gradient terms (truncated importance sampling, TIS, per token or per sequence;
masked importance sampling, MIS, that drops sequences whose ratio leaves a band). The
``decoupled`` mode is the off-policy correction of asynchronous rollouts: the loss's ratio is
taken against the proximal policy (the trainer's old-policy pass) and each term is weighed by
the truncated and masked ratio of that policy over the behaviour policy that sampled it.

Legend: ``B`` rows, ``T`` tokens per row.
"""

from __future__ import annotations

import torch


MODES = ("none", "token_tis", "seq_tis", "seq_mis", "decoupled")
# one weight per sequence: what GSPO can take (decoupled: per sequence for GSPO)
SEQUENCE_MODES = ("none", "seq_tis", "seq_mis", "decoupled")


def rollout_weights(old_logp, engine_logp, mask, *, mode: str, cap: float = 2.0,
                    low: float = 0.5, high: float = 2.0, per_token: bool = False):
    """Weights [B, T] (detached, 0 where ``mask`` is 0) and metrics for ``mode``:

    - ``none``: 1 on response tokens;
    - ``token_tis``: min(exp(old - engine), cap) per token;
    - ``seq_tis``: min(exp(mean_t(old - engine)), cap) over the sequence's response tokens, on
      every response token of it;
    - ``seq_mis``: 1 where low <= exp(mean_t(old - engine)) <= high, else 0;
    - ``decoupled``: g = exp(mean_t(old - engine)) per sequence (``per_token``: exp(old - engine)
      per token), weight min(g, cap) where low <= g <= high, else 0.

    Metrics (tensors): ``mean_weight`` over response tokens, ``masked_fraction`` of the sequences
    with response tokens whose weight is 0."""
    if mode not in MODES:
        raise ValueError(f"rollout correction mode {mode!r}; valid: {', '.join(MODES)}")
    mask = mask.to(old_logp.dtype)
    diff = (old_logp.detach() - engine_logp.detach().to(old_logp.dtype)) * mask
    tokens = mask.sum(-1)
    has = tokens > 0
    if mode == "none":
        weights = mask.clone()
    elif mode == "token_tis":
        weights = torch.clamp(torch.exp(diff), max=cap) * mask
    elif mode == "decoupled" and per_token:
        weights = _truncated_in_band(torch.exp(diff), cap, low, high) * mask
    else:
        seq_ratio = torch.exp(diff.sum(-1) / tokens.clamp_min(1))
        if mode == "seq_tis":
            seq_w = torch.clamp(seq_ratio, max=cap)
        elif mode == "decoupled":
            seq_w = _truncated_in_band(seq_ratio, cap, low, high)
        else:
            seq_w = ((seq_ratio >= low) & (seq_ratio <= high)).to(mask.dtype)
        weights = seq_w[:, None] * mask
    seq_zero = has & ((weights * mask).sum(-1) == 0)
    metrics = {"mean_weight": (weights * mask).sum() / mask.sum().clamp_min(1),
               "masked_fraction": seq_zero.to(mask.dtype).sum() / has.to(mask.dtype).sum()
               .clamp_min(1)}
    return weights.detach(), {k: v.detach() for k, v in metrics.items()}


def _truncated_in_band(ratio, cap: float, low: float, high: float):
    """min(ratio, cap) where low <= ratio <= high, else 0."""
    return torch.where((ratio >= low) & (ratio <= high), torch.clamp(ratio, max=cap), 0.0)


def weighted_advantages(algo: str, advantages, weights, mask):
    """Advantages that carry the correction: per token ([B, T]) for gspo_token and grpo, whose
    per-token terms are each multiplied by their weight; per sequence ([B]) for gspo, whose
    sequence term is multiplied by the sequence's weight. Weights are >= 0, so the clip of each
    term (which looks at the advantage's sign) is unchanged."""
    mask = mask.to(weights.dtype)
    if algo == "gspo":
        if advantages.dim() != 1:
            raise ValueError("gspo: advantages must be one per sequence ([B])")
        big = torch.finfo(weights.dtype).max
        hi = torch.where(mask > 0, weights, -big).amax(-1)
        lo = torch.where(mask > 0, weights, big).amin(-1)
        has = mask.sum(-1) > 0
        if bool((has & (hi - lo).abs().gt(1e-12)).any()):
            raise ValueError("gspo: rollout-correction weights must be one per sequence (modes "
                             f"{', '.join(SEQUENCE_MODES)}); token_tis weighs each token")
        return advantages * torch.where(has, hi, 0.0).to(advantages.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    return adv.to(weights.dtype) * weights
