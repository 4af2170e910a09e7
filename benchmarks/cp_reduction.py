"""Bytes that context parallelism sends per GSPO loss: our per-sequence reduction vs all-gathering
per-token log-probs (what slime, verl and NeMo-RL do), on real gloo ranks.

    python benchmarks/cp_reduction.py            # 8 sequences x 8192 tokens, CP = 4

Both are run for real on CP ranks over gloo: the per-sequence statistics all-reduce inside our loss
(counted by SequenceReducer), and an all-gather of every rank's per-token log-probs and old
log-probs. Bytes are the payload per rank per step (all-reduce payload x 2(cp-1)/cp for a ring;
all-gather: the (cp-1)/cp of the full tensors that arrive from other ranks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_job(seqs: int, seq_len: int, cp: int, reps: int):
    import torch
    import torch.distributed as dist

    from megatron_gspo.algorithms.losses import shard_policy_loss
    from megatron_gspo.distributed.seqshard import SequenceReducer, TokenShard, zigzag_index

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(seqs, seq_len, generator=g)
    old = logp + 1e-3 * torch.randn(seqs, seq_len, generator=g)
    adv = torch.randn(seqs, generator=g)
    mask = torch.ones(seqs, seq_len)
    cols = zigzag_index(seq_len, cp, rank)
    index = (torch.arange(seqs)[:, None] * seq_len + cols[None, :]).reshape(-1)

    reducer = SequenceReducer(dist.group.WORLD)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        x = logp.clone().requires_grad_()
        shard = TokenShard.from_dense(x, old, adv, mask).select(index)
        loss, _ = shard_policy_loss("gspo", shard, reducer=reducer)
        loss.backward()
    ours_s = (time.perf_counter() - start) / reps

    local_logp = logp.reshape(-1)[index].contiguous()
    local_old = old.reshape(-1)[index].contiguous()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        gathered = [torch.empty_like(local_logp) for _ in range(cp)]
        dist.all_gather(gathered, local_logp)
        gathered_old = [torch.empty_like(local_old) for _ in range(cp)]
        dist.all_gather(gathered_old, local_old)
    gather_s = (time.perf_counter() - start) / reps
    per_step_values = reducer.values_sent // reps
    return dict(ours_values=per_step_values, ours_s=ours_s, gather_s=gather_s,
                gathered_values=2 * local_logp.numel() * cp)


def main() -> None:
    from tests.distributed import run_ranks

    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    r = run_ranks(rank_job, args.cp, args.seqs, args.seq_len, args.cp, args.reps)[0]
    cp = args.cp
    ours_bytes = r["ours_values"] * 4 * 2 * (cp - 1) / cp
    gather_bytes = r["gathered_values"] * 4 * (cp - 1) / cp
    print(f"GSPO loss under CP={cp}: {args.seqs} sequences x {args.seq_len} tokens, fp32, gloo")
    print(f"{'method':34s} {'values':>10s} {'bytes/rank':>12s} {'time (ms)':>10s}")
    print(f"{'per-sequence all-reduce (ours)':34s} {r['ours_values']:10d} {ours_bytes:12.0f} "
          f"{1e3 * r['ours_s']:10.2f}")
    print(f"{'all-gather logp + old logp':34s} {r['gathered_values']:10d} {gather_bytes:12.0f} "
          f"{1e3 * r['gather_s']:10.2f}")
    print(f"ratio (all-gather / ours): bytes {gather_bytes / ours_bytes:,.0f}x")
    print("(our time includes the whole loss forward+backward; the all-gather time is "
          "communication alone)")


if __name__ == "__main__":
    main()
