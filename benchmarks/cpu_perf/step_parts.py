"""The RL step's parts changed after profiling, each timed against the code it replaced.

Each row runs the replaced implementation (written out here as it was) and ours on the same inputs,
checks that they agree, and prints the median times (the two run alternately) and their ratio:

- packed attention: one SDPA call per packed sequence vs ``layers.packed_causal_attention``
  (length buckets), forward + backward; its gathers and writes by advanced indexing vs
  ``index_select`` / ``index_copy_``, with shared prompts; every bucket through SDPA's CPU kernel
  vs the short ones as batched matmuls (``backends.cpu.attention._MatmulBuckets``), forward + backward and
  forward only, at the compute and tiny shapes' heads; and its bucket plan built per sequence vs
  by whole-bucket operations;
- batch building: the step's rows and packed layouts per sample and segment vs by whole-batch
  operations (``rl_batch.build_batch``, ``Layout.packed_rows``);
- Adam: torch's AdamW as Megatron builds it without Apex / TE (per-parameter loop on CPU) vs the
  fused kernel (``optim.prefer_fused_adam``);
- non-finite check: ``isfinite(t).all()`` per gradient buffer vs one sum per buffer
  (``faults.all_finite``);
- seeded sampling: Gumbel-max on noise from a torch.Generator per row and step vs one
  counter-based uniform number per row and the inverse of its cumulative distribution
  (``local_engine.row_uniform``, ``sample_next``);
- expert weights in generation: stacking every layer's expert weights in each forward vs once per
  generation (``grouped_experts.cached_expert_weights``), over the forwards of one rollout;
- entropy: log-probs and entropy forward + backward with the entropy in the loss vs kept as a
  metric only (``entropy_coef`` 0: no entropy gradient);
- RoPE: megatron-core's unfused ``apply_rotary_pos_emb`` (cos / sin, and under packing the
  per-sequence table, made in every layer for q and k) vs ``models.rope.cache_rope_tables`` (made once
  per table / micro-batch), over the 6 layers of the compute shape: one decoding step, and one
  packed micro-batch forward + backward;
- experts: the CPU SwiGLU function's backward computing ``silu(a)`` again, the probabilities'
  gradient as a product and a sum and ``silu_backward`` copied into its half of the buffer vs
  ``grouped_experts._ExpertsSwiGLU`` (``silu(a)`` kept from the forward, ``vecdot``, written in
  place), forward + backward of the compute shape's 6 expert layers on one update's routed rows;
- experts' kernel: that function's Python loop (MKL splitting each product over the threads) vs its
  C++ kernel (``cpu_kernels.experts_swiglu``: whole experts per OpenMP thread), the same rows.

    python benchmarks/step_parts.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def timed(before, after, repeats: int) -> tuple:
    """Median seconds of ``before()`` and of ``after()``, run alternately (after one warm-up
    call each), so that a drift of the machine's speed weighs on both alike."""
    before(), after()
    times = ([], [])
    for _ in range(repeats):
        for fn, out in zip((before, after), times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def packed_attention(torch, F, repeats):
    from megatron_gspo.backends.cpu.attention import cpu_packed_attention as packed_causal_attention
    from megatron_gspo.models.layers import bucket_plan

    g = torch.Generator().manual_seed(0)
    # 128 sequences of a reverse-task batch: prompt + response, 12 to 31 tokens
    lengths = torch.randint(12, 32, (128,), generator=g).tolist()
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    t = bounds[-1]
    q0, k0, v0 = (torch.randn(t, n, 32, generator=g) for n in (4, 2, 2))

    def per_sequence(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
            enable_gqa=True).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])])

    def run(fn):
        def go():
            q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
            fn(q, k, v).square().sum().backward()
            return q.grad
        return go

    before, after = run(per_sequence), run(lambda q, k, v: packed_causal_attention(
        q, k, v, bucket_plan(bounds, "cpu")))
    assert torch.allclose(before(), after(), rtol=1e-4, atol=1e-5)
    return ("packed attention, 128 sequences of 12-31 tokens, fwd+bwd",
            *timed(before, after, repeats))


