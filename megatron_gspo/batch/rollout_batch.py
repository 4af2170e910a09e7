"""From generated samples to the trainer's batch: padded rows, response masks, advantages, the
engine's log-probs and routes, cut into mini-batches and micro-batches.

The batch itself stays in padded rows on the host (every per-token value of the step, whatever
the layout of the passes, lives at ``[row, position]``). A ``Layout`` says which rows one
micro-batch feeds and how: as padded rows ``[B, S]``, or packed back to back in one THD row
``[1, N]`` (``trainer.packing``). Micro-batches are built from their layout (``micro_batch``),
values computed per micro-batch go back to the batch through it (``Layout.scatter``), and with
packing the rows first move between data-parallel ranks (``exchange_rows``, after
``packing.plan_step``).

Legend: ``B`` rows on this data-parallel rank (prompts x group), ``S`` padded row width (tokens fed
to the model; targets are the next tokens), ``N`` tokens of a packed row, ``L`` MoE layers, ``K``
top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_gspo.batch.packing import round_up
from megatron_gspo.distributed import comm
from megatron_gspo.rollout.types import Sample
from moe.records import RoutingRecord


@dataclass
class RolloutBatch:
    """This rank's responses of one step, as right-padded rows of prompt + response."""

    tokens_BS1: torch.Tensor  # [B, S + 1] token ids (inputs [:, :-1], targets [:, 1:])
    mask_BS: torch.Tensor  # [B, S] 1.0 where the target is a response token
    engine_logp_BS: torch.Tensor  # [B, S] the engine's log-probs at response targets, else 0
    advantages_B: torch.Tensor
    rewards_B: torch.Tensor
    lengths_B: torch.Tensor  # tokens fed per row (prompt + response - 1)
    prompt_lengths_B: torch.Tensor  # prompt tokens per row
    routes: Optional[list] = None  # per row, moe.records.RoutingRecord of the engine (or None)
    # Behaviour log-probs, known before the updates but on the ``pending_B`` rows (the first
    # mini-batch's, under ``BehaviourPlan.first_from_update``), which their update's forward on
    # the old policy gives; 0 there until then.
    old_logp_BS: Optional[torch.Tensor] = None
    pending_B: Optional[torch.Tensor] = None  # bool; None: no row pending
    ref_logp_BS: Optional[torch.Tensor] = None  # reference policy (KL term)
    # The trainer's own log-probs on the old policy (its pass's, or an update's forward's) on the
    # ``trainer_rows_B`` rows (bool; None: every row); None where it computed none.
    trainer_logp_BS: Optional[torch.Tensor] = None
    trainer_rows_B: Optional[torch.Tensor] = None
    informative_B: Optional[torch.Tensor] = None  # 1.0 where the row's group rewards differ
    # Micro-batches of each mini-batch (None: padded rows, ``padded_layouts``).
    layouts: Optional[list] = None
    # The batch's rows by where the rollout put them ((dp rank, index)); after a packing exchange
    # they come from several ranks.
    origin: Optional[list] = None

    @property
    def rows(self) -> int:
        return self.tokens_BS1.shape[0]

    @property
    def width(self) -> int:
        return self.tokens_BS1.shape[1] - 1

    def num_response_tokens(self) -> int:
        return int(self.mask_BS.sum())

    @property
    def has_pending(self) -> bool:
        return self.pending_B is not None and bool(self.pending_B.any())

    def logprob_mismatch(self) -> tuple:
        """(sum of |engine - trainer| log-prob, tokens compared) over the response tokens whose
        rows have trainer log-probs (``trainer_rows_B``); (0, 0) without any. A non-finite
        trainer log-prob in those rows makes the sum so."""
        if self.trainer_logp_BS is None:
            return 0.0, 0.0
        compared = self.mask_BS > 0
        if self.trainer_rows_B is not None:
            compared = compared & self.trainer_rows_B[:, None]
        diff = torch.where(compared, self.engine_logp_BS - self.trainer_logp_BS, 0.0)
        return float(diff.abs().sum()), float(compared.sum())


def width_multiple(ctx) -> int:
    """What a row width must divide by: 2 x cp zigzag chunks under context parallelism, times
    the TP size under sequence parallelism (which splits each rank's share again)."""
    return (2 * ctx.cp if ctx.cp > 1 else 1) * (ctx.tp if ctx.sequence_parallel else 1)


def row_width(samples: Sequence[Sample], *, device: torch.device, multiple_of: int = 1,
              group=None) -> int:
    """Tokens fed per row: the widest prompt + response - 1 over every rank (one all-reduce), so
    that each rank pads its rows the same way, rounded up to ``multiple_of``."""
    widest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return round_up(comm.reduce_max_int(widest, device=device, group=group) - 1, multiple_of)


def build_batch(samples: Sequence[Sample], rewards_B: torch.Tensor, advantages_B: torch.Tensor, *,
                width: int, pad_id: int, num_experts: int = 0) -> RolloutBatch:
    """Pad ``samples`` to ``width`` fed tokens; a response of R tokens after a prompt of P has its
    targets at positions P-1 .. P+R-2."""
    b = len(samples)
    rows, log_probs = [], []
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p + r > width + 1:
            raise ValueError(f"sample {i} has {p + r} tokens, the batch is {width + 1} wide")
        if p == 0:
            raise ValueError(f"sample {i} has an empty prompt (a response needs a token before it)")
        if len(s.logprobs_R) != r:
            raise ValueError(f"sample {i} has {r} response tokens and {len(s.logprobs_R)} "
                             "log-probs")
        rows.append([*s.prompt_ids, *s.response_ids, *[pad_id] * (width + 1 - p - r)])
        log_probs.append(s.logprobs_R.float().reshape(-1))
    tokens = torch.tensor(rows, dtype=torch.long).reshape(b, width + 1)
    prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    response_lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    lengths = prompt_lengths + response_lengths - 1
    # a response's targets: positions P-1 .. P+R-2, row by row in order (as the log-probs come)
    first = (prompt_lengths - 1)[:, None]
    position = torch.arange(width)[None, :]
    targets = (position >= first) & (position < first + response_lengths[:, None])
    mask = torch.zeros(b, width)
    mask[targets] = 1.0
    engine_logp = torch.zeros(b, width)
    if log_probs:
        engine_logp[targets] = torch.cat(log_probs)
    routes = ([RoutingRecord.from_indices(s.routes_TLK, num_experts) for s in samples]
              if samples and samples[0].routes_TLK is not None else None)
    return RolloutBatch(tokens, mask, engine_logp, advantages_B.float(), rewards_B.float(), lengths,
                        prompt_lengths, routes)


def prompt_shares(batch: RolloutBatch) -> list:
    """Per row ``(key, n)`` for ``packing.plan_step``: rows with equal keys hold the same prompt
    and may feed its first ``n`` = prompt - 1 tokens once (the last prompt token stays in each
    row's own segment: it predicts the row's first response token). The key is the first row
    with the same prompt tokens and, when the batch has the engine's routes (R3, drift), the
    same routes on those ``n`` tokens: a shared token has one route."""
    keys, out = {}, []
    for i in range(batch.rows):
        n = int(batch.prompt_lengths_B[i]) - 1
        key = (tuple(batch.tokens_BS1[i, :n + 1].tolist()),
               None if batch.routes is None else batch.routes[i].indices()[:n].numpy().tobytes())
        out.append((keys.setdefault(key, i), n))
    return out


# ---------------------------------------------------------------------------------------------
# Layouts: which rows a micro-batch feeds, padded or packed.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Packing's exchange of rows between data-parallel ranks.
# ---------------------------------------------------------------------------------------------
