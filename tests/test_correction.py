"""Rollout correction against the formulas written out here (fp64, 1e-12): the weights of every
mode, with fully masked rows and length-1 responses, and the policy losses that apply them."""

import math

import pytest
import torch

from megatron_gspo.algorithms.correction import rollout_weights
from megatron_gspo.algorithms.losses import DEFAULT_CLIP, policy_loss
from tests.test_losses import batch, value_and_grad

D = torch.float64


def ref_weights(old, engine, mask, mode, cap=2.0, low=0.5, high=2.0):
    """Row by row, token by token."""
    b, t = old.shape
    w = torch.zeros(b, t, dtype=D)
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j] > 0]
        if not idx:
            continue
        seq = math.exp(sum(float(old[i, j] - engine[i, j]) for j in idx) / len(idx))
        for j in idx:
            if mode == "none":
                w[i, j] = 1.0
            elif mode == "token_tis":
                w[i, j] = min(math.exp(float(old[i, j] - engine[i, j])), cap)
            elif mode == "seq_tis":
                w[i, j] = min(seq, cap)
            else:
                w[i, j] = 1.0 if low <= seq <= high else 0.0
    return w


def engine_of(old, seed=1, scale=0.8):
    g = torch.Generator().manual_seed(seed)
    return old + scale * torch.randn(old.shape, generator=g, dtype=D)


@pytest.mark.parametrize("mode", ["none", "token_tis", "seq_tis", "seq_mis"])
def test_weights_match_the_formulas(mode):
    _, old, _, mask = batch(3, b=8, t=6, lengths=[6, 1, 0, 3, 6, 2, 1, 5])
    engine = engine_of(old)
    weights, metrics = rollout_weights(old, engine, mask, mode=mode, cap=2.0, low=0.6, high=1.5)
    expected = ref_weights(old, engine, mask, mode, 2.0, 0.6, 1.5)
    assert (weights - expected).abs().max().item() <= 1e-12
    assert (weights[mask == 0] == 0).all() and not weights.requires_grad
    assert metrics["mean_weight"].item() == pytest.approx(
        float(expected[mask > 0].mean()), abs=1e-12)
    rows = [i for i in range(8) if mask[i].sum() > 0]  # the fully masked row is no sequence
    zero = sum(1 for i in rows if expected[i].sum() == 0)
    assert metrics["masked_fraction"].item() == pytest.approx(zero / len(rows), abs=1e-12)


def test_seq_mis_masks_exactly_the_sequences_outside_the_band():
    _, old, _, mask = batch(5, b=6, t=5, lengths=[5, 5, 1, 4, 3, 5])
    # An engine whose log-probs are off by a known amount per sequence: mean(old - engine) = c_i.
    shift = torch.tensor([0.0, 0.9, -0.9, 0.3, -0.3, 1.2], dtype=D)
    engine = old - shift[:, None]
    weights, metrics = rollout_weights(old, engine, mask, mode="seq_mis", low=0.5, high=2.0)
    inside = [0.5 <= math.exp(c) <= 2.0 for c in shift.tolist()]
    assert inside == [True, False, False, True, True, False]  # e^0.9 = 2.46, e^-0.9 = 0.41
    assert [bool(weights[i].sum() > 0) for i in range(6)] == inside
    assert metrics["masked_fraction"].item() == pytest.approx(3 / 6, abs=1e-12)


def test_local_engine_weights_are_one():
    _, old, _, mask = batch(2)
    for mode in ("token_tis", "seq_tis", "seq_mis"):
        weights, metrics = rollout_weights(old, old.clone(), mask, mode=mode)
        assert torch.equal(weights, mask) and metrics["masked_fraction"].item() == 0.0


def ref_weighted_loss(algo, logp, old, adv, mask, w, el, eh):
    """Token mean per sequence of the weighted per-token terms (grpo, gspo_token), or each
    sequence's GSPO term times its weight; mean over sequences with response tokens."""
    per_seq = []
    for i in range(logp.shape[0]):
        m = mask[i] > 0
        n = int(m.sum())
        if n == 0:
            continue
        lp, op, a, wt = logp[i][m], old[i][m], adv[i], w[i][m]
        if algo == "gspo":
            s = torch.exp((lp - op).sum() / n)
            per_seq.append(-wt[0] * torch.minimum(s * a, torch.clamp(s, 1 - el, 1 + eh) * a))
        elif algo == "gspo_token":
            s = torch.exp((lp - op).sum() / n)
            s_t = s.detach() * torch.exp(lp - lp.detach())
            per_seq.append((-wt * torch.minimum(s_t * a, torch.clamp(s_t, 1 - el, 1 + eh) * a))
                           .mean())
        else:
            r = torch.exp(lp - op)
            per_seq.append((-wt * torch.minimum(r * a, torch.clamp(r, 1 - el, 1 + eh) * a)).mean())
    return torch.stack(per_seq).mean()


