"""Per-rank functions of the routing-replay tests."""

from __future__ import annotations


REPLAY_MODEL = dict(vocab_size=128, hidden_size=64, num_layers=4, num_attention_heads=4,
                    num_query_groups=2, head_dim=16, ffn_hidden_size=96, moe_ffn_hidden_size=32,
                    num_experts=4, top_k=2, first_k_dense=1, init_method_std=0.1)


def _used_routes(rr):
    """Capture the experts each router actually used (from its routing map) per forward."""
    used = []

    def hook(module, args, output):
        routing_map = output[1]
        k = module.topk
        idx = routing_map.float().topk(k, dim=-1).indices  # the k True columns
        assert bool((routing_map.sum(-1) == k).all())
        used.append(idx)

    handles = [r.register_forward_hook(hook) for r in rr.routers]
    return used, handles


def _sets_equal(a, b):
    return bool((a.sort(-1).values == b.sort(-1).values).all())


def replay_job(parallel_kwargs, tokens_BS, engine_routes_BSLK, recompute, packed_lengths):
    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.distributed.seqshard import pack_sequences
    from moe.drift import topk_agreement
    from moe.records import (RoutingRecord, RoutingRecordError, local_moe_layers, packed_routes,
                             rank_targets)
    from moe.replay import RoutingReplay

    cfg = ModelConfig(**REPLAY_MODEL)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=3)
    extra = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1) if recompute else {}
    gpt = build_model(cfg, ctx, moe_enable_routing_replay=True, **extra)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    rr = RoutingReplay(gpt)
    left_in_global_list = len(RouterReplay.global_router_replay_instances)
    layers = local_moe_layers(cfg.moe_layer_pattern, ctx.pp, ctx.pp_rank)

    if packed_lengths:
        seqs = [tokens_BS[i, :n] for i, n in enumerate(packed_lengths)]
        packed = pack_sequences(seqs, multiple_of=ctx.tp)
        mb = MicroBatch(packed.tokens_1N, packed.targets_1N, packed.position_ids_1N,
                        cu_seqlens=packed.cu_seqlens)
        records = [RoutingRecord.from_indices(engine_routes_BSLK[i], cfg.num_experts)
                   for i in range(len(seqs))]
        full_routes = packed_routes(records, packed.cu_seqlens)
    else:
        mb = MicroBatch(tokens_BS[:, :-1], tokens_BS[:, 1:])
        full_routes = engine_routes_BSLK
    engine_targets = rank_targets(full_routes, layers=layers, tp=ctx.tp, tp_rank=ctx.tp_rank,
                                  sequence_parallel=ctx.sequence_parallel)

    def loss_fn(m, logits):
        logp, _ = token_logprobs(logits, m.targets_BS, group=ctx.tp_group)
        return -logp.mean(), {"logp": logp.detach()}

    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer, zero_grads

    ddp, optimizer = wrap_and_build_optimizer(gpt, ctx, OptimConfig(lr=0.05, clip_grad=0.0))

    def run(backward):
        out = forward_backward(ddp, [mb], ctx, loss_fn, forward_only=not backward)
        return out[0]["logp"] if out else None

    # R2: record the old-policy pass, take a large optimizer step, replay.
    with rr.record() as recorded:
        zero_grads(ddp, optimizer)
        run(backward=True)
    old_routes = recorded.forwards[0]
    optimizer.step()
    zero_grads(ddp, optimizer)
    with rr.record() as after:
        run(backward=False)
    drift_off = [float(topk_agreement(a, b)["changed_fraction"])
                 for a, b in zip(old_routes, after.forwards[0])]
    used, handles = _used_routes(rr)
    with rr.replay([old_routes]):
        logp_replay = run(backward=True)
    for h in handles:
        h.remove()
    n = len(rr.routers)
    forward_used = used[:n]  # then the recomputation's routes, when recompute is on
    # (every router of this rank counted: zip would stop at the shorter list)
    replay_exact = len(forward_used) == len(old_routes) == n > 0 and all(
        _sets_equal(u, t) for u, t in zip(forward_used, old_routes))
    # The backward recomputes the layers last to first.
    recompute_exact = len(used[n:]) in (0, n) and all(
        _sets_equal(u, t) for u, t in zip(reversed(used[n:]), old_routes))
    # Reference: the same routes forced by driving megatron's RouterReplay instances directly.
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router, target in zip(rr.routers, old_routes):
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        router.router_replay.set_target_indices(target)
    logp_forced = run(backward=False)
    for router in rr.routers:
        router.router_replay.clear_indices()
        router.router_replay.clear_router_replay_action()
    forced_diff = None if logp_replay is None else float((logp_replay - logp_forced).abs().max())

    # R3: routes supplied from outside (the engine), sliced for this rank.
    used, handles = _used_routes(rr)
    with rr.replay([engine_targets]):
        run(backward=True)
    for h in handles:
        h.remove()
    r3_exact = len(used) >= n == len(engine_targets) and all(
        _sets_equal(u, t) for u, t in zip(used[:n], engine_targets))

    errors = {}
    bad_cases = {
        "top_k": [[t[:, :1] for t in engine_targets]],
        "layers": [engine_targets[:-1] + engine_targets[-1:] * 2],
        "range": [[t + cfg.num_experts for t in engine_targets]],
        "tokens": [[t[:-2] for t in engine_targets]],
        "unconsumed": [engine_targets, engine_targets],
    }
    if ctx.pp > 1:  # raised inside one stage's forward: the other stage would wait forever
        del bad_cases["tokens"]
    for name, targets in bad_cases.items():
        try:
            with rr.replay(targets):
                run(backward=False)
            errors[name] = None
        except RoutingRecordError as e:
            errors[name] = str(e)
    return dict(drift_off=drift_off, replay_exact=replay_exact, forced_diff=forced_diff,
                r3_exact=r3_exact, recompute_exact=recompute_exact, used_after=len(used), num_routers=n,
                errors=errors, layers=layers, rank=ctx.rank,
                left_in_global_list=left_in_global_list)