def _shared_prompt_bounds(torch, g, prompt: int, longest: int) -> tuple:
    """A packed row of 16 prompts (``prompt`` tokens fed once) x 2 rows of 2-``longest`` tokens:
    its ``bounds`` and ``prefix_of`` as ``layers.bucket_plan`` takes them."""
    bounds, prefix_of = [0], []
    for _ in range(16):
        prefix = len(prefix_of)
        bounds.append(bounds[-1] + prompt)
        prefix_of.append(-1)
        for n in torch.randint(2, longest + 1, (2,), generator=g).tolist():
            bounds.append(bounds[-1] + n)
            prefix_of.append(prefix)
    return tuple(bounds), tuple(prefix_of)


def _shared_prompt_batch(torch):
    """One packed micro-batch of the compute shape with shared prompts: 16 prompts (8 tokens fed
    once) x 2 rows of 2-24 tokens, 8 heads / 4 KV groups of 32: its plan and q, k, v."""
    from megatron_gspo.models.layers import bucket_plan

    g = torch.Generator().manual_seed(0)
    bounds, prefix_of = _shared_prompt_bounds(torch, g, 8, 24)
    plan = bucket_plan(bounds, "cpu", prefix_of)
    return plan, [torch.randn(bounds[-1], n, 32, generator=g) for n in (8, 4, 4)]


def _fwd_bwd(fn, qkv):
    def go():
        q, k, v = (x.clone().requires_grad_() for x in qkv)
        fn(q, k, v).square().sum().backward()
        return q.grad, k.grad, v.grad
    return go


def attention_gathers(torch, F, repeats):
    """Packed attention's per-bucket gathers and output writes by advanced indexing (as they
    were) vs ``index_select`` / ``index_copy_`` (``layers.packed_causal_attention``), on
    ``_shared_prompt_batch``, both with SDPA's kernel."""
    from megatron_gspo.backends.cpu.attention import cpu_packed_attention as packed_causal_attention

    plan, qkv = _shared_prompt_batch(torch)

    def indexed(q_TND, k_TGD, v_TGD):
        out = torch.empty_like(q_TND)
        for b in plan:
            q, k, v = (x[b.index].permute(0, 2, 1, 3) for x in (q_TND, k_TGD, v_TGD))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out[b.index[b.real]] = o.permute(0, 2, 1, 3)[b.real]
        return out

    before = _fwd_bwd(indexed, qkv)
    after = _fwd_bwd(lambda q, k, v: packed_causal_attention(q, k, v, plan, matmul_max_keys=0),
                     qkv)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(before(), after()))
    return (f"packed attention's gathers, shared prompts ({qkv[0].shape[0]} tokens), fwd+bwd",
            *timed(before, after, repeats))


def bucket_kernel(torch, repeats, heads, groups, backward):
    """Packed attention with every bucket through SDPA's kernel (``matmul_max_keys=0``: the code
    this replaced) vs the default (buckets of <= 32 key slots as ``backends.cpu.attention._MatmulBuckets``), on
    ``_shared_prompt_batch``'s plan with ``heads`` / ``groups`` of 32."""
    from megatron_gspo.backends.cpu.attention import cpu_packed_attention as packed_causal_attention
    from megatron_gspo.models.layers import bucket_plan

    g = torch.Generator().manual_seed(0)
    bounds, prefix_of = _shared_prompt_bounds(torch, g, 8, 24)
    plan = bucket_plan(bounds, "cpu", prefix_of)
    qkv = [torch.randn(bounds[-1], n, 32, generator=g) for n in (heads, groups, groups)]

    def run(fn):  # -> a tuple: the gradients of q, k, v, or the output
        return _fwd_bwd(fn, qkv) if backward else lambda: (fn(*qkv),)

    before = run(lambda q, k, v: packed_causal_attention(q, k, v, plan, matmul_max_keys=0))
    after = run(lambda q, k, v: packed_causal_attention(q, k, v, plan))
    with torch.set_grad_enabled(backward):
        # gradients up to ~35 here: fp32 rounding of a different summation order
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-4)
                   for a, b in zip(before(), after()))
        times = timed(before, after, repeats)
    return (f"packed attention, SDPA vs short buckets as matmuls ({heads}/{groups} heads), "
            f"{'fwd+bwd' if backward else 'fwd'}", *times)


