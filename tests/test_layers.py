"""Local layer spec pieces: SDPA core attention (dense, packed per sequence, decoding)."""

import pytest

from tests.distributed import run_ranks
from tests.model_workers import attention_vs_megatron_job


def test_sdpa_attention_matches_megatron_unfused_attention():
    dense, packed, decode = run_ranks(attention_vs_megatron_job, 1)[0]
    assert dense <= 1e-6
    assert packed <= 1e-6
    assert decode <= 1e-6


def test_length_buckets_cover_every_sequence_within_the_ratio():
    from megatron_gspo.models.layers import length_buckets

    lengths = [5, 0, 40, 19, 20, 1, 11, 39, 3]
    buckets = length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == [0, 2, 3, 4, 5, 6, 7, 8]  # not the empty one
    assert buckets == [[2, 7, 4], [3, 6], [0, 8], [5]]
    for b in buckets:
        assert all(2 * lengths[i] >= lengths[b[0]] for i in b)


def test_bucket_plan_of_shared_prefixes_written_out():
    """Row tokens 0-2 a prompt, 3-4 a response to it, an empty response to it, 5-8 a sequence
    of its own: one bucket of 5 key slots, each sequence's keys (its prompt's first), padded
    with its first key; outputs only at its own tokens."""
    import torch

    from megatron_gspo.models.layers import bucket_plan

    (bucket,) = bucket_plan((0, 3, 5, 5, 9), "cpu", (-1, 0, 0, -1))
    assert bucket.index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 5], [0, 1, 2, 0, 0],
                                     [0, 1, 2, 0, 0]]
    assert bucket.real.int().tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0],
                                          [0, 0, 0, 0, 0]]
    assert bucket.keys.tolist() == bucket.index.reshape(-1).tolist()
    assert bucket.outputs.tolist() == [3, 4, 5, 6, 7, 8, 10, 11, 12]
    assert bucket.rows.tolist() == [3, 4, 5, 6, 7, 8, 0, 1, 2]
    assert bucket.index.dtype == bucket.outputs.dtype == torch.long