@pytest.mark.parametrize("algo,mode", [("gspo", "seq_tis"), ("gspo", "seq_mis"),
                                       ("gspo_token", "token_tis"), ("gspo_token", "seq_tis"),
                                       ("grpo", "token_tis"), ("grpo", "seq_mis")])
def test_weighted_losses_match_the_formulas(algo, mode):
    spread = 0.0003 if algo != "grpo" else 0.3
    logp, old, adv, mask = batch(7, b=8, t=6, spread=spread, lengths=[6, 1, 0, 3, 6, 2, 1, 5])
    weights, _ = rollout_weights(old, engine_of(old, scale=0.5), mask, mode=mode, low=0.7,
                                 high=1.4)
    el, eh = DEFAULT_CLIP[algo]
    got, got_grad = value_and_grad(
        lambda x: policy_loss(algo, x, old, adv, mask, weights=weights)[0], logp)
    want, want_grad = value_and_grad(
        lambda x: ref_weighted_loss(algo, x, old, adv, mask, weights, el, eh), logp)
    assert abs(got.item() - want.item()) <= 1e-12
    assert (got_grad - want_grad).abs().max().item() <= 1e-12


def test_gspo_refuses_token_weights():
    logp, old, adv, mask = batch(1)
    weights, _ = rollout_weights(old, engine_of(old), mask, mode="token_tis")
    with pytest.raises(ValueError, match="one per sequence .*none, seq_tis, seq_mis"):
        policy_loss("gspo", logp, old, adv, mask, weights=weights)
    with pytest.raises(ValueError, match="valid: none, token_tis, seq_tis, seq_mis"):
        rollout_weights(old, old, mask, mode="tis")


SHIFTS = (0.0, 0.3, -1.5, 1.5)  # per response, by sum(response ids) % 4 (tests.sglang_standin)


def test_seq_mis_through_a_perturbed_engine(tiny_hf_checkpoint, tmp_path):
    """The stand-in SGLang server reports every log-prob of a response shifted by a known
    amount: seq MIS (band [0.5, 2]) zeroes exactly the responses whose ratio
    exp(mean(old - engine)) = exp(-shift) falls outside the band (shifts of +-1.5), keeps the
    others' advantages bitwise, and logs the masked fraction."""
    from tests.distributed import run_ranks
    from tests.sglang_standin import start
    from tests.sglang_workers import job, rollout_correction_job

    url, proc = start(tiny_hf_checkpoint, logprob_shifts=SHIFTS)
    try:
        cfg = job(tiny_hf_checkpoint, url, str(tmp_path / "run"),
                  algo={"name": "gspo", "rollout_correction": "seq_mis",
                        "rollout_correction_low": 0.5, "rollout_correction_high": 2.0})
        out = run_ranks(rollout_correction_job, 1, cfg)[0]
    finally:
        proc.kill()
        proc.join()
    assert out["mismatch"] > 0.1  # the engine disagrees (unperturbed: < 1e-4)
    masked = []
    for response, before, after in zip(out["responses"], out["before"], out["after"]):
        shift = SHIFTS[sum(response) % len(SHIFTS)]
        outside = not 0.5 <= math.exp(-shift) <= 2.0
        masked.append(outside)
        assert after == (0.0 if outside else before), (response, shift, before, after)
    assert 0 < sum(masked) < len(masked)  # both kinds occur
    got = out["metrics"]["train/rollout_correction/masked_fraction"]
    assert got == pytest.approx(sum(masked) / len(masked), abs=1e-12)


def ref_decoupled(prox, mu, mask, *, per_token: bool, cap: float, low: float, high: float):
    """w_i = min(g_i, C) 1[lo <= g_i <= hi], g_i = exp(mean_t(log pi_prox - log mu)) over the
    sequence's response tokens; per token, g_t = exp(log pi_prox - log mu)."""
    b, t = prox.shape
    w = torch.zeros(b, t, dtype=D)
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j] > 0]
        if not idx:
            continue
        seq = math.exp(sum(float(prox[i, j] - mu[i, j]) for j in idx) / len(idx))
        for j in idx:
            g = math.exp(float(prox[i, j] - mu[i, j])) if per_token else seq
            w[i, j] = min(g, cap) if low <= g <= high else 0.0
    return w


