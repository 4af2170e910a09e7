"""Vocab-parallel chunked log-probs against the naive full log_softmax (fp64), on 1 and 2 ranks."""

import math

import pytest
import torch

from megatron_gspo.algorithms.logprobs import linear_token_logprobs, token_logprobs
from tests.distributed import run_ranks


def naive(logits, target, temperature=1.0):
    logq = torch.log_softmax(logits / temperature, -1)
    logp = logq.gather(-1, target[..., None])[..., 0]
    entropy = -(logq.exp() * logq).sum(-1)
    return logp, entropy


def _inputs(seed=0, shape=(3, 5), vocab=11, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=g)).to(dtype)
    target = torch.randint(0, vocab, shape, generator=g)
    return logits, target


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_naive(chunk, temperature):
    logits, target = _inputs()
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    logp, ent = token_logprobs(a, target, chunk_size=chunk, temperature=temperature,
                               with_entropy=True)
    ref_logp, ref_ent = naive(b, target, temperature)
    assert torch.allclose(logp, ref_logp, atol=1e-12)
    assert torch.allclose(ent, ref_ent, atol=1e-12)
    w1, w2 = torch.randn_like(logp), torch.randn_like(ent)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12)


def test_inplace_backward_gives_the_same_gradient():
    logits, target = _inputs(seed=2, vocab=30)
    a = logits.clone().requires_grad_()
    b = (logits.clone() * 1.0).requires_grad_()
    token_logprobs(a, target, chunk_size=2)[0].sum().backward()
    source = b * 1.0  # a non-leaf: the backward may overwrite it, as with output-layer logits
    token_logprobs(source, target, chunk_size=2, inplace_backward=True)[0].sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12)


def test_bounds():
    logits, target = _inputs(seed=3, vocab=50)
    logp, ent = token_logprobs(logits, target, with_entropy=True)
    assert (logp <= 0).all()
    assert (ent >= 0).all() and (ent <= math.log(50) + 1e-12).all()


def test_fp32_input_computes_in_fp32_and_bf16_upcasts():
    logits, target = _inputs(dtype=torch.bfloat16)
    logp, _ = token_logprobs(logits, target)
    assert logp.dtype == torch.float32
    ref, _ = naive(logits.float(), target)
    assert torch.allclose(logp, ref, atol=1e-5)


def test_shape_and_temperature_errors():
    logits, target = _inputs()
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(logits, target[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, target, temperature=0.0)


def _tp2_job(logits, target, weights):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    shard = logits.chunk(2, -1)[rank].clone().requires_grad_()
    logp, ent = token_logprobs(shard, target, group=dist.group.WORLD, chunk_size=3,
                               temperature=0.9, with_entropy=True)
    ((logp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return logp.detach(), ent.detach(), shard.grad


def test_vocab_parallel_tp2_matches_full_vocab():
    logits, target = _inputs(seed=5, vocab=12)
    weights = torch.randn(2, *target.shape, dtype=torch.float64)
    ranks = run_ranks(_tp2_job, 2, logits, target, weights)
    full = logits.clone().requires_grad_()
    ref_logp, ref_ent = naive(full, target, 0.9)
    ((ref_logp * weights[0]).sum() + (ref_ent * weights[1]).sum()).backward()
    for rank, (logp, ent, grad) in enumerate(ranks):
        assert (logp - ref_logp).abs().max() <= 1e-12
        assert (ent - ref_ent).abs().max() <= 1e-12
        assert (grad - full.grad.chunk(2, -1)[rank]).abs().max() <= 1e-12


def _linear_inputs(seed=8, n=(3, 5), h=6, v=14):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, n, generator=g)
    return hidden, weight, target


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_fused_linear_logprobs_match_naive(chunk):
    hidden, weight, target = _linear_inputs()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = linear_token_logprobs(h1, w1, target, chunk_size=chunk, temperature=0.8)
    ref, _ = naive(h2 @ w2.t(), target, 0.8)
    assert torch.allclose(ours, ref, atol=1e-12)
    weights = torch.randn_like(ours)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-12)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-12)


def _fused_tp2_job(hidden, weight, target, weights):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    h = hidden.clone().requires_grad_()
    w = weight.chunk(2, 0)[rank].clone().requires_grad_()
    logp = linear_token_logprobs(h, w, target, group=dist.group.WORLD, chunk_size=4)
    (logp * weights).sum().backward()
    return logp.detach(), h.grad, w.grad


def test_fused_linear_logprobs_vocab_parallel_tp2():
    hidden, weight, target = _linear_inputs(seed=9)
    weights = torch.randn(target.shape, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, _ = naive(h @ w.t(), target)
    (ref * weights).sum().backward()
    for rank, (logp, h_grad, w_grad) in enumerate(run_ranks(_fused_tp2_job, 2, hidden, weight,
                                                            target, weights)):
        assert (logp - ref).abs().max() <= 1e-12
        assert (h_grad - h.grad).abs().max() <= 1e-12
        assert (w_grad - w.grad.chunk(2, 0)[rank]).abs().max() <= 1e-12


def test_fused_linear_accumulates_into_main_grad():
    hidden, weight, target = _linear_inputs(seed=10)
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.ones_like(w)
    linear_token_logprobs(hidden, w, target).sum().backward()
    ref_w = weight.clone().requires_grad_()
    naive(hidden @ ref_w.t(), target)[0].sum().backward()
    assert w.grad is None and w.grad_added_to_main_grad
    assert torch.allclose(w.main_grad, 1 + ref_w.grad, atol=1e-12)
