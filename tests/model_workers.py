"""Functions that run on every spawned rank of the model tests (importable by child processes)."""

from __future__ import annotations

import functools
import json
import os

import torch


def tiny_model_config(hf_dir):
    from megatron_gspo.models.hf_config import model_config_from_hf

    with open(os.path.join(hf_dir, "config.json")) as f:
        return model_config_from_hf(json.load(f))


def logprob_pass(gpt, ctx, tokens_BS, micro_batches=1, backward=True):
    """Forward (+ backward) over ``tokens_BS`` split into micro-batches; last stage gets logp."""
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward
    from megatron_gspo.algorithms.logprobs import token_logprobs

    def loss_fn(mb, logits):
        logp, ent = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, with_entropy=True)
        return -logp.mean(), {"logp": logp.detach(), "entropy": ent.detach()}

    mbs = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens_BS.chunk(micro_batches)]
    out = forward_backward(gpt, mbs, ctx, loss_fn, forward_only=not backward)
    if not out:
        return None, None
    return torch.cat([o["logp"] for o in out]), torch.cat([o["entropy"] for o in out])


def layout_job(hf_dir, parallel_kwargs, tokens_BS, export_dir=None):
    """Import the HF checkpoint into a layout, run forward+backward, optionally export it again."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.models.hf_mapping import export_hf, load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=0)
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    micro_batches = 2 if ctx.pp > 1 else 1
    logp, ent = logprob_pass(gpt, ctx, tokens_BS, micro_batches=micro_batches)
    grads = [p.grad for p in gpt.parameters() if p.grad is not None]
    result = {
        "logp": logp if ctx.tp_rank == 0 else None,
        "entropy": ent if ctx.tp_rank == 0 else None,
        "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
        "grad_sq": float(sum((g.double() ** 2).sum() for g in grads)),
        "params_with_grad": len(grads),
        "params": sum(1 for _ in gpt.parameters()),
    }
    if export_dir is not None:
        export_hf(gpt, cfg, ctx, export_dir)
    return result


def save_random_weights_job(model_kwargs, parallel_kwargs, tokens_BS, path):
    """Random init (seeded) in one layout, save a dist checkpoint, return its log-probs."""
    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.checkpoint.weights import save_weights

    cfg = ModelConfig(**model_kwargs)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=123)
    gpt = build_model(cfg, ctx)
    save_weights(gpt, path, cfg)
    logp, _ = logprob_pass(gpt, ctx, tokens_BS, micro_batches=2 if ctx.pp > 1 else 1,
                           backward=False)
    return logp if ctx.tp_rank == 0 else None


def load_weights_job(parallel_kwargs, tokens_BS, path):
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.checkpoint.weights import load_weights, read_model_config

    cfg = read_model_config(path)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=999)  # different init seed
    gpt = build_model(cfg, ctx)
    load_weights(gpt, path)
    logp, _ = logprob_pass(gpt, ctx, tokens_BS, micro_batches=2 if ctx.pp > 1 else 1,
                           backward=False)
    return logp if ctx.tp_rank == 0 else None


def malformed_hf_job(hf_dir):
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.models.hf_config import HFCheckpointError
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(), cfg, seed=0)
    gpt = build_model(cfg, ctx)
    try:
        load_hf_weights(gpt, hf_dir, cfg, ctx)
    except HFCheckpointError as e:
        return str(e)
    return None


def attention_vs_megatron_job():
    """SDPAttention against megatron's unfused DotProductAttention (GQA, causal) and against
    per-sequence attention for a packed (THD) batch."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.models.layers import SDPAttention
    from megatron_gspo.models.model import transformer_config
    from megatron_gspo.distributed.parallel import init_parallel

    m = ModelConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, head_dim=16)
    ctx = init_parallel(ParallelConfig(), m, seed=0)
    cfg = transformer_config(m, ctx)
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
              attention_type="self", pg_collection=ctx.pg)
    ours, theirs = SDPAttention(**kw), DotProductAttention(**kw)
    g = torch.Generator().manual_seed(0)
    s, b = 7, 2
    q = torch.randn(s, b, 4, 16, generator=g)
    k = torch.randn(s, b, 2, 16, generator=g)
    v = torch.randn(s, b, 2, 16, generator=g)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    dense_diff = (ours(q, k, v, None) - theirs(q, k, v, causal)).abs().max()

    # Packed: sequences of 3 and 4 tokens back to back equal attention over each on its own.
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=4, max_seqlen_kv=4)
    qp, kp, vp = q[:, 0], k[:, 0], v[:, 0]
    out_packed = ours(qp, kp, vp, None, packed_seq_params=packed)
    parts = [ours(qp[a:e, None], kp[a:e, None], vp[a:e, None], None)[:, 0]
             for a, e in ((0, 3), (3, 7))]
    packed_diff = (out_packed - torch.cat(parts)).abs().max()

    # Decoding: the last query against the whole key cache equals the last row of full attention.
    full = ours(q, k, v, None)
    last = ours(q[-1:], k, v, None)
    decode_diff = (full[-1:] - last).abs().max()
    return float(dense_diff), float(packed_diff), float(decode_diff)


