"""The in-process engine: its log-probs and routes are the trainer's, the KV cache changes nothing."""

import pytest

from tests.distributed import run_layouts
from tests.engine_workers import (big_batch_job, cache_vs_recompute_job, decode_path_job,
                                  direct_decode_job, engine_vs_trainer_job, rotated_cache_job,
                                  stop_job)

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [1]]


# Stop ids that end about one response in five per token: rows finish at different steps, and
# the decoding batch compacts.
STOPS = tuple(range(0, 128, 5))

CASES = [
    (1, {}, dict(max_new_tokens=6, temperature=1.0, seed=0, stop_token_ids=STOPS)),
    (1, {}, dict(max_new_tokens=5, temperature=0.7, top_k=10, top_p=0.9, seed=1)),
    (1, {}, dict(max_new_tokens=5, temperature=0.0)),
    (2, dict(ep=2), dict(max_new_tokens=5, temperature=1.0, seed=2, stop_token_ids=STOPS)),
    (2, dict(tp=2, sequence_parallel=True), dict(max_new_tokens=5, temperature=1.0, seed=3)),
    (4, dict(tp=2, ep=2, sequence_parallel=True), dict(max_new_tokens=4, temperature=0.0)),
    (2, dict(pp=2), dict(max_new_tokens=6, temperature=1.0, seed=4, stop_token_ids=STOPS)),
]


@pytest.fixture(scope="module")
def runs():
    """Every engine job, one spawn per world size: {"layouts": per case, per rank results,
    "stop", "cache", "big_batch", "rotated", "direct", "direct_dense", "path_shared",
    "path_sigmoid", "path_width", "kernel_off"}."""
    out = {"layouts": [None] * len(CASES)}
    for world in sorted({w for w, _, _ in CASES}):
        index = [i for i, (w, _, _) in enumerate(CASES) if w == world]
        cases = [(engine_vs_trainer_job, (CASES[i][1], PROMPTS, CASES[i][2])) for i in index]
        extra = ["stop", "cache", "big_batch", "rotated", "direct", "direct_dense",
                 "path_shared", "path_sigmoid", "path_width", "kernel_off"] if world == 1 else []
        cases += [(stop_job, (PROMPTS,)), (cache_vs_recompute_job, (PROMPTS, 8)),
                  (big_batch_job, (64, 6)), (rotated_cache_job, (PROMPTS,)),
                  (direct_decode_job, (PROMPTS, {})),
                  # a dense first layer, softmax over all experts before the top-k
                  (direct_decode_job, (PROMPTS, dict(first_k_dense=1, norm_topk_prob=False))),
                  (decode_path_job, (dict(shared_expert_ffn_hidden_size=32),)),
                  (decode_path_job, (dict(router_score_function="sigmoid"),)),
                  # an expert width grouped_mm cannot take (the experts loop instead)
                  (decode_path_job, (dict(moe_ffn_hidden_size=30),)),
                  # the experts' C++ kernel off: generation through grouped_mm's cached stacks,
                  # the trainer through grouped_mm (experts below swiglu_cpu_min_weight)
                  (engine_vs_trainer_job, ({}, PROMPTS, dict(max_new_tokens=5, temperature=1.0,
                                                             seed=5),
                                           dict(cpu_experts_kernel=False)))][:len(extra)]
        results = run_layouts(world, cases)
        for i, per_rank in zip(index, results):
            out["layouts"][i] = per_rank
        for key, per_rank in zip(extra, results[len(index):]):
            out[key] = per_rank[0]
    return out


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"world{w}-{'-'.join(map(str, layout.values())) or 'single'}"
                              for w, layout, _ in CASES])