def plan(torch, repeats):
    """A packed micro-batch's bucket plan (``layers.bucket_plan``, once per micro-batch), built
    sequence by sequence (as it was) vs by whole-bucket operations, for a tiny-shape micro-batch
    with shared prompts: 16 prompts of 6 tokens x 2 rows of 2-8 tokens."""
    from megatron_gspo.models.layers import Bucket, bucket_plan, length_buckets

    bounds, prefix_of = _shared_prompt_bounds(torch, torch.Generator().manual_seed(0), 6, 8)

    def per_sequence():
        starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        spans = [n + (lengths[p] if p >= 0 else 0) for n, p in zip(lengths, prefix_of)]
        out = []
        for bucket in length_buckets(spans):
            m = spans[bucket[0]]
            index = torch.zeros(len(bucket), m, dtype=torch.long)
            real = torch.zeros(len(bucket), m, dtype=torch.bool)
            for row, i in enumerate(bucket):
                keys = torch.arange(starts[i], starts[i] + lengths[i])
                if prefix_of[i] >= 0:
                    p = prefix_of[i]
                    keys = torch.cat([torch.arange(starts[p], starts[p] + lengths[p]), keys])
                index[row] = keys[0]
                index[row, :len(keys)] = keys
                real[row, len(keys) - lengths[i]:len(keys)] = True
            outputs = real.reshape(-1).nonzero()[:, 0]
            out.append(Bucket(index, real, index.reshape(-1), outputs,
                              index.reshape(-1)[outputs]))
        return out

    def whole_buckets():
        return bucket_plan(bounds, "cpu", prefix_of)

    assert all(torch.equal(getattr(a, f), getattr(b, f))
               for a, b in zip(per_sequence(), whole_buckets()) for f in Bucket.__annotations__)
    return (f"bucket plan of a micro-batch with shared prompts ({len(prefix_of)} sequences)",
            *timed(per_sequence, whole_buckets, repeats))


