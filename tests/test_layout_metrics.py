"""Layout-true metrics: the same run resumed from one step-0 checkpoint logs the same step on 1 rank
and on every parallel layout (DP, TP+SP, PP, EP, CP), every logged metric up to rounding, on a step
whose advantages and loss are not zero."""

import math

import pytest

from tests.distributed import run_layouts
from tests.trainer_workers import SHORT, merge, train_job

# Enough warm-up that some sampled responses are right: a step with real advantages. Two
# mini-batches: each holds 2 rows of every prompt, which then share it (trainer.share_prompts).
LEARNABLE = merge(SHORT, {"trainer": {"steps": 2, "sft_steps": 40, "sft_lr": 0.01,
                                      "keep_checkpoints": 5},
                          "algo": {"minibatches": 2},
                          "data": {"min_len": 1, "max_len": 2}, "seed": 5})

LAYOUTS = {
    "dp2": (2, {}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2": (2, {"pp": 2}),
    "ep2": (2, {"ep": 2}),
    "cp2": (2, {"cp": 2}),
}


def close(a, b, rel=1e-4, abs_=1e-6) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y, rel, abs_) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return abs(a - b) <= rel * max(abs(a), abs(b)) + abs_


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fresh run and its 1-rank resume in one process, the five 2-rank layouts in another."""
    base = str(tmp_path_factory.mktemp("fresh"))
    start = f"{base}/checkpoints/step_000000"

    def resumed(parallel):
        return merge(LEARNABLE, {"run_dir": str(tmp_path_factory.mktemp("resumed")),
                                 "parallel": parallel, "trainer": {"resume": start}})

    dynamic = merge(LEARNABLE, {"rollout": {"dynamic_sampling": True, "max_sampling_rounds": 4},
                                "run_dir": str(tmp_path_factory.mktemp("dynamic"))})
    fresh, single, dyn = run_layouts(1, [(train_job, (merge(LEARNABLE, {"run_dir": base}),)),
                                         (train_job, (resumed({}),)), (train_job, (dynamic,))])
    out = {"fresh": fresh[0]["rows"], "single": single[0]["rows"], "dynamic": dyn[0]["rows"]}
    layouts = run_layouts(2, [(train_job, (resumed(parallel),)) for _, parallel in LAYOUTS.values()])
    for name, per_rank in zip(LAYOUTS, layouts):
        out[name] = per_rank[0]["rows"]
    return out


def step_row(rows, step):
    return next(r for r in rows if r.get("step") == step and "train/loss" in r)


def test_resume_from_step_zero_repeats_the_uninterrupted_run_bitwise(runs):
    def rl_rows(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"}
                for r in rows if r.get("step", 0) > 0]

    fresh, resumed = rl_rows(runs["fresh"]), rl_rows(runs["single"])
    assert len(fresh) == 3 and fresh == resumed  # steps 1, 2 and the final evaluation


def test_the_compared_step_learns(runs):
    row = step_row(runs["single"], 1)
    assert row["rollout/reward_std"] > 0 and row["rollout/informative_fraction"] > 0
    assert abs(row["train/loss"]) > 1e-6 and row["train/grad_norm"] > 0
    # RL's default router aux-loss coefficient is 0: the loss is the policy loss, exactly.
    assert row["train/aux_loss"] == 0.0 and row["train/loss"] == row["train/policy_loss"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_logged_metric_matches_one_rank(runs, name):
    ref, got = step_row(runs["single"], 1), step_row(runs[name], 1)
    keys = [k for k in ref if not k.startswith("perf/") and k != "time"]
    assert set(keys) <= set(got), f"{name} lacks {sorted(set(keys) - set(got))}"
    # (close() takes NaN for NaN: no metric of this step may be NaN on 1 rank to begin with)
    assert not [k for k in keys for v in (ref[k] if isinstance(ref[k], list) else [ref[k]])
                if isinstance(v, float) and math.isnan(v)]
    bad = {k: (ref[k], got[k]) for k in keys if not close(ref[k], got[k])}
    assert not bad, f"{name}: metrics differ from 1 rank: {bad}"
    assert ref["rollout/reward_mean"] == got["rollout/reward_mean"]


def test_every_layout_but_cp_shares_prompts_as_one_rank_does(runs):
    """Shared prompts (the default under packing) feed the same tokens on every layout as on one
    rank (the units are a rank's rows of one prompt, and a group stays on its rank), fewer than
    CP=2, where they are off and every row feeds its whole prompt."""
    fed = {name: step_row(runs[name], 1)["perf/model_tokens"] for name in ["single", *LAYOUTS]}
    assert all(fed[name] == fed["single"] for name in LAYOUTS if name != "cp2"), fed
    assert fed["cp2"] > fed["single"], fed


def test_dynamic_sampling_fills_the_batch_with_groups_that_differ(runs):
    """The same run with dynamic sampling: at step 1 (same weights, same first prompts) it keeps
    sampling until its 4 groups all have differing rewards, where the plain run has fewer."""
    plain, dyn = step_row(runs["fresh"], 1), step_row(runs["dynamic"], 1)
    assert plain["rollout/informative_fraction"] < 1.0
    rounds = dyn["rollout/sampling_rounds"]
    assert 1 <= rounds <= 4 and dyn["rollout/dropped_groups"] == rounds * 4 - 4
    if rounds < 4:
        assert dyn["rollout/informative_fraction"] == 1.0
    assert dyn["rollout/informative_fraction"] > plain["rollout/informative_fraction"]
