"""Per-rank functions of the local-engine tests."""

from __future__ import annotations

import math

import torch

ENGINE_MODEL = dict(vocab_size=128, hidden_size=64, num_layers=4, num_attention_heads=4,
                    num_query_groups=2, head_dim=16, ffn_hidden_size=96, moe_ffn_hidden_size=32,
                    num_experts=4, top_k=2, first_k_dense=0, init_method_std=0.1)


def _setup(parallel_kwargs, **model_overrides):
    import dataclasses

    from megatron_gspo.config import BackendConfig, ModelConfig, ParallelConfig
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.models.model import build_model
    from megatron_gspo.rollout.local_engine import LocalEngine
    from moe.replay import RoutingReplay

    # the backend's switches (cpu_experts_kernel, grouped_experts) go to build_model
    backend = {f.name for f in dataclasses.fields(BackendConfig)}
    kernels = BackendConfig(**{k: v for k, v in model_overrides.items() if k in backend})
    cfg = ModelConfig(**{**ENGINE_MODEL, **{k: v for k, v in model_overrides.items()
                                            if k not in backend}})
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=11)
    gpt = build_model(cfg, ctx, kernels=kernels, moe_enable_routing_replay=True)
    replay = RoutingReplay(gpt)
    return cfg, ctx, gpt, replay, LocalEngine(gpt, ctx, replay=replay)


def _trainer_view(gpt, ctx, replay, sample, temperature):
    """The trainer's recomputation: prompt + response (no padding), RECORD routes."""
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward
    from megatron_gspo.algorithms.logprobs import token_logprobs

    seq = torch.tensor(sample.prompt_ids + sample.response_ids)[None]
    fed = seq.shape[1] - 1
    pad = (-fed) % ctx.tp  # sequence parallelism splits the positions evenly (causal: pad at the end)
    seq = torch.cat([seq, torch.zeros(1, pad, dtype=seq.dtype)], 1)

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group,
                                 temperature=temperature)
        return -logp.mean(), {"logp": logp.detach()}

    with replay.record() as rec:
        out = forward_backward(gpt, [MicroBatch(seq[:, :-1], seq[:, 1:])], ctx, loss_fn,
                               forward_only=True)
    n_prompt = len(sample.prompt_ids)
    # pipeline stages before the last compute no log-probs (but route their own layers)
    logp = out[0]["logp"][0, n_prompt - 1:fed] if out else None
    routes = torch.stack(rec.forwards[0], 1)  # this TP rank's positions, [s, b] order with b = 1
    chunk = (fed + pad) // ctx.tp
    start = ctx.tp_rank * chunk if ctx.sequence_parallel else 0
    real = max(0, min(routes.shape[0], fed - start))  # positions past the sequence are padding
    return logp, routes[:real], start


def engine_vs_trainer_job(parallel_kwargs, prompts, params_kwargs, model_overrides=None):
    from megatron_gspo.models.grouped_experts import GroupedSequentialMLP, cached_expert_weights
    from megatron_gspo.rollout.types import SamplingParams

    cfg, ctx, gpt, replay, engine = _setup(parallel_kwargs, **(model_overrides or {}))
    params = SamplingParams(**params_kwargs)
    logit_shapes = []  # every forward's logits (the last stage's): one position per row
    forward = engine._forward

    def spy(*args):
        out = forward(*args)
        if out is not None:
            logit_shapes.append(tuple(out.shape))
        return out
    engine._forward = spy  # (the one-rank direct path's forwards too)
    samples = engine.generate(prompts, 4, params)
    from moe.records import local_moe_layers

    diffs, routes_equal, shapes_ok, route_layers = [], True, True, 0
    temperature = params.temperature or 1.0
    layers = local_moe_layers(cfg.moe_layer_pattern, ctx.pp, ctx.pp_rank)
    for s in samples:
        logp, routes, start = _trainer_view(gpt, ctx, replay, s, temperature)
        if logp is not None:
            shapes_ok &= logp.shape == s.logprobs_R.shape
            diffs.append((logp - s.logprobs_R).abs().max())
        # the engine's routes: every position fed (prompt and response but its last token),
        # every stage's MoE layers, top-k each
        fed = len(s.prompt_ids) + len(s.response_ids) - 1
        shapes_ok &= tuple(s.routes_TLK.shape) == (fed, sum(cfg.moe_layer_pattern), cfg.top_k)
        mine = s.routes_TLK[start:start + routes.shape[0], layers]
        shapes_ok &= mine.shape == routes.shape and routes.shape[1] == len(layers) > 0
        routes_equal &= mine.shape == routes.shape and bool(
            (mine.sort(-1).values == routes.sort(-1).values).all())
        route_layers += routes.shape[1]
    # torch's max keeps a NaN (Python's max would drop one that comes after a number)
    worst_logp = float(torch.stack(diffs).max()) if diffs else None
    with torch.no_grad(), cached_expert_weights(gpt):  # the experts' path while generating
        x = torch.zeros(1, cfg.hidden_size, device=ctx.device)
        generation_paths = sorted({m.path(x, x[:, 0]) for m in gpt.modules()
                                   if isinstance(m, GroupedSequentialMLP)})
    return dict(worst_logp=worst_logp, routes_equal=routes_equal, shapes_ok=shapes_ok,
                generation_paths=generation_paths,
                compared=len(samples), route_layers=route_layers,
                direct_decode=engine.direct_decode,
                decode_rows=engine.decode_rows, logit_shapes=logit_shapes,
                lengths=[len(s.response_ids) for s in samples],
                reasons=[s.finish_reason for s in samples],
                all_logp_nonpositive=all(bool((s.logprobs_R <= 0).all()) for s in samples))


