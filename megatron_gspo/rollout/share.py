"""Rollouts owned by one rank per model replica, shared with the others on the run's device.

With an external engine (SGLang), only the replica's leader (``ctx.is_replica_leader``) sends
requests: every tensor-, pipeline- and context-parallel rank of the replica must train on the same
token ids, which independent sampling on each rank would not give. ``share_samples`` broadcasts
the leader's samples (token ids, log-probs, finish reasons, routed experts) over the replica's
group in a fixed number of collectives: a header, the per-sample sizes, then one flat tensor each.

Legend: ``N`` samples, ``T`` tokens over all samples, ``L`` MoE layers, ``K`` top-k.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_gspo.distributed import comm
from megatron_gspo.rollout.types import RolloutError, Sample


_REASONS = ("stop", "length", "abort")


def share_samples(samples: Optional[Sequence[Sample]], *, group, device: torch.device,
                  failed: bool = False) -> list[Sample]:
    """Group rank 0 passes its samples, the other ranks ``None``; every rank returns them (the
    leader its own objects, the others rebuilt bitwise from the broadcasts). ``failed`` (on the
    leader, with no samples): its rollout failed; the others raise ``RolloutError`` (the leader
    raises its own error)."""
    leader = samples is not None or failed
    # N, L, K (L = 0: no routes), whether the samples carry per-token versions
    header = torch.zeros(4, dtype=torch.int64, device=device)
    if failed:
        header.fill_(-1)
    elif leader:
        routes = [s.routes_TLK for s in samples]
        has_routes = bool(samples) and all(r is not None for r in routes)
        shape = routes[0].shape[1:] if has_routes else (0, 0)
        versions = bool(samples) and all(s.versions_R is not None for s in samples)
        header.copy_(torch.tensor([len(samples), *shape, int(versions)], dtype=torch.int64))
    comm.broadcast_tensor(header, src_in_group=0, group=group)
    n, layers, top_k, has_versions = header.tolist()
    if n < 0:
        if failed:
            return []
        raise RolloutError("the replica leader's rollout failed (its error is in its log)")

    sizes_N4 = torch.zeros(n, 4, dtype=torch.int64, device=device)  # prompt, response, index, reason
    if leader:
        sizes_N4.copy_(torch.tensor([[len(s.prompt_ids), len(s.response_ids), s.prompt_index,
                                      _REASONS.index(s.finish_reason)] for s in samples],
                                    dtype=torch.int64).reshape(n, 4))
    comm.broadcast_tensor(sizes_N4, src_in_group=0, group=group)
    sizes = sizes_N4.tolist()
    tokens = sum(p + r for p, r, _, _ in sizes)
    responses = sum(r for _, r, _, _ in sizes)
    route_rows = sum(max(p + r - 1, 0) for p, r, _, _ in sizes) if layers else 0

    ids_T = torch.zeros(tokens, dtype=torch.int64, device=device)
    logp_R = torch.zeros(responses, dtype=torch.float32, device=device)
    routes_TLK = torch.zeros(route_rows, layers, top_k, dtype=torch.int32, device=device)
    versions_R = torch.zeros(responses if has_versions else 0, dtype=torch.int64, device=device)
    if leader and n:
        ids_T.copy_(torch.tensor([t for s in samples for t in (*s.prompt_ids, *s.response_ids)],
                                 dtype=torch.int64))
        logp_R.copy_(torch.cat([s.logprobs_R.float().reshape(-1) for s in samples]))
        if layers:
            routes_TLK.copy_(torch.cat([s.routes_TLK.to(torch.int32) for s in samples]))
        if has_versions:
            versions_R.copy_(torch.cat([s.versions_R.reshape(-1).long() for s in samples]))
    for t in (ids_T, logp_R, routes_TLK, versions_R):
        comm.broadcast_tensor(t, src_in_group=0, group=group)
    if leader:
        return list(samples)
    return _unpack(sizes, ids_T.cpu(), logp_R.cpu(), routes_TLK.cpu() if layers else None,
                   versions_R.cpu() if has_versions else None)


def _unpack(sizes, ids_T, logp_R, routes_TLK, versions_R=None) -> list[Sample]:
    out, t, r, q = [], 0, 0, 0
    for p_len, r_len, index, reason in sizes:
        ids = ids_T[t:t + p_len + r_len].tolist()
        routes = None
        if routes_TLK is not None:
            rows = max(p_len + r_len - 1, 0)
            routes = routes_TLK[q:q + rows].long()
            q += rows
        out.append(Sample(prompt_ids=ids[:p_len], response_ids=ids[p_len:],
                          logprobs_R=logp_R[r:r + r_len].clone(), finish_reason=_REASONS[reason],
                          routes_TLK=routes, prompt_index=index,
                          versions_R=None if versions_R is None else versions_R[r:r + r_len].clone()))
        t += p_len + r_len
        r += r_len
    return out


def share_values(values: Optional[torch.Tensor], count: int, *, group, device: torch.device
                 ) -> torch.Tensor:
    """Group rank 0's ``count`` float32 values (e.g. the rewards it scored), on every rank, as a
    host tensor."""
    buf = torch.zeros(count, dtype=torch.float32, device=device)
    if values is not None:
        buf.copy_(values.reshape(count).to(torch.float32))
    comm.broadcast_tensor(buf, src_in_group=0, group=group)
    return buf.cpu()
