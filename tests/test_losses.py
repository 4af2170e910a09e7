"""Losses against the formulas written out here (fp64), and their invariances in one process."""

import pytest
import torch

from megatron_gspo.algorithms.losses import (DEFAULT_CLIP, policy_loss, sequence_totals,
                                             shard_policy_loss)
from megatron_gspo.distributed.seqshard import TokenShard

D = torch.float64


def ref_loss(algo, logp, old, adv, mask, el, eh, *, dual_clip=None, token_mean=False,
             ref=None, kl_coef=0.0, ent=None, ent_coef=0.0):
    """Direct implementation of the objectives (GSPO paper notation), sequence by sequence."""
    per_seq, tok_terms, n_tok = [], [], 0
    for i in range(logp.shape[0]):
        m = mask[i] > 0
        n = int(m.sum())
        if n == 0:
            continue
        lp, op = logp[i][m], old[i][m]
        a = adv[i] if adv.dim() == 1 else adv[i][m]
        if algo == "gspo":
            s = torch.exp((lp - op).sum() / n)
            seq = -torch.minimum(s * a, torch.clamp(s, 1 - el, 1 + eh) * a)
            tok = seq.expand(n) if token_mean else None
        elif algo == "gspo_token":
            s = torch.exp((lp - op).sum() / n)
            s_t = s.detach() * torch.exp(lp - lp.detach())
            tok = -torch.minimum(s_t * a, torch.clamp(s_t, 1 - el, 1 + eh) * a)
            seq = tok.mean()
        else:
            w = torch.exp(lp - op)
            obj = torch.minimum(w * a, torch.clamp(w, 1 - el, 1 + eh) * a)
            if dual_clip is not None:
                obj = torch.where(a < 0, torch.maximum(obj, dual_clip * a), obj)
            tok = -obj
            seq = tok.mean()
        if ref is not None:
            d = ref[i][m] - lp
            kl_t = torch.exp(d) - d - 1
            seq = seq + kl_coef * kl_t.mean()
        if ent is not None:
            seq = seq - ent_coef * ent[i][m].mean()
        per_seq.append(seq)
        if token_mean:
            tok_terms.append(tok.sum())
            n_tok += n
    if token_mean:
        return torch.stack(tok_terms).sum() / n_tok
    return torch.stack(per_seq).mean()


def batch(seed=0, b=5, t=7, spread=0.3, lengths=None):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=D) * 3
    old = logp + spread * torch.randn(b, t, generator=g, dtype=D)
    if lengths is None:
        lengths = [t, 1, 0, 4, 3][:b] + [t] * max(0, b - 5)  # full, length-1, fully masked, mixed
    mask = torch.zeros(b, t, dtype=D)
    for i, n in enumerate(lengths):
        mask[i, t - n:] = 1  # responses at the end of the row, prompt/padding before
    adv = torch.randn(b, generator=g, dtype=D)
    return logp, old, adv, mask


def value_and_grad(fn, logp):
    x = logp.clone().requires_grad_()
    loss = fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


CASES = [
    ("gspo", dict(spread=0.0003)),  # near the clip range: some sequences clipped, some not
    ("gspo", dict(spread=0.3)),
    ("gspo_token", dict(spread=0.0003)),
    ("grpo", dict(spread=0.3)),
]


@pytest.mark.parametrize("algo,kw", CASES)
def test_value_and_gradient_match_formula(algo, kw):
    for seed in range(4):
        logp, old, adv, mask = batch(seed, spread=kw["spread"])
        el, eh = DEFAULT_CLIP[algo]
        ours = value_and_grad(lambda x: policy_loss(algo, x, old, adv, mask)[0], logp)
        ref = value_and_grad(lambda x: ref_loss(algo, x, old, adv, mask, el, eh), logp)
        assert torch.allclose(ours[0], ref[0], atol=1e-12, rtol=0)
        assert torch.allclose(ours[1], ref[1], atol=1e-12, rtol=0)