def cache_vs_recompute_job(prompts, max_new):
    """Greedy generation with the KV cache vs recomputing the whole prefix at every token."""
    from megatron_gspo.rollout.types import SamplingParams

    cfg, ctx, gpt, replay, engine = _setup({})
    cached = engine.generate(prompts, 1, SamplingParams(max_new_tokens=max_new, temperature=0))
    gpt.eval()
    recomputed = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(max_new):
                x = torch.tensor(seq)[None]
                logits = gpt(x, torch.arange(len(seq))[None], attention_mask=None)
                seq.append(int(logits[0, -1].argmax()))
            recomputed.append(seq[len(p):])
    return [s.response_ids for s in cached], recomputed


def big_batch_job(n_prompts, max_new):
    from megatron_gspo.rollout.types import SamplingParams

    cfg, ctx, gpt, replay, engine = _setup({})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (int(torch.randint(2, 12, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n_prompts)]
    samples = engine.generate(prompts, 1, SamplingParams(max_new_tokens=max_new, temperature=1.0,
                                                         top_p=0.9, top_k=20, seed=3))
    again = engine.generate(prompts, 1, SamplingParams(max_new_tokens=max_new, temperature=1.0,
                                                       top_p=0.9, top_k=20, seed=3))
    return ([s.response_ids for s in samples], [s.response_ids for s in again],
            [s.prompt_index for s in samples])


def stop_job(prompts):
    from megatron_gspo.rollout.types import SamplingParams

    cfg, ctx, gpt, replay, engine = _setup({})
    free = engine.generate(prompts, 1, SamplingParams(max_new_tokens=5, temperature=0))
    stop_id = free[0].response_ids[2]  # the third greedy token of the first prompt
    stopped = engine.generate(prompts, 1, SamplingParams(max_new_tokens=5, temperature=0,
                                                         stop_token_ids=(stop_id,)))
    return [s.response_ids for s in free], [s.response_ids for s in stopped], \
        [s.finish_reason for s in stopped], stop_id


def rotated_cache_job(prompts):
    """Sampled generation (rows stopping at different steps, so the batch compacts) with the
    model's attention (keys cached rotated) and again with megatron's SelfAttention (keys cached
    unrotated, the whole cache rotated at every step), from the same seed."""
    from megatron.core.transformer.attention import SelfAttention

    from megatron_gspo.models.layers import RotatedCacheSelfAttention
    from megatron_gspo.rollout.types import SamplingParams

    cfg, ctx, gpt, replay, engine = _setup({})
    engine.direct_decode = False  # decoding through the model's attention modules
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5,
                            stop_token_ids=tuple(range(0, 128, 5)))
    attentions = [m for m in gpt.modules() if isinstance(m, SelfAttention)]
    ours = all(type(m) is RotatedCacheSelfAttention for m in attentions)
    rotated = engine.generate(prompts, 4, params)
    for m in attentions:
        m.__class__ = SelfAttention
    unrotated = engine.generate(prompts, 4, params)
    return ours and len(attentions) == cfg.num_layers, [
        (a.response_ids == b.response_ids, torch.equal(a.logprobs_R, b.logprobs_R),
         torch.equal(a.routes_TLK, b.routes_TLK)) for a, b in zip(rotated, unrotated)], \
        [len(s.response_ids) for s in rotated]


def direct_decode_job(prompts, model_overrides):
    """The engine's decoding steps through ``decode_step`` and through the model's forward: the
    same prompts and seeds, sampled (stop ids: the batch compacts) and greedy."""
    from megatron_gspo.rollout.types import SamplingParams

    cfg, ctx, gpt, replay, engine = _setup({}, **model_overrides)
    direct = engine.direct_decode
    out = []
    for params in (SamplingParams(max_new_tokens=8, temperature=1.0, seed=7,
                                  stop_token_ids=tuple(range(0, 128, 5))),
                   SamplingParams(max_new_tokens=6, temperature=0.0)):
        engine.direct_decode = True
        fast = engine.generate(prompts, 4, params)
        rows = list(engine.decode_rows)
        engine.direct_decode = False
        model = engine.generate(prompts, 4, params)
        same = [a.response_ids == b.response_ids for a, b in zip(fast, model)]
        out.append(dict(  # (rows whose tokens differ compare nothing else)
            tokens_equal=all(same),
            worst_logp=max(float((a.logprobs_R - b.logprobs_R).abs().max()) if ok else math.inf
                           for a, b, ok in zip(fast, model, same)),
            routes_equal=all(ok and torch.equal(a.routes_TLK, b.routes_TLK)
                             for a, b, ok in zip(fast, model, same)),
            decode_rows=rows, lengths=[len(s.response_ids) for s in fast]))
    return direct, out


def decode_path_job(model_overrides):
    """Whether the engine of a one-rank model with these options decodes directly, and why not."""
    from megatron_gspo.backends.cpu.decode import unsupported

    cfg, ctx, gpt, replay, engine = _setup({}, **model_overrides)
    return engine.direct_decode, unsupported(gpt, ctx)
