"""Context-parallel model runs on spawned ranks (importable by child processes)."""

from __future__ import annotations

import torch


def _logprobs(hf_dir, ctx, tokens_BS, sequences):
    """Per-token log-probs of a padded batch (whole rows gathered from the CP ranks) and of the
    same sequences packed in one THD row (each padded to 2 x cp chunks)."""
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.trainer.passes import logprob_pass
    from megatron_gspo.distributed.seqshard import pack_sequences
    from tests.model_workers import tiny_model_config

    cfg = tiny_model_config(hf_dir)
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    mbs = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens_BS.chunk(2)]
    padded, _ = logprob_pass(gpt, mbs, ctx, temperature=1.0)
    padded = torch.cat(padded)
    chunks = 2 * ctx.cp
    packed = pack_sequences(sequences, multiple_of=chunks * (ctx.tp if ctx.sequence_parallel else 1),
                            seq_multiple_of=chunks)
    mb = MicroBatch(packed.tokens_1N, packed.targets_1N, packed.position_ids_1N,
                    cu_seqlens=packed.cu_seqlens)
    packed_logp, _ = logprob_pass(gpt, [mb], ctx, temperature=1.0)
    return padded, packed_logp[0][0][packed.valid_N]


def cp_job(hf_dir, parallel_kwargs, logprob_inputs, cases):
    """In one process group: ``_logprobs`` of ``(tokens, sequences)`` and ``_update`` for each
    case ``(tokens, delta, adv, mask, algo, replay)``."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.distributed.parallel import init_parallel
    from tests.model_workers import tiny_model_config

    ctx = init_parallel(ParallelConfig(**parallel_kwargs), tiny_model_config(hf_dir), seed=0)
    return {"logprobs": _logprobs(hf_dir, ctx, *logprob_inputs),
            "updates": [_update(hf_dir, ctx, *case) for case in cases],
            "sft": _sft(hf_dir, ctx, logprob_inputs[0])}


def _sft(hf_dir, ctx, tokens_BS):
    """One supervised update (the warm-up's) on prompt + answer rows: loss, batch accuracy and
    the log-probs after it."""
    from megatron_gspo.trainer.faults import NonFiniteGuard
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer
    from megatron_gspo.trainer.passes import logprob_pass, sft_micro_batches, sft_update
    from tests.model_workers import tiny_model_config

    cfg = tiny_model_config(hf_dir)
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    ddp, opt = wrap_and_build_optimizer(gpt, ctx, OptimConfig(
        optimizer="sgd", lr=0.5, clip_grad=0.0, use_distributed_optimizer=False))
    prompts = [row[:5 + i].tolist() for i, row in enumerate(tokens_BS)]
    answers = [row[5 + i:12].tolist() for i, row in enumerate(tokens_BS)]
    mbs = sft_micro_batches(prompts, answers, eos_id=2, pad_id=0, size=2, width=17)
    tokens = sum(float(mb.loss_mask_BS.sum()) for mb in mbs)
    loss, accuracy = sft_update(ddp, opt, mbs, ctx, normalizer=tokens, guard=NonFiniteGuard(3),
                                where="test")
    after, _ = logprob_pass(ddp, mbs, ctx, temperature=1.0)
    return {"loss": loss, "accuracy": accuracy, "after": torch.cat(after)}


def _update(hf_dir, ctx, tokens_BS, delta_BS, adv_B, mask_BS, algo_name, replay_mode):
    """One RL update through the trainer's passes (behaviour log-probs, policy loss over the
    context-parallel reduction, SGD): loss, grad norm, values sent over the CP group by the
    sequence reduction, and the log-probs after the update (whole rows)."""
    from megatron_gspo.config import AlgoConfig
    from megatron_gspo.trainer.faults import NonFiniteGuard
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer
    from megatron_gspo.trainer.passes import logprob_pass, normalizer_for, policy_update
    from megatron_gspo.batch.micro_batch import router_view
    from moe.instrument import local_layers_of
    from moe.replay import RoutingReplay
    from tests.model_workers import tiny_model_config

    cfg = tiny_model_config(hf_dir)
    gpt = build_model(cfg, ctx, moe_enable_routing_replay=replay_mode != "none")
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    replay = RoutingReplay(gpt) if replay_mode != "none" else None
    ddp, opt = wrap_and_build_optimizer(gpt, ctx, OptimConfig(
        optimizer="sgd", lr=0.5, clip_grad=0.0, use_distributed_optimizer=False))
    algo = AlgoConfig(name=algo_name).validate()

    def micro_batches(old=None):
        out = []
        for part in (list(range(0, len(tokens_BS), 2)), list(range(1, len(tokens_BS), 2))):
            t = tokens_BS[part]
            out.append(MicroBatch(t[:, :-1], t[:, 1:], loss_mask_BS=mask_BS[part],
                                  advantages_B=adv_B[part],
                                  old_logp_BS=None if old is None else old[part]))
        return out

    mbs = micro_batches()
    targets = None
    if replay_mode == "r3":  # routes from "the engine": a fixed pseudo-random assignment
        g = torch.Generator().manual_seed(3)
        layers = local_layers_of(cfg, ctx)
        b, s = mbs[0].tokens_BS.shape
        targets = [router_view(torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k]
                                            for _ in range(b * s * cfg.num_layers)]
                                           ).reshape(b, s, cfg.num_layers, cfg.top_k), layers, ctx)
                   for _ in mbs]
    old, routes = logprob_pass(ddp, mbs, ctx, temperature=1.0, replay=replay,
                               record=replay_mode == "r2", targets=targets)
    old_rows = torch.cat(old)
    order = list(range(0, len(tokens_BS), 2)) + list(range(1, len(tokens_BS), 2))
    full = torch.empty_like(old_rows)
    full[torch.tensor(order)] = old_rows
    mbs = micro_batches(full + delta_BS)
    replayed = targets if replay_mode == "r3" else routes
    result = policy_update(ddp, opt, mbs, ctx, algo, temperature=1.0,
                           normalizer=normalizer_for(algo, mbs, ctx), guard=NonFiniteGuard(3),
                           where="test", replay=replay, targets=replayed)
    after, _ = logprob_pass(ddp, mbs, ctx, temperature=1.0, replay=replay, targets=replayed)
    return {"metrics": {k: float(v) for k, v in result.metrics.items()},
            "grad_norm": result.grad_norm, "after": torch.cat(after)[torch.tensor(order).argsort()],
            "values_sent": result.extra.get("cp_values_sent")}
