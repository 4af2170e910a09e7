"""Packing (trainer.packing): the plan (rows balanced over data-parallel ranks by tokens, packed
under a token budget, the same number of micro-batches on every rank), packed layouts, and one RL
step packed vs padded on 1 rank, DP=2, CP=2 and TP=2+SP: the same loss, grad norm and updated
log-probs, for each algorithm, with R2 and R3, and with rollout correction."""

import math
import random
import tempfile

import pytest
import torch

from megatron_gspo.batch.packing import (balanced_partition, first_fit_bins, micro_batch_bins,
                                         minibatch_rows, plan_step, round_up)
from megatron_gspo.batch.layout import Layout
from tests.distributed import run_layouts
from tests.packing_workers import PACKING, first_minibatch_job, rl_step_job
from tests.trainer_workers import merge


def long_tailed(n, seed, cap=256):
    rng = random.Random(seed)
    return [min(cap, max(2, int(rng.lognormvariate(3.5, 0.9)))) for _ in range(n)]


@pytest.mark.parametrize("ranks,minibatches,budget,seq_multiple,row_multiple,group_size",
                         [(1, 1, 512, 1, 1, 0), (2, 2, 300, 1, 1, 0), (4, 4, 256, 4, 8, 0),
                          (3, 2, 200, 2, 2, 0), (2, 4, 300, 1, 1, 4), (3, 2, 200, 2, 2, 8)])