@pytest.mark.parametrize("backend", ["generic", "cpu"])
def test_packed_causal_attention_equals_each_sequence_alone_with_gradients(backend):
    """Buckets of right-padded sequences: outputs and the gradients of q, k, v equal causal SDPA
    on each sequence alone (GQA; lengths over several buckets, one of them a single token; the
    generic function runs every bucket through SDPA, the CPU backend's the short ones through
    its matmul kernel and one of 40-70 keys through SDPA's)."""
    import torch
    import torch.nn.functional as F

    from megatron_gspo.backends.cpu.attention import cpu_packed_attention
    from megatron_gspo.models.layers import bucket_plan, packed_causal_attention

    attend = packed_causal_attention if backend == "generic" else cpu_packed_attention

    g = torch.Generator().manual_seed(0)
    lengths = [9, 1, 4, 17, 40, 8, 16, 70, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    q0, k0, v0 = (torch.randn(t, n, 8, generator=g) for n in (4, 2, 2))
    weight = torch.randn(t, 4, 8, generator=g)

    def grads(fn):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = fn(q, k, v)
        (out * weight).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    def alone(q, k, v):
        parts = []
        for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            parts.append(F.scaled_dot_product_attention(
                *(x[a:e].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                enable_gqa=True).transpose(0, 1))
        return torch.cat(parts)

    ours = grads(lambda q, k, v: attend(q, k, v, bucket_plan(cu.tolist(), "cpu")))
    reference = grads(alone)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32 rounding, not masking


def test_packed_attention_kernels_agree_and_short_buckets_take_the_matmuls():
    """The same packed row with shared prefixes through both kernels (buckets of <= 64 key slots
    as ``_MatmulBuckets``, or every bucket through SDPA with ``matmul_max_keys=0``): the same
    outputs and gradients within fp32 rounding; the default puts the short buckets on the
    matmuls (the autograd graph says which ran) and leaves a 70-key bucket on SDPA."""
    import torch

    from megatron_gspo.backends.cpu.attention import cpu_packed_attention
    from megatron_gspo.models.layers import bucket_plan

    g = torch.Generator().manual_seed(3)
    bounds, prefix_of = [0], []
    for prompt, tails in ((6, (3, 20)), (5, (9, 1, 0)), (40, (30,)), (4, ())):
        prefix = len(prefix_of)
        bounds.append(bounds[-1] + prompt)
        prefix_of.append(-1)
        for n in tails:
            bounds.append(bounds[-1] + n)
            prefix_of.append(prefix)
    plan = bucket_plan(tuple(bounds), "cpu", tuple(prefix_of))
    assert sorted(b.index.shape[1] for b in plan) == [4, 9, 26, 70]
    t = bounds[-1] + 2  # two padding tokens after the last sequence
    q0, k0, v0 = (torch.randn(t, n, 16, generator=g) for n in (6, 3, 3))
    weight = torch.randn(t, 6, 16, generator=g)
    weight[bounds[-1]:] = 0

    def run(**kw):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = cpu_packed_attention(q, k, v, plan, **kw)
        (out * weight).sum().backward()
        nodes, todo = set(), [out.grad_fn]
        while todo:  # the autograd graph's node names
            node = todo.pop()
            nodes.add(node.name())
            todo += [f for f, _ in node.next_functions if f is not None]
        return {n for n in nodes if "Matmul" in n or "Flash" in n}, [
            out.detach()[:bounds[-1]], q.grad, k.grad, v.grad]

    kernels, ours = run()
    assert kernels == {"_MatmulBucketsBackward", "ScaledDotProductFlashAttentionForCpuBackward0"}
    kernels, sdpa = run(matmul_max_keys=0)
    assert kernels == {"ScaledDotProductFlashAttentionForCpuBackward0"}
    assert run(matmul_max_keys=70)[0] == {"_MatmulBucketsBackward"}
    for a, b in zip(ours, sdpa):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours[1][bounds[-1]:].abs().max() == 0  # padding tokens get no gradient


@pytest.mark.parametrize("heads,groups,masked", [(8, 4, True), (4, 4, False), (6, 1, True)])
def test_decode_attention_is_the_written_out_formula(heads, groups, masked):
    """One query per row: softmax(q K^T / sqrt(d) with -inf at masked keys) V per query head,
    K and V of its group, float64; rows left-padded by different amounts."""
    import torch

    from megatron_gspo.backends.cpu.attention import decode_attention

    g = torch.Generator().manual_seed(2)
    b, s, d = 4, 9, 5
    q = torch.randn(b, heads, 1, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, groups, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    hidden = torch.arange(s)[None, :] < torch.tensor([0, 2, 5, 8])[:, None]  # [b, s]
    mask = hidden[:, None, None, :] if masked else None

    out = torch.empty(b, heads, 1, d, dtype=torch.float64)
    for i in range(b):
        for h in range(heads):
            kv = h // (heads // groups)
            scores = q[i, h] @ k[i, kv].T / d ** 0.5
            if masked:
                scores = scores.masked_fill(hidden[i], float("-inf"))
            out[i, h] = torch.softmax(scores, -1) @ v[i, kv]
    torch.testing.assert_close(decode_attention(q, k, v, mask), out, rtol=1e-12, atol=1e-12)


def test_cached_rope_equals_megatrons():
    """RoPE with cos / sin kept per table gives megatron-core's values and gradients bitwise."""
    from tests.distributed import run_ranks
    from tests.model_workers import rope_cache_job

    seen = run_ranks(rope_cache_job, 1)[0]
    assert seen == {k: True for k in seen} and len(seen) == 14, seen


@pytest.mark.parametrize("shape", [(7, 2, 16), (5, 1, 3, 8)], ids=["hidden", "heads"])
def test_cpu_rms_norm_is_torchs_forward_and_the_written_out_backward(shape):
    """layers.RMSNorm under autograd on CPU: torch.rms_norm's forward to the bit (fp32 and
    fp64); gradients against autograd through torch.rms_norm and against the formula
    dx = rstd (g w - x^ mean(g w x^)), dw = sum over tokens of g x^ (fp64, 1e-12); without
    autograd the module is torch's own."""
    from types import SimpleNamespace

    import torch

    from megatron_gspo.backends.cpu.norm import CPURMSNorm as RMSNorm

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        config = SimpleNamespace(params_dtype=dtype, sequence_parallel=False)
        norm = RMSNorm(config, shape[-1], eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(shape[-1], dtype=dtype))
        x = (3 * torch.randn(*shape, dtype=dtype)).requires_grad_()
        g = torch.randn(*shape, dtype=dtype)
        y = norm(x)
        assert y.grad_fn.name().endswith("_RMSNormCPUBackward")
        ref = torch.rms_norm(x, (shape[-1],), norm.weight, 1e-5)
        assert torch.equal(y, ref)
        dx, dw = torch.autograd.grad(y, (x, norm.weight), g)
        rx, rw = torch.autograd.grad(ref, (x, norm.weight), g)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert torch.allclose(dx, rx, atol=tol, rtol=0) and torch.allclose(dw, rw, atol=tol, rtol=0)
        if dtype == torch.float64:
            w = norm.weight.detach()
            rstd = 1 / torch.sqrt((x.detach() ** 2).mean(-1, keepdim=True) + 1e-5)
            xhat = x.detach() * rstd
            formula_dx = rstd * (g * w - xhat * (g * w * xhat).mean(-1, keepdim=True))
            formula_dw = (g * xhat).reshape(-1, shape[-1]).sum(0)
            assert torch.allclose(dx, formula_dx, atol=1e-12, rtol=0)
            assert torch.allclose(dw, formula_dw, atol=1e-12, rtol=0)
        with torch.no_grad():
            assert norm(x).grad_fn is None and torch.equal(norm(x), ref.detach())