def test_grpo_options_match_formula():
    logp, old, adv, mask = batch(3, spread=1.0)
    g = torch.Generator().manual_seed(9)
    ref_lp = logp + 0.2 * torch.randn(logp.shape, generator=g, dtype=D)
    ent = torch.rand(logp.shape, generator=g, dtype=D)
    for opts, ref_opts in [
        (dict(dual_clip=3.0), dict(dual_clip=3.0)),
        (dict(aggregation="token_mean"), dict(token_mean=True)),
        (dict(kl_coef=0.1, ref_logprobs=ref_lp), dict(ref=ref_lp, kl_coef=0.1)),
        (dict(entropy_coef=0.01, entropy=ent), dict(ent=ent, ent_coef=0.01)),
    ]:
        ours = value_and_grad(lambda x: policy_loss("grpo", x, old, adv, mask, **opts)[0], logp)
        ref = value_and_grad(lambda x: ref_loss("grpo", x, old, adv, mask, 0.2, 0.27, **ref_opts),
                             logp)
        assert torch.allclose(ours[0], ref[0], atol=1e-12), opts
        assert torch.allclose(ours[1], ref[1], atol=1e-12), opts


def test_gspo_kl_and_explicit_token_mean():
    logp, old, adv, mask = batch(4, spread=0.3)
    ref_lp = logp + 0.1
    ours = value_and_grad(lambda x: policy_loss("gspo", x, old, adv, mask, kl_coef=0.05,
                                                ref_logprobs=ref_lp)[0], logp)
    ref = value_and_grad(lambda x: ref_loss("gspo", x, old, adv, mask, 3e-4, 4e-4, ref=ref_lp,
                                            kl_coef=0.05), logp)
    assert torch.allclose(ours[0], ref[0], atol=1e-12) and torch.allclose(ours[1], ref[1], atol=1e-12)
    ours = value_and_grad(lambda x: policy_loss("gspo", x, old, adv, mask, aggregation="token_mean",
                                                allow_objective_change=True)[0], logp)
    ref = value_and_grad(lambda x: ref_loss("gspo", x, old, adv, mask, 3e-4, 4e-4, token_mean=True),
                         logp)
    assert torch.allclose(ours[0], ref[0], atol=1e-12) and torch.allclose(ours[1], ref[1], atol=1e-12)


@pytest.mark.parametrize("spread", [0.0002, 0.01, 0.5])
def test_gspo_and_gspo_token_agree_with_sequence_advantages(spread):
    logp, old, adv, mask = batch(1, spread=spread)
    a = value_and_grad(lambda x: policy_loss("gspo", x, old, adv, mask)[0], logp)
    b = value_and_grad(lambda x: policy_loss("gspo_token", x, old, adv, mask)[0], logp)
    c = value_and_grad(lambda x: policy_loss("gspo_token", x, old, adv[:, None].expand_as(mask),
                                             mask)[0], logp)
    for other in (b, c):
        assert torch.allclose(a[0], other[0], atol=1e-13)
        assert torch.allclose(a[1], other[1], atol=1e-13)


@pytest.mark.parametrize("algo", ["gspo", "gspo_token", "grpo"])
def test_on_policy_ratio_is_one_and_nothing_clipped(algo):
    logp, _, adv, mask = batch(2)
    _, metrics = policy_loss(algo, logp, logp.clone(), adv, mask)
    assert metrics["ratio_mean"].item() == 1.0
    assert metrics["ratio_min"].item() == 1.0 and metrics["ratio_max"].item() == 1.0
    assert metrics["clip_fraction"].item() == 0.0
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())