def test_the_plan_covers_every_row_once_balanced_and_within_budget(ranks, minibatches, budget,
                                                                   seq_multiple, row_multiple,
                                                                   group_size):
    lengths = [long_tailed(32, seed=r) for r in range(ranks)]
    plan = plan_step(lengths, minibatches=minibatches, budget=budget, seq_multiple=seq_multiple,
                     row_multiple=row_multiple, group_size=group_size)
    cost = {(r, j): round_up(lengths[r][j], seq_multiple) for r in range(ranks)
            for j in range(32)}
    seen = [row for r in range(ranks) for row in plan.rows_of(r)]
    assert sorted(seen) == sorted(cost)  # every row exactly once
    for k in range(minibatches):
        # the padded mode's mini-batch k: row j of every rank with j = k mod M (whole groups:
        # j // G = k mod M)
        rows_k = [row for r in range(ranks) for mb in plan.micro[r][k] for row in mb]
        assert sorted(rows_k) == sorted((r, j) for r in range(ranks) for j in range(32)
                                        if (j // max(group_size, 1)) % minibatches == k)
        # the same number of micro-batches on every rank
        assert len({len(plan.micro[r][k]) for r in range(ranks)}) == 1
        # tokens balanced: ranks differ by at most the longest row of the mini-batch
        totals = [sum(cost[row] for mb in plan.micro[r][k] for row in mb) for r in range(ranks)]
        assert max(totals) - min(totals) <= max(cost[row] for row in rows_k)
        for r in range(ranks):
            for mb in plan.micro[r][k]:
                packed = round_up(sum(cost[row] for row in mb), row_multiple)
                assert packed <= budget or len(mb) == 1
    # pure: the same plan on every rank
    assert plan == plan_step(lengths, minibatches=minibatches, budget=budget,
                             seq_multiple=seq_multiple, row_multiple=row_multiple,
                             group_size=group_size)


def test_minibatches_of_interleaved_rows_or_of_whole_groups():
    assert minibatch_rows(8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert minibatch_rows(12, 3, group_size=2) == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    # a rank's block of whole groups gives the mini-batches a single rank would (k = group mod M)
    one = minibatch_rows(16, 2, group_size=4)
    halves = [minibatch_rows(8, 2, group_size=4), minibatch_rows(8, 2, group_size=4)]
    assert one == [sorted(halves[0][k] + [8 + j for j in halves[1][k]]) for k in range(2)]


def test_partition_and_bins_by_hand():
    # largest first, each to the lighter group: 10 | 9, 8 -> 17 | then the 1s go to the 10
    assert balanced_partition([10, 9, 8, 1, 1, 1], 2) == [[0, 3, 4, 5], [1, 2]]
    assert first_fit_bins([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    assert first_fit_bins([12, 3], 10) == [[0], [1]]  # over the budget: a bin of its own
    # packed lengths round up to row_multiple: 3 + 3 = 6 -> 8 fits 8, not 7
    assert first_fit_bins([3, 3, 3], 8, row_multiple=4) == [[0, 1], [2]]
    assert first_fit_bins([3, 3, 3], 7, row_multiple=4) == [[0], [1], [2]]
    assert micro_batch_bins([5, 1, 1, 1], 6, 3) == [[0], [1, 3], [2]]  # spread over 3, in budget
    assert micro_batch_bins([5, 5], 10, 3) == [[0], [1], []]  # fewer rows than micro-batches
    # balanced over 2 (5+4 | 5+3+3 = 11) would break the budget of 10: first fit instead
    assert micro_batch_bins([5, 5, 4, 3, 3], 10, 2) == [[0, 1], [2, 3, 4]]


def test_packed_layout_gathers_and_scatters_rows():
    values = torch.arange(3 * 6, dtype=torch.float32).reshape(3, 6) + 1
    layout = Layout.packed_rows([2, 0], [5, 3], seq_multiple=2, row_multiple=4)
    # segments of 6 and 4 tokens (each rounded to 2), then a padding segment to 12
    assert layout.cu_seqlens.tolist() == [0, 6, 10, 12]
    assert layout.valid_N.tolist() == [True] * 5 + [False] + [True] * 3 + [False] * 3
    got = layout.gather(values)
    assert got.shape == (1, 12)
    assert got[0, :5].tolist() == values[2, :5].tolist() and got[0, 6:9].tolist() == values[0, :3].tolist()
    assert got[0, ~layout.valid_N].abs().sum() == 0
    back = torch.zeros(3, 6)
    layout.scatter(back, got)
    assert back[2, :5].tolist() == values[2, :5].tolist() and back[0, :3].tolist() == values[0, :3].tolist()
    assert back[1].abs().sum() == 0 and back[2, 5] == 0
    empty = Layout.packed_rows([], [], seq_multiple=2, row_multiple=4)
    assert empty.cu_seqlens.tolist() == [0, 4] and not empty.valid_N.any()


def test_the_plan_keeps_a_prompts_rows_together_and_feeds_the_prompt_once():
    """With shared prompts a mini-batch's rows of one prompt on one rank are a unit: in one
    micro-batch, next to each other, costing the shared tokens once; mini-batches unchanged."""
    ranks, rows, group, minibatches = 2, 32, 8, 4
    lengths = [long_tailed(rows, seed=10 + r, cap=40) for r in range(ranks)]
    # prompt = row // group; it shares its first 5 fed tokens (rows are 8 to 46 long, so a
    # unit of 2 rows costs at most 5 + 2 x 41 = 87: within the budget of 100)
    lengths = [[n + 6 for n in per] for per in lengths]
    shares = [[(j // group, 5) for j in range(rows)] for _ in range(ranks)]
    plan = plan_step(lengths, minibatches=minibatches, budget=100, shares=shares)
    plain = plan_step(lengths, minibatches=minibatches, budget=100)
    for k in range(minibatches):
        rows_k = sorted(row for r in range(ranks) for mb in plan.micro[r][k] for row in mb)
        assert rows_k == sorted(row for r in range(ranks) for mb in plain.micro[r][k] for row in mb)
        for r in range(ranks):
            for mb in plan.micro[r][k]:
                units = {}
                for at, (src, j) in enumerate(mb):
                    units.setdefault((src, j // group), []).append(at)
                for (src, prompt), places in units.items():
                    # the unit is whole here: 8 / 4 = 2 rows of each prompt per mini-batch
                    assert len(places) == 2 and places[1] == places[0] + 1
                # the budget holds for the shared cost (the prefix once per unit)
                cost = sum(lengths[src][j] for src, j in mb) - 5 * len(units)
                assert cost <= 100 or len(units) == 1
    assert plan == plan_step(lengths, minibatches=minibatches, budget=100, shares=shares)


@pytest.mark.parametrize("group_size", [0, 8])
def test_a_unit_over_the_budget_is_cut_into_units_that_fit(group_size):
    """Long responses: a prompt's 4 (interleaved) or 8 (whole groups) rows of ~4000 tokens would
    feed 16k or 32k tokens together; cut into units of 2 rows, every packed micro-batch stays
    within the 8192-token budget, each piece feeding the prompt once."""
    from megatron_gspo.batch.layout import packed_layouts

    lengths = [[3990 + 7 * j for j in range(16)]]
    shares = [[(j // 8, 100) for j in range(16)]]
    plan = plan_step(lengths, minibatches=2, budget=8192, shares=shares, group_size=group_size)
    layouts = packed_layouts(plan, 0, lengths, seq_multiple=1, row_multiple=1, shares=shares)
    mbs = [(mb, layout) for per_k, lay_k in zip(plan.micro[0], layouts)
           for mb, layout in zip(per_k, lay_k)]
    assert sorted(row for mb, _ in mbs for row in mb) == [(0, j) for j in range(16)]
    for mb, layout in mbs:
        assert len(mb) == 2 and mb[0][1] // 8 == mb[1][1] // 8  # two rows of one prompt
        assert layout.shares_prompts and layout.cu_seqlens[-1] <= 8192
        assert layout.fed_tokens(None) == sum(lengths[0][j] for _, j in mb) - 100


def test_rows_sharing_no_token_balance_as_rows_and_rounded_units_keep_the_budget():
    """A one-token prompt shares nothing (n = 0): its rows are single units, so the plan balances
    them over ranks as without sharing (26 / 26 tokens, not one unit of 40 against 12). A unit
    whose packed length rounded up to ``row_multiple`` passes the budget is cut: rows of 5 and 6
    fed tokens sharing 2 cost 9, packed as 10 with sequence parallelism of 2, over a budget of 9."""
    lengths = [[10] * 4, [3] * 4]  # two ranks' rows
    plan = plan_step(lengths, minibatches=1, budget=64, shares=[[(0, 0)] * 4, [(0, 0)] * 4])
    fed = [sum(lengths[src][j] for mb in plan.micro[r][0] for src, j in mb) for r in range(2)]
    assert fed == [26, 26] and plan == plan_step(lengths, minibatches=1, budget=64)
    cut = plan_step([[5, 6]], minibatches=1, budget=9, row_multiple=2,
                    shares=[[(0, 2), (0, 2)]])
    assert [len(mb) for mb in cut.micro[0][0]] == [1, 1]
    whole = plan_step([[5, 6]], minibatches=1, budget=10, row_multiple=2,
                      shares=[[(0, 2), (0, 2)]])
    assert [len(mb) for mb in whole.micro[0][0]] == [2]


def test_layouts_concatenated_for_a_forward_only_pass():
    """Packed layouts back to back: segments, shared prefixes (renumbered) and padding kept;
    consecutive ones grouped under the token budget, in order; padded layouts untouched."""
    from megatron_gspo.batch.layout import forward_only_layouts

    values = torch.arange(5 * 8, dtype=torch.float32).reshape(5, 8) + 1
    a = Layout.packed_rows([0, 1], [5, 7], row_multiple=4, prefixes=[("p", 3), ("p", 3)])
    b = Layout.packed_rows([3], [4], row_multiple=4)
    c = Layout.packed_rows([2, 4], [6, 6], row_multiple=4, prefixes=[("q", 2), ("q", 2)])
    assert [x.num_tokens for x in (a, b, c)] == [12, 4, 12]
    ab = Layout.concat([a, b])
    assert ab.rows == (0, 1, 3) and ab.cu_seqlens.tolist() == [0, 3, 5, 9, 12, 16]
    assert ab.prefix_of == (-1, 0, 0, -1, -1) and ab.segment_rows == (-1, 0, 1, -1, 3)
    abc = Layout.concat([a, b, c])
    assert abc.prefix_of[5:] == (-1, 5, 5, -1)  # c's prefix: segment 0 of c, 5 of the row
    assert abc.cu_seqlens.tolist()[5:] == [16, 18, 22, 26, 28]
    assert torch.equal(abc.gather(values), torch.cat([x.gather(values) for x in (a, b, c)], 1))
    back = torch.zeros(5, 8)
    abc.scatter(back, abc.gather(values))
    ref = torch.zeros(5, 8)
    for x in (a, b, c):
        x.scatter(ref, x.gather(values))
    assert torch.equal(back, ref)
    from megatron_gspo.batch.micro_batch import packed_positions

    assert torch.equal(packed_positions(tuple(abc.cu_seqlens.tolist()), abc.prefix_of)[abc.valid_N],
                       abc.pos_N[abc.valid_N])
    grouped = forward_only_layouts([a, b, c], budget=16)
    assert [x.rows for x in grouped] == [(0, 1, 3), (2, 4)]
    assert [x.rows for x in forward_only_layouts([a, b, c], budget=28)] == [(0, 1, 3, 2, 4)]
    assert [x.rows for x in forward_only_layouts([a, b, c], budget=4)] == [(0, 1), (3,), (2, 4)]
    padded = [Layout((0, 1)), Layout((2, 3))]
    assert forward_only_layouts(padded, budget=100) == padded
    for split in ({"ep": 2}, {"pp": 2}):  # kept as the updates take them
        assert forward_only_layouts([a, b, c], budget=28, **split) == [a, b, c]


def test_a_shared_prompt_layout_feeds_the_prefix_once_and_covers_every_target():
    values = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8) + 1
    # rows 3 and 1 share 3 prompt tokens (fed lengths 5 and 7), row 0 stands alone (4 tokens)
    layout = Layout.packed_rows([3, 1, 0], [5, 7, 4], row_multiple=4,
                                prefixes=[("a", 3), ("a", 3), ("b", 2)])
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 9, 13, 16]  # prefix, 2, 4, row 0, padding 3
    assert layout.segment_rows == (-1, 3, 1, 0, -1) and layout.prefix_of == (-1, 0, 0, -1, -1)
    assert layout.shares_prompts and layout.fed_tokens(torch.zeros(4)) == 13
    assert layout.row_N.tolist()[:13] == [3, 3, 3, 3, 3, 1, 1, 1, 1, 0, 0, 0, 0]
    assert layout.pos_N.tolist()[:13] == [0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 2, 3]
    got = layout.gather(values)
    back = torch.zeros(4, 8)
    layout.scatter(back, got)
    # every fed position from the prompt's last token on is the row's own: all targets covered
    assert back[3, :5].tolist() == values[3, :5].tolist()
    assert back[1, 3:7].tolist() == values[1, 3:7].tolist() and back[1, :3].abs().sum() == 0
    assert back[0, :4].tolist() == values[0, :4].tolist()
    from megatron_gspo.batch.micro_batch import packed_positions

    assert packed_positions(tuple(layout.cu_seqlens.tolist()), layout.prefix_of).tolist()[:13] \
        == layout.pos_N.tolist()[:13]
    with pytest.raises(ValueError, match="context parallelism"):
        Layout.packed_rows([0, 1], [5, 6], seq_multiple=2, prefixes=[("a", 3), ("a", 3)])


def test_shared_prefix_attention_equals_each_rows_own():
    """A sequence attending to a shared prefix gets the outputs, and gives the prefix the
    gradients, that it would as one causal sequence with the prefix as its first tokens."""
    from megatron_gspo.models.layers import bucket_plan, packed_causal_attention

    torch.manual_seed(0)
    prefix, tails = 5, [3, 7, 1]
    rows = [prefix + n for n in tails]
    q_rows = [torch.randn(n, 4, 8, dtype=torch.float64) for n in rows]
    k_rows = [torch.randn(n, 2, 8, dtype=torch.float64) for n in rows]
    v_rows = [torch.randn(n, 2, 8, dtype=torch.float64) for n in rows]
    for t in (q_rows, k_rows, v_rows):  # the rows hold one prompt
        for i in range(1, len(rows)):
            t[i][:prefix] = t[0][:prefix]
    # packed: the prefix once, then each row's tail
    pack = lambda ts: torch.cat([ts[0][:prefix]] + [t[prefix:] for t in ts]).requires_grad_()  # noqa: E731
    q, k, v = pack(q_rows), pack(k_rows), pack(v_rows)
    bounds = tuple(torch.tensor([0, prefix, *tails]).cumsum(0).tolist())
    out = packed_causal_attention(q, k, v, bucket_plan(bounds, "cpu", (-1, 0, 0, 0)))
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    start = prefix
    grads = [torch.zeros(prefix, *t.shape[1:], dtype=torch.float64) for t in (q, k, v)]
    for i, n in enumerate(rows):
        qi, ki, vi = (t[i].clone().requires_grad_() for t in (q_rows, k_rows, v_rows))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1)
        tail = n - prefix
        if i == 0:  # the prefix's own outputs (its queries see only the prefix)
            assert torch.allclose(out[:prefix], ref[:prefix], atol=1e-12)
        assert torch.allclose(out[start:start + tail], ref[prefix:], atol=1e-12)
        w = torch.cat([weights[:prefix] if i == 0 else torch.zeros_like(weights[:prefix]),
                       weights[start:start + tail]])
        (ref * w).sum().backward()
        for g, t, packed_grad in zip(grads, (qi, ki, vi), (q.grad, k.grad, v.grad)):
            g += t.grad[:prefix]
            assert torch.allclose(packed_grad[start:start + tail], t.grad[prefix:], atol=1e-12)
        start += tail
    for g, packed_grad in zip(grads, (q.grad, k.grad, v.grad)):  # the prefix: every row's sum
        assert torch.allclose(packed_grad[:prefix], g, atol=1e-12)


def test_rows_share_a_prompt_only_with_the_same_tokens_and_routes():
    from megatron_gspo.batch.rollout_batch import build_batch, prompt_shares
    from megatron_gspo.rollout.types import Sample

    def sample(prompt, response, routes=None):
        return Sample(prompt_ids=prompt, response_ids=response,
                      logprobs_R=torch.zeros(len(response)), finish_reason="stop",
                      routes_TLK=routes)

    batch = build_batch([sample([5, 6, 7], [8]), sample([5, 6, 7], [9, 10]),
                         sample([5, 6, 4], [8]), sample([5, 6], [7, 8])],
                        torch.zeros(4), torch.zeros(4), width=4, pad_id=0)
    # the same prompt: one key; another last token or length: keys of their own
    assert prompt_shares(batch) == [(0, 2), (0, 2), (2, 2), (3, 1)]
    r = torch.zeros(4, 2, 2, dtype=torch.long)
    r[..., 1] = 1
    other = r.clone()
    other[1, 0] = torch.tensor([2, 3])  # a prompt token routed elsewhere
    last = r.clone()
    last[2, 0] = torch.tensor([2, 3])  # the last prompt token: not shared, may differ
    batch = build_batch([sample([5, 6, 7], [8, 9], r), sample([5, 6, 7], [8, 9], other),
                         sample([5, 6, 7], [8, 9], last)], torch.zeros(3), torch.zeros(3),
                        width=4, pad_id=0, num_experts=4)
    assert prompt_shares(batch) == [(0, 2), (1, 2), (0, 2)]


def test_build_batch_written_out_and_its_bad_samples():
    """Tokens padded to the width; a response of R tokens after a prompt of P has its targets
    (mask, engine log-probs) at positions P-1 .. P+R-2; a sample too wide, with no prompt or
    with a log-prob count other than its response's is refused by index."""
    from megatron_gspo.batch.rollout_batch import build_batch
    from megatron_gspo.rollout.types import Sample

    def sample(prompt, response, logprobs=None):
        logprobs = torch.tensor(logprobs if logprobs is not None
                                else [-0.5 * (k + 1) for k in range(len(response))])
        return Sample(prompt_ids=prompt, response_ids=response, logprobs_R=logprobs,
                      finish_reason="stop")

    batch = build_batch([sample([1, 2], [3, 4, 5]), sample([1], []), sample([1, 2, 3, 4], [5])],
                        torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, -1.0, 0.5]),
                        width=4, pad_id=9)
    assert batch.tokens_BS1.tolist() == [[1, 2, 3, 4, 5], [1, 9, 9, 9, 9], [1, 2, 3, 4, 5]]
    assert batch.mask_BS.tolist() == [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]]
    assert batch.engine_logp_BS.tolist() == [[0, -0.5, -1.0, -1.5], [0, 0, 0, 0],
                                             [0, 0, 0, -0.5]]
    assert batch.lengths_B.tolist() == [4, 0, 4]
    assert batch.prompt_lengths_B.tolist() == [2, 1, 4]
    for bad, message in ((sample([1, 2], [3, 4, 5, 6]), "sample 1 has 6 tokens, the batch is 5"),
                         (sample([], [3]), "sample 1 has an empty prompt"),
                         (sample([1], [3, 4], [-0.1]), "sample 1 has 2 response tokens and 1")):
        with pytest.raises(ValueError, match=message):
            build_batch([sample([1], [2]), bad], torch.zeros(2), torch.zeros(2), width=4,
                        pad_id=0)


def close(a, b, rel=1e-5, abs_=1e-7):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + abs_


def _cases(parallel, combos, share_prompts=True, split="interleaved"):
    out = []
    for algo, replay, correction in combos:
        for packing in (False, True):
            cfg = merge(PACKING, {"algo": {"name": algo, "rollout_correction": correction,
                                           "minibatch_split": split},
                                  "replay": {"mode": replay},
                                  "trainer": {"packing": packing, "share_prompts": share_prompts},
                                  "parallel": parallel, "run_dir": tempfile.mkdtemp()})
            out.append((rl_step_job, (cfg,)))
    return out


# Every algorithm and every replay mode on one rank and on two (together: each algorithm with
# and without replay, GRPO with all three), and rollout correction in both kinds.
ONE_RANK = [("gspo", "r2", "none"), ("gspo_token", "none", "none"), ("grpo", "none", "none"),
            ("grpo", "r3", "none")]
TWO_RANKS = [("gspo", "none", "seq_tis"), ("gspo_token", "r3", "token_tis"), ("grpo", "r2", "none")]
LAYOUTS = {"dp2": {}, "cp2": {"cp": 2}, "tp2_sp": {"tp": 2, "sequence_parallel": True}}


# PP=2 and EP=2 (micro-batches of one length per pass / per rank) run packed in the layout-true
# metrics test (tests/test_layout_metrics.py), against one rank.
COMBOS = {"dp2": TWO_RANKS, "cp2": TWO_RANKS, "tp2_sp": TWO_RANKS}


# Packed rows each feeding their whole prompt (trainer.share_prompts=false), on one rank.
UNSHARED = [("gspo", "r2", "none"), ("grpo", "r3", "none")]
# Mini-batches of whole groups (algo.minibatch_split=groups), on one rank and on DP=2. (On DP=2
# R3 runs packed and padded within 1.6e-5 of each other with or without shared prompts: fp32
# rounding that Adam's second update amplifies past the 1e-5 this test holds.)
GROUPS = [("gspo", "r2", "none"), ("grpo", "r3", "none")]
GROUPS_DP2 = [("grpo", "r2", "none"), ("gspo_token", "none", "none")]


@pytest.fixture(scope="module")
def steps():
    extra = {"1-unshared": (UNSHARED, dict(share_prompts=False)),
             "1-groups": (GROUPS, dict(split="groups"))}
    one = run_layouts(1, _cases({}, ONE_RANK) + [c for combos, kw in extra.values()
                                                   for c in _cases({}, combos, **kw)])
    out, start = {"1": (ONE_RANK, one[:2 * len(ONE_RANK)])}, 2 * len(ONE_RANK)
    for name, (combos, _) in extra.items():
        out[name] = (combos, one[start:start + 2 * len(combos)])
        start += 2 * len(combos)
    per_case = run_layouts(2, [c for name, parallel in LAYOUTS.items()
                               for c in _cases(parallel, COMBOS[name])]
                           + _cases({}, GROUPS_DP2, split="groups"))
    start = 0
    for name in LAYOUTS:
        n = 2 * len(COMBOS[name])
        out[name] = (COMBOS[name], per_case[start:start + n])
        start += n
    out["dp2-groups"] = (GROUPS_DP2, per_case[start:])
    return out


@pytest.mark.parametrize("layout", ["1", "1-unshared", "1-groups", *LAYOUTS, "dp2-groups"])
def test_packed_step_equals_padded_step(steps, layout):
    """Packed rows (a group's rows in one micro-batch feeding their prompt once, but under CP
    and with trainer.share_prompts=false) train as the padded rows do."""
    combos, results = steps[layout]
    for i, combo in enumerate(combos):
        padded, packed = results[2 * i], results[2 * i + 1]
        for p in packed:  # a shared prompt is fed once: fewer tokens than the rows hold
            sharing = layout not in ("cp2", "1-unshared")
            assert (p["shared"] > 0 and p["fed"] < p["tokens"]) == sharing, (combo, p)
            assert p["fed"] == p["tokens"] or sharing
        assert len(padded) == len(packed) >= 1
        for rank, (a, b) in enumerate(zip(padded, packed)):
            for key in ("loss", "grad_norm", "clip_fraction"):
                assert len(a[key]) == len(b[key]), (combo, key)
            # the padded run has no packed layouts; the packed one has every mini-batch's
            assert a["micro_batches"] == [] and len(b["micro_batches"]) == len(a["loss"]), combo
            for key in ("grad_norm", "clip_fraction"):
                assert all(close(x, y) for x, y in zip(a[key], b[key])), (combo, key, a[key], b[key])
            # The loss is a sum of terms of order 1 that cancel down to ~1e-3: fp32 rounding of
            # the terms (~1e-7) bounds its agreement in absolute terms.
            assert all(close(x, y, abs_=1e-6) for x, y in zip(a["loss"], b["loss"])), (
                combo, a["loss"], b["loss"])
            assert len(a["loss"]) == 2 and a["grad_norm"][0] > 0
            diff = ((a["after"] - b["after"]).abs() / a["after"].abs().clamp_min(1e-6)).max()
            assert diff < 1e-5, (combo, rank, float(diff))
            assert a["after"].numel() == b["after"].numel() > 0
        # each packed mini-batch is fed as one or more micro-batches
        assert all(n >= 1 for p in packed for n in p["micro_batches"])


def test_whole_groups_per_minibatch_feed_each_prompt_once(steps):
    """Under algo.minibatch_split=groups a mini-batch holds all 4 rows of each of its prompts
    (interleaved: 2 of each), so the same responses feed fewer prompt tokens."""
    (interleaved,) = steps["1"][1][1]  # gspo + R2, packed
    (groups,) = steps["1-groups"][1][1]
    assert groups["tokens"] == interleaved["tokens"]
    assert groups["fed"] < interleaved["fed"] < interleaved["tokens"]


def test_packing_balances_tokens_over_data_parallel_ranks(steps):
    _, results = steps["dp2"]
    packed = results[1]  # gspo, packed, both ranks
    tokens = [r["tokens"] for r in packed]
    longest = 29
    assert abs(tokens[0] - tokens[1]) <= 2 * longest  # two mini-batches, each within one row


FIRST = [("gspo", "none", "padded", False), ("gspo", "none", "padded", True),
         ("gspo", "none", "packed", True), ("grpo", "r3", "packed", True),
         ("gspo", "r2", "packed", False)]


@pytest.mark.parametrize("parallel", [{}, {"cp": 2}, {"pp": 2}, {"tp": 2, "sequence_parallel": True},
                                      {"ep": 2}], ids=["1", "cp2", "pp2", "tp2_sp", "ep2"])
def test_first_minibatch_behaviour_logprobs_come_from_its_update(parallel):
    """The old-policy pass skips the first mini-batch (its update's forward is on the old policy
    and gives its behaviour log-probs); the batch's behaviour log-probs are bitwise those of a
    pass over every micro-batch. Nothing is skipped under R2 (which replays the pass's routes)
    nor when the drift probe reads the pass's first forward (padded rows). (The pass does not
    regroup micro-batches here: every packed one holds close to the 40-token budget, so no two
    consecutive ones fit it together; see the next test.)"""
    combos = FIRST if not parallel else FIRST[2:4]
    cases = [(first_minibatch_job, (merge(PACKING, {
        "algo": {"name": algo}, "replay": {"mode": replay},
        "trainer": {"packing": mode == "packed"}, "logging": {"progress": False, "drift": drift},
        "parallel": parallel, "run_dir": tempfile.mkdtemp()}),)) for algo, replay, mode, drift
        in combos]
    results = run_layouts(1 if not parallel else 2, cases)
    for combo, per_rank in zip(combos, results):
        _, replay, mode, drift = combo
        for r in per_rank:
            skips = replay != "r2" and not (drift and mode == "padded")
            skipped = r["first_minibatch"] if skips else 0
            assert r["old_pass_forwards"] == r["micro_batches"] - skipped, (combo, r)
            assert r["first_minibatch"] >= 1 and r["micro_batches"] > r["first_minibatch"]
            assert r["old_equal"] and r["recomputed_equal"], (combo, r)
            assert r["ratio"][0] == 1.0, (combo, r)


def test_logprob_mismatch_compares_the_rows_the_trainer_has():
    """``RolloutBatch.logprob_mismatch``: sum |engine - trainer| and the count over response
    tokens of the rows that have trainer log-probs (every row when ``trainer_rows_B`` is
    None); NaN outside those rows is left out, NaN inside them makes the sum NaN (loud)."""
    from megatron_gspo.batch.rollout_batch import RolloutBatch

    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
    engine = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, 0.0, -0.5, -0.25],
                           [-3.0, -1.0, -1.0, 0.0]])
    trainer = engine + torch.tensor([[9.0, 0.5, -0.25, 9.0], [9.0, 9.0, 1.0, 2.0],
                                     [0.125, 0.125, 0.125, 9.0]])
    batch = RolloutBatch(tokens_BS1=torch.zeros(3, 5, dtype=torch.long), mask_BS=mask,
                         engine_logp_BS=engine, advantages_B=torch.zeros(3),
                         rewards_B=torch.zeros(3), lengths_B=torch.full((3,), 4),
                         prompt_lengths_B=torch.ones(3, dtype=torch.long))
    assert batch.logprob_mismatch() == (0.0, 0.0)  # no trainer log-probs at all
    batch.trainer_logp_BS = trainer
    assert batch.logprob_mismatch() == (0.5 + 0.25 + 1.0 + 2.0 + 3 * 0.125, 7.0)
    batch.trainer_rows_B = torch.tensor([True, False, True])
    batch.trainer_logp_BS = trainer.clone()
    batch.trainer_logp_BS[1] = float("nan")  # a row the trainer has not computed
    assert batch.logprob_mismatch() == (0.5 + 0.25 + 3 * 0.125, 5.0)
    batch.trainer_logp_BS[0, 2] = float("nan")  # a NaN where the trainer computed
    total, count = batch.logprob_mismatch()
    assert math.isnan(total) and count == 5.0


ENGINE_CASES = (("auto", "packed"), ("auto", "padded"), ("engine", "packed"), ("engine", "padded"))


@pytest.mark.parametrize("ranks,parallel", [(1, {}), (2, {"tp": 2, "sequence_parallel": True}),
                                            (2, {"pp": 2})], ids=["1", "tp2_sp", "pp2"])
def test_engine_behaviour_logprobs_skip_the_pass(ranks, parallel):
    """Engine behaviour log-probs: no old-policy forward at all. With ``algo.old_logprobs=auto``
    (engine for the local fp32 CPU engine) the first mini-batch still takes its behaviour
    log-probs from its own update's forward (bitwise the old policy's: ratio exactly 1), and
    those are the only trainer log-probs the step has (``rollout/logprob_mismatch`` compares
    them: its sum and count written out here, and the logged mean); every later mini-batch's
    are the engine's (random here, so any pass would show). With ``engine`` asked for, every
    row's are the engine's (ratio not 1), nothing is compared and the metric is not logged."""
    cases = [(first_minibatch_job, (merge(PACKING, {
        "algo": {"old_logprobs": source}, "trainer": {"packing": mode == "packed"},
        "logging": {"progress": False, "drift": False}, "parallel": parallel,
        "run_dir": tempfile.mkdtemp()}),)) for source, mode in ENGINE_CASES]
    results = run_layouts(ranks, cases)
    for (source, mode), per_rank in zip(ENGINE_CASES, results):
        for r in per_rank:
            assert r["source"] == "engine" and r["old_pass_forwards"] == 0, (source, mode, r)
            assert r["rest_is_engine"], (source, mode, r)
            if source == "auto":
                assert r["first_equal"] and r["recomputed_first"] and r["trainer_rows_first_only"], r
                assert r["ratio"][0] == 1.0 and r["ratio"][1] != 1.0, r
                assert r["compared"] == r["first_tokens"] < r["tokens"], r
                assert r["mismatch"] == pytest.approx(r["first_mismatch"], rel=1e-6), r
                assert r["mismatch_metric"] == pytest.approx(
                    r["first_mismatch"] / r["first_tokens"], rel=1e-6), r
            else:
                assert r["first_is_engine"] and r["recomputed_none"], (mode, r)
                assert r["ratio"][0] != 1.0 and (r["mismatch"], r["compared"]) == (0.0, 0.0), r
                assert r["mismatch_metric"] is None, (mode, r)


def test_one_minibatch_needs_no_old_policy_pass_and_the_kl_pass_stays():
    """With one mini-batch every update is on-policy: no old-policy forward at all; with a KL
    term the reference model's pass still covers every micro-batch (its own model)."""
    cases = [(first_minibatch_job, (merge(PACKING, {
        "algo": {"minibatches": minibatches, "kl_coef": kl}, "trainer": {"packing": True},
        "logging": {"progress": False, "drift": False}, "run_dir": tempfile.mkdtemp()}),))
        for minibatches, kl in ((1, 0.0), (2, 0.05))]
    (one,), (kl,) = run_layouts(1, cases)
    assert one["old_pass_forwards"] == 0 and one["first_minibatch"] == one["micro_batches"]
    assert one["old_equal"] and one["recomputed_equal"] and one["ratio"] == [1.0]
    assert kl["old_pass_forwards"] == kl["micro_batches"] - kl["first_minibatch"]
    assert kl["old_equal"] and kl["recomputed_equal"] and kl["ratio"][0] == 1.0
    assert kl["reference_filled"] and not one["reference_filled"]


@pytest.mark.parametrize("ranks,parallel", [(1, {}), (2, {}), (2, {"tp": 2, "sequence_parallel": True}),
                                            (2, {"cp": 2}), (2, {"ep": 2}), (2, {"pp": 2})],
                         ids=["1", "dp2", "tp2_sp", "cp2", "ep2", "pp2"])
def test_the_old_policy_pass_regroups_packed_micro_batches(ranks, parallel):
    """Four mini-batches of one packed micro-batch each (a 1000-token budget; whole groups, so
    each feeds its prompt once): the old-policy pass feeds the last three as one packed row
    (rl_batch.forward_only_layouts, the shared prefixes kept) and gets the
    log-probs of a pass over each micro-batch within 1e-5 (fp32); not under expert
    parallelism (its dispatch pairs the ranks' micro-batches) or pipeline stages (one shape
    per pass), nor when it records routes (R2) or replays the engine's (R3), which follow the
    updates' micro-batches: there, one forward each and the same log-probs bitwise."""
    combos = [("none", "gspo"), ("r2", "gspo"), ("r3", "grpo")]
    cases = [(first_minibatch_job, (merge(PACKING, {
        "algo": {"name": algo, "minibatches": 4, "minibatch_split": "groups"},
        "replay": {"mode": replay},
        "trainer": {"packing": True, "max_tokens_per_micro_batch": 1000},
        "rollout": {"prompts_per_step": 8}, "logging": {"progress": False, "drift": False}, "parallel": parallel,
        "run_dir": tempfile.mkdtemp()}),)) for replay, algo in combos]
    results = run_layouts(ranks, cases)
    for (replay, _), per_rank in zip(combos, results):
        for r in per_rank:
            assert r["micro_batches"] == 4 and r["first_minibatch"] == 1, r
            skipped = 0 if replay == "r2" else 1
            if replay == "none" and "ep" not in parallel and "pp" not in parallel:
                assert r["old_pass_forwards"] == 1, (replay, r)
                assert r["old_max_diff"] <= 1e-5 and r["recomputed_max_diff"] <= 1e-5, r
            else:
                assert r["old_pass_forwards"] == 4 - skipped, (replay, r)
                assert r["old_equal"] and r["recomputed_equal"], (replay, r)
            assert r["ratio"][0] == 1.0, (replay, r)