def batch_building(torch, repeats):
    """A tiny step's batch (128 samples: 16 prompts of 6 tokens x 8 responses of 1-8 tokens)
    padded into rows (``rl_batch.build_batch``) and packed into 4 micro-batch layouts of 32 rows
    (``Layout.packed_rows``, shared prompts): per sample and per segment (as it was) vs by
    whole-batch operations. (The trainer also sends every row's values through
    ``exchange_rows``, which now gathers them from whole-batch tables instead of per row.)"""
    from megatron_gspo.batch.layout import Layout, _Segment
    from megatron_gspo.batch.rollout_batch import build_batch
    from megatron_gspo.rollout.types import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(16):
        prompt = torch.randint(1, 100, (6,), generator=g).tolist()
        for n in torch.randint(1, 9, (8,), generator=g).tolist():
            samples.append(Sample(prompt, torch.randint(1, 100, (n,), generator=g).tolist(),
                                  torch.randn(n, generator=g), "stop"))
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples) - 1
    zeros = torch.zeros(len(samples))
    groups = [list(range(m, m + 32)) for m in range(0, 128, 32)]

    def segments_of(rows, lengths):  # packed_rows' segments, shared prompts of 5 tokens
        segs = [_Segment(rows[0], 0, 5, 5)]
        return segs + [_Segment(r, 5, n - 5, n - 5, 0, r) for r, n in zip(rows, lengths)]

    def per_sample():
        b = len(samples)
        tokens = torch.full((b, width + 1), 0, dtype=torch.long)
        mask, engine_logp = torch.zeros(b, width), torch.zeros(b, width)
        lengths = torch.zeros(b, dtype=torch.long)
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            tokens[i, :p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
            mask[i, p - 1:p - 1 + r] = 1.0
            engine_logp[i, p - 1:p - 1 + r] = s.logprobs_R.float()
            lengths[i] = p + r - 1
        out = [tokens, mask, engine_logp, lengths]
        for rows in groups:
            segs = []
            for k in range(0, 32, 8):  # each prompt's 8 rows share it
                part = rows[k:k + 8]
                first = segments_of(part, [int(lengths[r]) for r in part])
                segs += [s._replace(prefix=len(segs)) if s.prefix >= 0 else s for s in first]
            out += [torch.cat([torch.full((seg.tokens,), seg.row, dtype=torch.long)
                               for seg in segs]),
                    torch.cat([seg.first + torch.arange(seg.tokens) for seg in segs]),
                    torch.cat([torch.arange(seg.tokens) < seg.real for seg in segs])]
        return out

    def whole_batch():
        batch = build_batch(samples, zeros, zeros, width=width, pad_id=0)
        out = [batch.tokens_BS1, batch.mask_BS, batch.engine_logp_BS, batch.lengths_B]
        for rows in groups:
            layout = Layout.packed_rows(rows, [int(batch.lengths_B[r]) for r in rows],
                                        prefixes=[(r // 8, 5) for r in rows])
            out += [layout.row_N, layout.pos_N, layout.valid_N]
        return out

    assert all(torch.equal(a, b) for a, b in zip(per_sample(), whole_batch()))
    return ("building a tiny step's batch and its 4 packed layouts (128 samples)",
            *timed(per_sample, whole_batch, repeats))


def adam(torch, repeats, numel, tensors):
    def make(**kw):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(numel // tensors, generator=g))
              for _ in range(tensors)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0, **kw)
        return ps, opt

    ps_a, opt_a = make()
    ps_b, opt_b = make()
    for group in opt_b.param_groups:  # what optim.prefer_fused_adam does
        group["foreach"], group["fused"] = False, True
    opt_a.step()
    opt_b.step()
    # Within 1e-3 of the step size (lr): in torch's single-tensor AdamW on CPU, the process's
    # first fp32 ``torch.sqrt`` over a large tensor (its ``exp_avg_sq.sqrt()``) now and then
    # comes out ~2^-12 off on some elements (3 of 8 fresh processes; later calls, rsqrt and the
    # fused kernel never): updates 2.4e-7 off, which a 1e-7 tolerance tripped over.
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ps_a, ps_b))
    return (f"Adam step, {numel / 1e6:.0f}M parameters in {tensors} tensors",
            *timed(opt_a.step, opt_b.step, repeats))


def nonfinite(torch, repeats):
    buffers = [torch.randn(15_000_000), torch.randn(4_000_000)]

    def before():
        return all(bool(torch.isfinite(t).all()) for t in buffers)

    def after():
        return bool(torch.isfinite(torch.stack([t.sum() for t in buffers])).all())

    assert before() and after()
    return ("non-finite check, 19M gradients in 2 buffers", *timed(before, after, repeats))


def seeded_sampling(torch, repeats, vocab):
    from megatron_gspo.rollout.sampling import row_uniform, sample_next
    from megatron_gspo.rollout.types import SamplingParams

    seeds = list(range(1000, 1128))
    logits = torch.randn(len(seeds), vocab, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)

    def before():  # the replaced sampler: Gumbel-max on noise from a generator per row
        out = torch.empty(len(seeds), vocab)
        for r, seed in enumerate(seeds):
            gen = torch.Generator().manual_seed((seed * 1_000_003 + 5) % (2**63 - 1))
            out[r] = torch.rand(vocab, generator=gen)
        noise = -torch.log(-torch.log(out.clamp(1e-20, 1.0 - 1e-7)))
        return (torch.log_softmax(logits, -1) + noise).argmax(-1)

    seeds_t = torch.tensor(seeds)
    return (f"seeded sampling, 128 rows x {vocab} ids, one decoding step",
            *timed(before, lambda: sample_next(logits, params, uniform_B=row_uniform(seeds_t, 5)),
                   repeats))


def expert_stack(torch, repeats):
    # compute shape: 6 layers of 16 experts, fc1 [512, 256], fc2 [256, 256]; 25 forwards
    layers = [([torch.randn(512, 256) for _ in range(16)], [torch.randn(256, 256)
                                                           for _ in range(16)])
              for _ in range(6)]

    def before():
        for _ in range(25):
            for fc1, fc2 in layers:
                torch.stack(fc1), torch.stack(fc2)

    def after():
        cache = [(torch.stack(fc1), torch.stack(fc2)) for fc1, fc2 in layers]
        for _ in range(25):
            for w in cache:
                w[0], w[1]

    return ("expert weight stacks of a 24-token rollout (compute shape)",
            *timed(before, after, repeats))


def entropy(torch, repeats, vocab):
    from megatron_gspo.algorithms.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits0 = torch.randn(1, 1024, vocab, generator=g)
    targets = torch.randint(0, vocab, (1, 1024), generator=g)

    def run(detach):
        def go():
            logits = logits0.clone().requires_grad_()
            logp, ent = token_logprobs(logits, targets, group=None, with_entropy=True)
            if detach:
                ent = ent.detach()
            (logp.sum() - 0.0 * ent.sum()).backward()
            return logits.grad
        return go

    assert torch.allclose(run(False)(), run(True)())
    return (f"log-probs + entropy fwd+bwd, 1024 tokens x {vocab} vocab, entropy_coef 0",
            *timed(run(False), run(True), repeats))


def rope(torch, repeats, packed):
    import torch.distributed as dist
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_gspo.models import rope as rope_tables

    if not dist.is_initialized():  # (a store on a port the system picks)
        dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0,
                                world_size=1)
    cp = dist.new_group([0])
    config = TransformerConfig(num_layers=6, hidden_size=256, num_attention_heads=8)
    rope_tables.cache_rope_tables()
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    g = torch.Generator().manual_seed(0)
    if packed:  # 32 sequences of 20-40 tokens, q and k of 6 layers, forward + backward
        lengths = torch.randint(20, 41, (32,), generator=g)
        total = int(lengths.sum())
        q0, k0 = torch.randn(total, 8, 32, generator=g), torch.randn(total, 4, 32, generator=g)
    else:  # one decoding step of 128 rows at position 30
        q0, k0 = torch.randn(1, 128, 8, 32, generator=g), torch.randn(1, 128, 4, 32, generator=g)

    def run(fn):
        def go():
            # A new table and a new micro-batch each time, as each step / micro-batch brings.
            table = torch.outer(torch.arange(64, dtype=torch.float32), inv)
            table = torch.cat([table, table], -1)[:, None, None, :]
            kw = {"cp_group": cp}
            if packed:
                kw["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int32),
                                              lengths.cumsum(0).to(torch.int32)])
                freqs = table[:41]
            else:
                freqs = table[30:31]
            q, k = q0.clone().requires_grad_(packed), k0.clone().requires_grad_(packed)
            outs = [fn(t, freqs, config, **kw) for _ in range(6) for t in (q, k)]
            if packed:
                sum(o.sum() for o in outs).backward()
                return torch.cat([q.grad.flatten(), k.grad.flatten()])
            return torch.cat([o.flatten() for o in outs])
        return go

    assert torch.equal(run(rope_utils.apply_rotary_pos_emb)(), run(attention.apply_rotary_pos_emb)())
    name = (f"RoPE, packed micro-batch of 32 sequences ({q0.shape[0]} tokens), 6 layers, fwd+bwd"
            if packed else "RoPE, one decoding step of 128 rows, 6 layers")
    return (name, *timed(run(rope_utils.apply_rotary_pos_emb),
                         run(attention.apply_rotary_pos_emb), repeats))