def ref_decoupled_gspo_loss(logp, prox, adv, mask, w, el, eh):
    """L = -(1/G) sum_i w_i min(s_i A_i, clip(s_i, 1 - el, 1 + eh) A_i),
    s_i = exp(sum_t m_t (log pi - log pi_prox) / sum_t m_t), over sequences with tokens."""
    terms = []
    for i in range(logp.shape[0]):
        m = mask[i] > 0
        if not bool(m.any()):
            continue
        s = torch.exp((logp[i][m] - prox[i][m]).sum() / int(m.sum()))
        wi = w[i][m][0]
        terms.append(-wi * torch.minimum(s * adv[i], torch.clamp(s, 1 - el, 1 + eh) * adv[i]))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("per_token", [False, True])
def test_decoupled_weights_match_the_formula(per_token):
    _, prox, _, mask = batch(11, b=8, t=6, lengths=[6, 1, 0, 3, 6, 2, 1, 5])
    mu = engine_of(prox, seed=4, scale=0.6)
    weights, metrics = rollout_weights(prox, mu, mask, mode="decoupled", cap=1.5, low=0.4,
                                       high=3.0, per_token=per_token)
    expected = ref_decoupled(prox, mu, mask, per_token=per_token, cap=1.5, low=0.4, high=3.0)
    assert (weights - expected).abs().max().item() <= 1e-12
    assert 0 < (expected[mask > 0] == 0).sum() < (mask > 0).sum()  # some masked, some not
    assert (expected[mask > 0] == 1.5).any()  # and some truncated at the cap


def test_decoupled_gspo_loss_and_gradient_match_the_formula():
    """The off-policy GSPO objective: the sequence ratio against pi_prox, times the detached
    truncated, masked sequence weight of pi_prox over the behaviour policy mu (float64)."""
    from megatron_gspo.algorithms.correction import weighted_advantages

    logp, prox, adv, mask = batch(13, b=8, t=6, spread=0.0003, lengths=[6, 1, 0, 3, 6, 2, 1, 5])
    mu = engine_of(prox, seed=5, scale=0.5)
    el, eh = DEFAULT_CLIP["gspo"]
    weights, _ = rollout_weights(prox, mu, mask, mode="decoupled", cap=1.5, low=0.5, high=2.0)
    adv_w = weighted_advantages("gspo", adv, weights, mask)
    got, got_grad = value_and_grad(lambda x: policy_loss("gspo", x, prox, adv_w, mask)[0], logp)
    w_ref = ref_decoupled(prox, mu, mask, per_token=False, cap=1.5, low=0.5, high=2.0)
    want, want_grad = value_and_grad(
        lambda x: ref_decoupled_gspo_loss(x, prox, adv, mask, w_ref, el, eh), logp)
    assert abs(got.item() - want.item()) <= 1e-12
    assert (got_grad - want_grad).abs().max().item() <= 1e-12
    # the gradient by central finite differences of the written-out loss
    h = 1e-6
    fd = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            e = torch.zeros_like(logp)
            e[i, j] = h
            fd[i, j] = (ref_decoupled_gspo_loss(logp + e, prox, adv, mask, w_ref, el, eh)
                        - ref_decoupled_gspo_loss(logp - e, prox, adv, mask, w_ref, el, eh)) / (2 * h)
    assert (got_grad - fd).abs().max().item() <= 1e-8


@pytest.mark.parametrize("algo", ["gspo", "gspo_token", "grpo"])
def test_decoupled_with_the_behaviour_policy_as_proximal_is_todays_loss(algo):
    """mu == pi_prox: every weight 1, the loss and its gradient bitwise today's."""
    from megatron_gspo.algorithms.correction import weighted_advantages

    logp, prox, adv, mask = batch(17, b=8, t=6, lengths=[6, 1, 0, 3, 6, 2, 1, 5])
    logp, prox, adv, mask = (x.float() for x in (logp, prox, adv, mask))
    weights, metrics = rollout_weights(prox, prox.clone(), mask, mode="decoupled",
                                       per_token=algo != "gspo")
    assert torch.equal(weights, mask) and metrics["masked_fraction"].item() == 0.0
    adv_w = weighted_advantages(algo, adv, weights, mask)
    today = value_and_grad(lambda x: policy_loss(algo, x, prox, adv, mask)[0], logp)
    decoupled = value_and_grad(lambda x: policy_loss(algo, x, prox, adv_w, mask)[0], logp)
    assert torch.equal(today[0], decoupled[0]) and torch.equal(today[1], decoupled[1])