def test_clip_boundaries():
    # One token per sequence: s = exp(logp - old). Just inside vs just outside 1 + eps_high.
    eh = 4e-4
    old = torch.zeros(4, 1, dtype=D)
    logp = torch.log(torch.tensor([[1 + eh - 1e-9], [1 + eh + 1e-9], [1 - 3e-4 + 1e-9],
                                   [1 - 3e-4 - 1e-9]], dtype=D))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=D)
    mask = torch.ones(4, 1, dtype=D)
    x = logp.clone().requires_grad_()
    loss, metrics = policy_loss("gspo", x, old, adv, mask)
    loss.backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[:, 0] != 0).tolist() == [True, False, True, False]
    assert metrics["clip_fraction"].item() == 0.5


def test_dense_batch_split_into_micro_batches_sums_to_the_full_loss():
    logp, old, adv, mask = batch(5, b=8, spread=0.001, lengths=[7, 1, 0, 4, 3, 6, 2, 5])
    for algo in ("gspo", "gspo_token", "grpo"):
        full = value_and_grad(lambda x: policy_loss(algo, x, old, adv, mask)[0], logp)
        valid = float((mask.sum(1) > 0).sum())

        def split(x):
            return sum(policy_loss(algo, x[s], old[s], adv[s], mask[s], normalizer=valid)[0]
                       for s in (slice(0, 3), slice(3, 8)))

        parts = value_and_grad(split, logp)
        assert torch.allclose(full[0], parts[0], atol=1e-13)
        assert torch.allclose(full[1], parts[1], atol=1e-13)


def _packed(logp, old, adv, mask):
    """Drop the padding and concatenate the sequences (THD): a packed shard of the same batch."""
    keep = mask.reshape(-1) > 0
    dense = TokenShard.from_dense(logp, old, adv, mask)
    return dense.select(torch.nonzero(keep)[:, 0])


@pytest.mark.parametrize("algo", ["gspo", "gspo_token", "grpo"])
def test_packed_equals_padded(algo):
    logp, old, adv, mask = batch(6, spread=0.001)
    padded = value_and_grad(lambda x: policy_loss(algo, x, old, adv, mask)[0], logp)
    packed = value_and_grad(lambda x: shard_policy_loss(algo, _packed(x, old, adv, mask))[0], logp)
    assert torch.allclose(padded[0], packed[0], atol=1e-13)
    assert torch.allclose(padded[1], packed[1], atol=1e-13)


@pytest.mark.parametrize("algo", ["gspo", "gspo_token", "grpo"])
def test_sequences_split_across_micro_batches_use_totals(algo):
    logp, old, adv, mask = batch(7, b=4, t=8, spread=0.001, lengths=[8, 5, 2, 7])
    full = value_and_grad(lambda x: policy_loss(algo, x, old, adv, mask)[0], logp)

    def halves(x):
        shard = TokenShard.from_dense(x, old, adv, mask)
        first = torch.arange(x.numel()).reshape(x.shape)[:, :4].reshape(-1)
        second = torch.arange(x.numel()).reshape(x.shape)[:, 4:].reshape(-1)
        parts = [shard.select(first), shard.select(second)]
        totals = sequence_totals(algo, parts)
        return sum(shard_policy_loss(algo, p, totals=totals, normalizer=4.0)[0] for p in parts)

    split = value_and_grad(halves, logp)
    assert torch.allclose(full[0], split[0], atol=1e-13)
    assert torch.allclose(full[1], split[1], atol=1e-13)


def test_bad_options_are_errors():
    logp, old, adv, mask = batch(0)
    with pytest.raises(ValueError, match="unknown algo 'ppo'; valid: grpo, gspo, gspo_token"):
        policy_loss("ppo", logp, old, adv, mask)
    with pytest.raises(ValueError, match="unknown option.*dual_clip"):
        policy_loss("gspo", logp, old, adv, mask, dual_clip=3.0)
    with pytest.raises(ValueError, match="changes GSPO's objective"):
        policy_loss("gspo", logp, old, adv, mask, aggregation="token_mean")
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss("grpo", logp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss("gspo", logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="one per sequence"):
        policy_loss("gspo", logp, old, adv[:, None].expand_as(mask), mask)
