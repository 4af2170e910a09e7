"""Per-rank functions of the sequence-shard invariance tests (CP zigzag, vocab-parallel TP)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_loss_job(algos, batches, cp, options):
    """For each algo and batch: this rank's zigzag chunks of every row, the loss through one
    per-sequence all-reduce. Returns results[algo][batch index]."""
    dist.init_process_group("gloo", init_method="env://")
    return {algo: [_cp_loss(algo, *batch, cp, options) for batch in batches] for algo in algos}


def _cp_loss(algo, logp, old, adv, mask, cp, options):
    from megatron_gspo.algorithms.losses import shard_policy_loss
    from megatron_gspo.distributed.seqshard import SequenceReducer, TokenShard, zigzag_index

    rank = dist.get_rank()
    b, t = logp.shape
    x = logp.clone().requires_grad_()
    cols = zigzag_index(t, cp, rank)
    index = (torch.arange(b)[:, None] * t + cols[None, :]).reshape(-1)
    shard = TokenShard.from_dense(x, old, adv, mask).select(index)
    reducer = SequenceReducer(dist.group.WORLD)
    loss, metrics = shard_policy_loss(algo, shard, reducer=reducer, **options)
    loss.backward()
    return dict(loss=loss.detach(), grad=x.grad, index=index, metrics=metrics,
                values_sent=reducer.values_sent)


def tp_loss_job(algo, logits, target, old, adv, mask):
    """Vocab-sharded logits -> log-probs (no vocab gather) -> loss; grad of this rank's shard."""
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.algorithms.losses import policy_loss

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    shard = logits.chunk(dist.get_world_size(), -1)[rank].clone().requires_grad_()
    logp, _ = token_logprobs(shard, target, group=dist.group.WORLD, chunk_size=5)
    loss, _ = policy_loss(algo, logp, old, adv, mask)
    loss.backward()
    return loss.detach(), shard.grad