def test_engine_logprobs_and_routes_equal_the_trainers(runs, case):
    stops = CASES[case][2].get("stop_token_ids")
    per_rank = runs["layouts"][case]
    # one rank holding the whole model decodes through decode_step, split models through their
    # forward
    assert all(r["direct_decode"] == (CASES[case][0] == 1) for r in per_rank)
    # log-probs on the last pipeline stage's ranks, routes on every rank's own MoE layers
    assert any(r["worst_logp"] is not None for r in per_rank)
    for r in per_rank:
        assert r["worst_logp"] is None or r["worst_logp"] <= 1e-5
        assert r["compared"] == 4 * len(PROMPTS) and r["route_layers"] > 0
        assert r["routes_equal"] and r["shapes_ok"]
        assert r["all_logp_nonpositive"]
        # fp32 SwiGLU experts on CPU generate through the C++ kernel (cpu_kernels)
        assert r["generation_paths"] == ["swiglu_cpu_kernel"], r["generation_paths"]
        # No full-vocabulary logits for prompt positions: the prefill gives the last one only,
        # and runs each prompt once (not once per sample).
        shapes = r["logit_shapes"]
        assert all(s[1] == 1 for s in shapes) and (not shapes or shapes[0][0] == len(PROMPTS))
        rows = r["decode_rows"]  # rows fed per decoding forward: the batch only shrinks
        assert rows == sorted(rows, reverse=True) and rows[0] <= 4 * len(PROMPTS)
        if not stops:
            assert rows == [4 * len(PROMPTS)] * len(rows)
        else:  # rows ended at different steps, and finished rows left the batch
            assert len(set(r["lengths"])) >= 3 and "stop" in r["reasons"]
            assert rows[-1] < 4 * len(PROMPTS)
            # forward t feeds step t's tokens: every row still decoding (longer than t + 1)
            assert all(rows[t] >= sum(n > t + 1 for n in r["lengths"]) for t in range(len(rows)))


def test_engine_equals_the_trainer_with_the_cpu_kernel_off(runs):
    r = runs["kernel_off"]
    assert r["generation_paths"] == ["grouped"], r["generation_paths"]
    assert r["worst_logp"] is not None and r["worst_logp"] <= 1e-5
    assert r["compared"] == 4 * len(PROMPTS) and r["routes_equal"] and r["shapes_ok"]


def test_stop_tokens_end_responses(runs):
    free, stopped, reasons, stop_id = runs["stop"]
    for f, s, reason in zip(free, stopped, reasons):
        if stop_id in f:
            cut = f.index(stop_id) + 1
            assert s == f[:cut] and reason == "stop"
        else:
            assert s == f and reason == "length"
    assert reasons[0] == "stop" and len(stopped[0]) <= 3


def test_kv_cache_generation_equals_recomputation(runs):
    cached, recomputed = runs["cache"]
    assert cached == recomputed


def test_keys_cached_rotated_decode_as_megatrons_attention(runs):
    """The KV cache holds keys rotated once at their positions (RotatedCacheSelfAttention):
    tokens, log-probs and routes bitwise those of megatron's SelfAttention, which caches keys
    unrotated and rotates the whole cache in every decoding step."""
    ours, equal, lengths = runs["rotated"]
    assert ours
    assert len(equal) == 4 * len(PROMPTS) and all(all(e) for e in equal)
    assert len(set(lengths)) >= 3  # rows stopped at different steps: the batch compacted


@pytest.mark.parametrize("model", ["direct", "direct_dense"])
def test_direct_decode_step_equals_the_models_forward(runs, model):
    """decode_step (the engine's decoding on one rank) against the model's own forward: the same
    tokens and routes, log-probs within 1e-6, sampled with compaction and greedy; the engine's
    model, and one with a dense first layer and softmax over all experts before the top-k."""
    direct, cases = runs[model]
    assert direct
    for c in cases:
        assert c["tokens_equal"] and c["routes_equal"]
        assert c["worst_logp"] <= 1e-6
    sampled = cases[0]
    assert len(set(sampled["lengths"])) >= 3 and sampled["decode_rows"][-1] < 4 * len(PROMPTS)


def test_options_decode_step_does_not_mirror_keep_the_models_forward(runs):
    """A shared expert, sigmoid routing or experts that loop instead of grouped_mm: the engine
    decodes through the model's forward."""
    for key in ("path_shared", "path_sigmoid", "path_width"):
        direct, why = runs[key]
        assert not direct and why == "an MoE option this step does not mirror"


def test_batch_of_64_prompts_is_seeded_and_ordered(runs):
    first, again, index = runs["big_batch"]
    assert len(first) == 64 and all(len(r) == 6 for r in first)
    assert first == again
    assert index == list(range(64))