def gspo_step_job(hf_dir, parallel_kwargs, tokens_BS, delta_BS, adv_B, mask_BS, algo):
    """One policy-gradient step through the Megatron model: old log-probs from a forward pass
    (perturbed by ``delta``), the policy loss, SGD; returns loss, grad norm and log-probs after."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward, last_stage_metrics
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.algorithms.losses import combine_metrics, policy_loss
    from megatron_gspo.models.model import build_model
    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer, zero_grads
    from megatron_gspo.distributed.parallel import init_parallel

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=0)
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    ddp, opt = wrap_and_build_optimizer(gpt, ctx, OptimConfig(optimizer="sgd", lr=0.5,
                                                              clip_grad=0.0,
                                                              use_distributed_optimizer=False))
    n_mb = 2  # the same micro-batches on every layout: MoE aux losses are per micro-batch
    old, _ = logprob_pass(ddp, ctx, tokens_BS, micro_batches=n_mb, backward=False)
    if old is not None:
        old = old + delta_BS
    valid = float((mask_BS.sum(1) > 0).sum())

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group)
        return policy_loss(algo, logp, mb.old_logp_BS, mb.advantages_B, mb.loss_mask_BS,
                           normalizer=valid)

    rows = list(range(tokens_BS.shape[0]))
    mbs = []
    for part in [rows[i::n_mb] for i in range(n_mb)]:
        t = tokens_BS[part]
        mbs.append(MicroBatch(t[:, :-1], t[:, 1:], old_logp_BS=None if old is None else old[part],
                              loss_mask_BS=mask_BS[part], advantages_B=adv_B[part]))
    zero_grads(ddp, opt)
    out = forward_backward(ddp, mbs, ctx, loss_fn)
    metrics = last_stage_metrics(out, ctx, functools.partial(combine_metrics, algo))
    _, grad_norm, _ = opt.step()
    after, _ = logprob_pass(ddp, ctx, tokens_BS, micro_batches=n_mb, backward=False)
    keep = ctx.tp_rank == 0
    return dict(metrics={k: float(v) for k, v in metrics.items()}, grad_norm=float(grad_norm),
                after=after if keep else None,
                before=None if old is None or not keep else old - delta_BS)


def packed_vs_padded_job(hf_dir, parallel_kwargs, sequences):
    """Log-probs of sequences packed in one THD row vs the same sequences as padded rows."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.distributed.seqshard import pack_sequences

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=0)
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    packed = pack_sequences(sequences, multiple_of=ctx.tp)

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group)
        return -logp.mean(), {"logp": logp.detach()}

    mb = MicroBatch(packed.tokens_1N, packed.targets_1N, packed.position_ids_1N,
                    cu_seqlens=packed.cu_seqlens)
    out = forward_backward(gpt, [mb], ctx, loss_fn, forward_only=True)
    packed_logp = out[0]["logp"][0] if out else None
    # The same sequences as a right-padded batch (causal: padding after a token cannot change it).
    width = max(len(x) for x in sequences) - 1
    width += (-width) % ctx.tp
    rows = torch.zeros(len(sequences), width + 1, dtype=sequences[0].dtype)
    for i, seq in enumerate(sequences):
        rows[i, :len(seq)] = seq
    out = forward_backward(gpt, [MicroBatch(rows[:, :-1], rows[:, 1:])], ctx, loss_fn,
                           forward_only=True)
    if out:
        padded_logp = out[0]["logp"]
        padded = [padded_logp[i, :len(seq) - 1] for i, seq in enumerate(sequences)]
    if packed_logp is None:
        return None
    return packed_logp[packed.valid_N], torch.cat(padded)


