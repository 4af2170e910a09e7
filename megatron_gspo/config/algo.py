"""The policy objective and Routing Replay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gspo.config.errors import invalid


ALGOS = ("gspo", "gspo_token", "grpo")


@dataclass
class AlgoConfig:
    """The policy objective (``megatron_gspo.losses``). Clip ranges default to the paper's:
    GSPO (3e-4, 4e-4), GRPO (0.2, 0.27)."""

    name: str = "gspo"  # gspo | gspo_token | grpo
    clip_low: Optional[float] = None  # ratio clip below 1 (None: the algorithm's paper default)
    clip_high: Optional[float] = None  # ratio clip above 1 (None: the paper default)
    aggregation: str = "seq_mean"  # seq_mean (the paper) | token_mean (GRPO only, DAPO-style)
    dual_clip: Optional[float] = None  # GRPO only
    kl_coef: float = 0.0  # > 0 builds a frozen reference model (k3 estimator)
    entropy_coef: float = 0.0  # > 0 adds an entropy bonus
    minibatches: int = 4  # policy updates per rollout batch (the paper: 4; later ones off-policy)
    # Which rows make a mini-batch: interleaved (every minibatches-th row: each mini-batch holds
    # some rows of every prompt) | groups (every minibatches-th group, whole, as verl and slime
    # split a batch: a group's prompt is then fed once for all its rows, trainer.share_prompts).
    minibatch_split: str = "interleaved"
    scale_advantages: bool = True  # divide by the group's reward std
    # MoE router losses during RL (the warm-up uses model.aux_loss_coeff). Default 0: GSPO's
    # objective has no such term, its gradient does not scale with the advantages (it would
    # dominate the small clipped GSPO updates), and under R2 / R3 it would push routers that
    # the replayed routes override. Response tokens only (never prompt or padding) when on.
    aux_loss_coeff: float = 0.0  # load-balancing loss (Switch-style, per micro-batch)
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    # Behaviour (old-policy) log-probs: recompute (the trainer's forward-only pass on the old
    # policy) | engine (the rollout engine's on every row; no pass) | auto (engine where the
    # engine is the trainer's own fp32 model on CPU, so that its log-probs are the old
    # policy's to float rounding, but the first mini-batch's from its update's forward;
    # recompute elsewhere: SGLang, GPU, bf16, R2, R3, rollout correction).
    old_logprobs: str = "auto"
    # Rollout correction: importance weights of the trainer's old policy over the engine's
    # sampling (algorithms/correction.py): none | token_tis | seq_tis (weights min(ratio, cap)) |
    # seq_mis (sequences outside [low, high] dropped) | decoupled (off-policy samples of
    # rollout.mode one_step_off / async: min(ratio, cap) and 0 outside [low, high], per
    # sequence's geometric mean for gspo, per token for gspo_token and grpo); gspo takes the
    # sequence modes only.
    rollout_correction: str = "none"
    rollout_correction_cap: float = 2.0  # token_tis / seq_tis / decoupled: weights capped at this
    # seq_mis / decoupled: sequences (tokens) whose ratio is below this get weight 0
    rollout_correction_low: float = 0.5
    rollout_correction_high: float = 2.0  # seq_mis / decoupled: ... or above this

    def validate(self) -> "AlgoConfig":
        """The values on their own; the loss options and correction modes against their
        registries are ``config.checks``."""
        if not (0 < self.rollout_correction_low <= 1 <= self.rollout_correction_high
                and self.rollout_correction_cap >= 1):
            raise invalid("algo.rollout_correction_low", self.rollout_correction_low,
                          "needs 0 < low <= 1 <= high and cap >= 1",
                          "e.g. low 0.5, high 2.0, cap 2.0")

        if self.name not in ALGOS:
            raise invalid("algo.name", self.name, "is unknown", f"use one of {', '.join(ALGOS)}")
        if self.minibatches < 1:
            raise invalid("algo.minibatches", self.minibatches, "must be >= 1",
                          "use 1 for on-policy")
        if self.minibatch_split not in ("interleaved", "groups"):
            raise invalid("algo.minibatch_split", self.minibatch_split, "is unknown",
                          "use interleaved or groups")
        if self.old_logprobs not in ("auto", "recompute", "engine"):
            raise invalid("algo.old_logprobs", self.old_logprobs, "is unknown",
                          "use auto, recompute or engine")
        for key in ("aux_loss_coeff", "z_loss_coeff"):
            if getattr(self, key) < 0:
                raise invalid(f"algo.{key}", getattr(self, key), "must be >= 0", "use 0 to disable")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise invalid("algo.kl_coef" if self.kl_coef < 0 else "algo.entropy_coef",
                          min(self.kl_coef, self.entropy_coef), "must be >= 0", "use 0 to disable")
        if self.dual_clip is not None and self.name != "grpo":
            raise invalid("algo.dual_clip", self.dual_clip,
                          f"applies to grpo only, not {self.name}",
                          "remove algo.dual_clip")
        return self

    def loss_options(self) -> dict:
        out = {"aggregation": self.aggregation, "kl_coef": self.kl_coef,
               "entropy_coef": self.entropy_coef}
        if self.name == "grpo":
            out["dual_clip"] = self.dual_clip
        return out


@dataclass
class ReplayConfig:
    """Routing Replay: none, r2 (routes of the trainer's old-policy pass) or r3 (routes of the
    rollout engine)."""

    mode: str = "none"  # none | r2 | r3

    def validate(self) -> "ReplayConfig":
        if self.mode not in ("none", "r2", "r3"):
            raise invalid("replay.mode", self.mode, "is unknown", "use none, r2 or r3")
        return self