def experts_swiglu(torch, repeats):
    import torch.nn.functional as F

    from megatron_gspo.backends.cpu import experts as ge

    class Replaced(ge._ExpertsSwiGLU):  # its forward and backward before the change
        @staticmethod
        def forward(ctx, x_TH, probs_T, bounds, n, kernel, *weights):
            fc1, fc2 = weights[:n], weights[n:]
            h_TF2 = x_TH.new_empty(x_TH.shape[0], fc1[0].shape[0])
            for (r0, r1), w in zip(bounds, fc1):
                torch.mm(x_TH[r0:r1], w.t(), out=h_TF2[r0:r1])
            f = h_TF2.shape[1] // 2
            sb_TF = F.silu(h_TF2[:, :f]).mul_(h_TF2[:, f:])
            g_TF = sb_TF * probs_T.unsqueeze(-1)
            out_TH = x_TH.new_empty(x_TH.shape[0], fc2[0].shape[0])
            for (r0, r1), w in zip(bounds, fc2):
                torch.mm(g_TF[r0:r1], w.t(), out=out_TH[r0:r1])
            ctx.save_for_backward(x_TH, probs_T, h_TF2, sb_TF, g_TF, *weights)
            ctx.bounds, ctx.n = bounds, n
            return out_TH

        @staticmethod
        def backward(ctx, grad_TH):
            x_TH, probs_T, h_TF2, sb_TF, g_TF, *weights = ctx.saved_tensors
            fc1, fc2, bounds = weights[:ctx.n], weights[ctx.n:], ctx.bounds
            grad_TH = grad_TH.contiguous()
            dg_TF = torch.empty_like(g_TF)
            d_fc2 = []
            for (r0, r1), w in zip(bounds, fc2):
                torch.mm(grad_TH[r0:r1], w, out=dg_TF[r0:r1])
                d_fc2.append(ge._weight_grad(w, grad_TH[r0:r1].t(), g_TF[r0:r1]))
            d_probs = (dg_TF * sb_TF).sum(-1)
            dsb_TF = dg_TF.mul_(probs_T.unsqueeze(-1))
            f = h_TF2.shape[1] // 2
            a_TF, b_TF = h_TF2[:, :f], h_TF2[:, f:]
            dh_TF2 = torch.empty_like(h_TF2)
            torch.mul(dsb_TF, F.silu(a_TF), out=dh_TF2[:, f:])
            dh_TF2[:, :f] = torch.ops.aten.silu_backward(dsb_TF.mul_(b_TF), a_TF)
            dx_TH = torch.empty_like(x_TH)
            d_fc1 = []
            for (r0, r1), w in zip(bounds, fc1):
                torch.mm(dh_TF2[r0:r1], w, out=dx_TH[r0:r1])
                d_fc1.append(ge._weight_grad(w, dh_TF2[r0:r1].t(), x_TH[r0:r1]))
            return (dx_TH, d_probs, None, None, None, *d_fc1, *d_fc2)

    layers, bounds = _expert_layers(torch)
    run = functools.partial(_run_experts, torch, layers, bounds)
    assert all(torch.equal(a, b) for a, b in zip(run(Replaced)(), run(ge._ExpertsSwiGLU)()))
    return ("experts' SwiGLU fwd+bwd, 6 layers x 16 experts, 3,219 rows (compute shape)",
            *timed(run(Replaced), run(ge._ExpertsSwiGLU), repeats))