def test_logprobs_under_top_k_top_p_are_of_the_untruncated_distribution():
    """The engine samples from the truncated distribution but reports the log-prob of the full
    tempered softmax: the quantity the trainer recomputes (algo.old_logprobs=engine relies on it)."""
    import torch

    from megatron_gspo.rollout.sampling import sample_next
    from megatron_gspo.rollout.types import SamplingParams

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 16, generator=g)
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.7)
    token, logp = sample_next(logits, params, generator=g)
    probs = torch.softmax(logits / 0.8, -1)
    for row in range(64):
        p = probs[row]
        top = p.argsort(descending=True)[:4]  # top-k, then the smallest prefix reaching top_p
        cum = torch.cumsum(p[top], 0)
        kept = top[:int((cum - p[top] < 0.7).sum())]
        t = int(token[row])
        assert t in kept.tolist()
        assert abs(float(logp[row]) - float(torch.log(p[t]))) < 1e-5
        truncated = torch.log(p[t] / p[kept].sum())
        if len(kept) < 16:
            assert float(truncated) > float(logp[row])


def test_seeded_sampling_is_keyed_by_seed_and_step_and_follows_the_distribution():
    """One uniform number per row and step (a counter-based hash): uniform moments, a pure
    function of (seed, step) whatever the batch, another for another seed or step; inverting
    the cumulative distribution at it samples softmax(logits / T), and top-k / top-p keep only
    their tokens."""
    import math

    import torch

    from megatron_gspo.rollout.sampling import row_uniform, sample_next
    from megatron_gspo.rollout.types import SamplingParams

    seeds = torch.arange(200_000) * 7_919 + 2**40
    u = row_uniform(seeds, 3)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(u.std()) - math.sqrt(1 / 12)) < 0.003
    assert torch.equal(row_uniform(seeds[5:9], 3), u[5:9])  # batch-independent
    assert float((row_uniform(seeds, 4) - u).abs().mean()) > 0.3  # another step: other numbers
    assert len(set(u.tolist())) == len(u)

    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, -30.0]).expand(len(seeds), 5)
    token, logp = sample_next(logits, SamplingParams(temperature=0.8), uniform_B=u)
    freq = torch.bincount(token, minlength=5).double() / len(seeds)
    probs = torch.softmax(logits[0].double() / 0.8, 0)
    assert float((freq - probs).abs().max()) < 0.004
    assert torch.allclose(logp, torch.log(probs.float())[token])
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.8)  # top-3 {3, 0, 1}, then 80%
    token, _ = sample_next(logits, params, uniform_B=u)
    assert set(token.tolist()) == {3, 0}


@pytest.mark.parametrize("heads,groups", [(4, 2), (3, 3)])
def test_prefix_attention_is_the_written_out_formula(heads, groups):
    """The direct prefill's attention: softmax(q K^T / sqrt(d), -inf at hidden keys) V per query
    head, K and V of its group, float64, rows left-padded by different amounts under the causal
    rule; a padding query that sees no key gets finite values (what it gets is never read)."""
    import torch

    from megatron_gspo.backends.cpu.attention import decode_attention

    g = torch.Generator().manual_seed(3)
    b, t, d = 3, 6, 4
    q = torch.randn(b, heads, t, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, groups, t, d, generator=g, dtype=torch.float64) for _ in range(2))
    pad = torch.tensor([0, 2, 5])
    valid = torch.arange(t)[None, :] >= pad[:, None]  # [b, t]
    hidden = ~(torch.ones(t, t, dtype=torch.bool).tril()[None] & valid[:, None, :])  # [b, t, t]
    out = decode_attention(q, k, v, hidden[:, None])
    assert torch.isfinite(out).all()
    for i in range(b):
        for h in range(heads):
            kv = h // (heads // groups)
            scores = (q[i, h] @ k[i, kv].T / d ** 0.5).masked_fill(hidden[i], float("-inf"))
            for pos in range(int(pad[i]), t):  # the real queries
                expected = torch.softmax(scores[pos], -1) @ v[i, kv]
                torch.testing.assert_close(out[i, h, pos], expected, rtol=1e-12, atol=1e-12)