def rope_cache_job():
    """``layers.cache_rope_tables``' RoPE against megatron-core's own ``apply_rotary_pos_emb``
    (padded and packed, decoding slices, a partial rotary dim; values and gradients), on a real
    one-rank context-parallel group; returns what matched."""
    import torch.distributed as dist
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_gspo.models import rope

    dist.init_process_group("gloo", init_method="env://")
    cp = dist.new_group([0])
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    rope.cache_rope_tables()
    ours, theirs = attention.apply_rotary_pos_emb, rope_utils.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(5)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    table = torch.outer(torch.arange(40, dtype=torch.float32), inv)
    table = torch.cat([table, table], -1)[:, None, None, :]  # [40, 1, 1, 16], as RoPE makes it

    def both(t, freqs, **kw):
        kw.setdefault("cp_group", cp)
        a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
        out_a, out_b = ours(a, freqs, config, **kw), theirs(b, freqs, config, **kw)
        w = torch.randn(out_a.shape, generator=g)
        (out_a * w).sum().backward()
        (out_b * w).sum().backward()
        return torch.equal(out_a, out_b) and torch.equal(a.grad, b.grad)

    out = {}
    out["padded"] = both(torch.randn(12, 3, 4, 16, generator=g), table[:12])
    out["decoding_slices"] = all(both(torch.randn(1, 3, 4, 16, generator=g), table[s:s + 1])
                                 for s in (12, 13, 12))  # the same slice twice: from the cache
    out["partial_rotary"] = both(torch.randn(12, 3, 4, 24, generator=g), table[:12])
    # a view that narrows the table's last dim, and an odd rotary width (megatron's own tables
    # are neither, but the function takes them)
    out["narrowed_table_view"] = both(torch.randn(12, 3, 4, 16, generator=g), table[:12, ..., :8])
    odd = torch.randn(40, 1, 1, 7, generator=g)
    out["odd_rotary_width"] = both(torch.randn(12, 3, 4, 16, generator=g), odd[:12])
    cu = torch.tensor([0, 5, 12, 13, 20], dtype=torch.int32)
    out["packed"] = both(torch.randn(20, 4, 16, generator=g), table, cu_seqlens=cu)
    out["packed_table_of_the_pack"] = both(torch.randn(20, 4, 16, generator=g), table[:20],
                                           cu_seqlens=cu)
    # the bounds on the host (``PackedRows`` sets them): the same, without reading the device
    from megatron_gspo.debug import count_host_syncs

    cu_host = cu.clone()
    cu_host.packed_bounds = tuple(cu.tolist())
    t = torch.randn(20, 4, 16, generator=g)
    with count_host_syncs() as syncs:
        mine = ours(t, table, config, cu_seqlens=cu_host, cp_group=cp)
    out["packed_host_bounds"] = (syncs.total == 0 and torch.equal(
        mine, theirs(t, table, config, cu_seqlens=cu, cp_group=cp)))
    out["mscale_passed_on"] = both(torch.randn(12, 3, 4, 16, generator=g), table[:12],
                                   mscale=0.7)
    with torch.inference_mode():  # inference tensors have no version counter: megatron's path
        out["inference_mode"] = torch.equal(
            ours(torch.ones(3, 2, 4, 16), table[:3], config, cp_group=cp),
            theirs(torch.ones(3, 2, 4, 16), table[:3], config, cp_group=cp))
        frozen = table.clone()
    out["inference_table"] = both(torch.randn(3, 2, 4, 16, generator=g), frozen[:3])
    try:  # a table wider than the heads: megatron's own error
        ours(torch.ones(3, 2, 4, 8), table[:3], config, cp_group=cp)
        out["too_wide_refused"] = False
    except RecursionError:
        out["too_wide_refused"] = False
    except RuntimeError:
        out["too_wide_refused"] = True
    # The whole table's cos / sin are kept on it once per dtype (decoding slices are views of
    # them), and remade after an in-place change of the table.
    root = table if table._base is None else table._base  # slices keep their base's values
    out["cached_once"] = len(root._rope_kept) == 1
    before = ours(torch.ones(2, 1, 1, 16), table[:2], config, cp_group=cp)
    table.mul_(0.5)
    after = ours(torch.ones(2, 1, 1, 16), table[:2], config, cp_group=cp)
    out["remade_after_change"] = (not torch.equal(before, after) and torch.equal(
        after, theirs(torch.ones(2, 1, 1, 16), table[:2], config, cp_group=cp)))
    dist.destroy_process_group()
    return out