def experts_kernel(torch, repeats):
    from megatron_gspo.backends.cpu import kernels as cpu_kernels
    from megatron_gspo.backends.cpu import experts as ge

    kernel = cpu_kernels.experts_swiglu()
    if kernel is None:
        raise SystemExit("the experts' C++ kernel did not build (see the log line above)")
    layers, bounds = _expert_layers(torch)
    run = functools.partial(_run_experts, torch, layers, bounds, ge._ExpertsSwiGLU)
    loop, fast = run(None), run(kernel)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(loop(), fast()))
    return ("experts' SwiGLU fwd+bwd, PyTorch loop vs C++ kernel (whole experts per thread)",
            *timed(loop, fast, repeats))


def _expert_layers(torch):
    # compute shape: 6 layers of 16 experts (fc1 [512, 256], fc2 [256, 256]) with DDP's
    # main_grad buffers; rows per expert as one update's router gave them (3,219 in all)
    g = torch.Generator().manual_seed(0)
    counts = [199, 313, 154, 257, 140, 195, 324, 201, 305, 245, 99, 158, 149, 188, 258, 195]
    ends = torch.tensor(counts).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    layers = []
    for _ in range(6):
        weights = ([torch.nn.Parameter(torch.randn(512, 256, generator=g) / 16) for _ in range(16)]
                   + [torch.nn.Parameter(torch.randn(256, 256, generator=g) / 16)
                      for _ in range(16)])
        for w in weights:
            w.main_grad = torch.zeros_like(w)
        x = torch.randn(ends[-1], 256, generator=g)
        layers.append((weights, x, torch.rand(ends[-1], generator=g),
                       torch.randn(ends[-1], 256, generator=g)))
    return layers, bounds


def _run_experts(torch, layers, bounds, fn, kernel=None):
    def go():
        grads = []
        for weights, x0, p0, dy in layers:
            x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
            fn.apply(x, p, bounds, 16, kernel, *weights).backward(dy)
            grads += [x.grad, p.grad]
        return grads
    return go


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    rows = [packed_attention(torch, F, args.repeats), attention_gathers(torch, F, args.repeats),
            *(bucket_kernel(torch, args.repeats, heads, groups, backward)
              for heads, groups in ((8, 4), (4, 2)) for backward in (True, False)),
            plan(torch, args.repeats),
            batch_building(torch, args.repeats),
            adam(torch, args.repeats, 1_000_000, 95), adam(torch, args.repeats, 19_000_000, 238),
            nonfinite(torch, args.repeats), seeded_sampling(torch, args.repeats, 128),
            seeded_sampling(torch, args.repeats, 151936), expert_stack(torch, args.repeats),
            entropy(torch, args.repeats, 32768), rope(torch, args.repeats, False),
            rope(torch, args.repeats, True), experts_swiglu(torch, args.repeats),
            experts_kernel(torch, args.repeats)]
    print(f"{args.threads} threads, median of {args.repeats}, before and after run alternately "
          "(ms); before = the replaced code")
    print(f"{'part':72s} {'before':>9s} {'after':>9s} {'speed-up':>9s}")
    for name, before, after in rows:
        print(f"{name:72s} {1e3 * before:9.1f} {1e3 * after:9.1f} {before / after:8.1f}x")


if __name__ == "__main__":
    main()
