"""The RL trainer end to end on CPU: every algorithm and replay mode for three steps, the documented
TensorBoard tags, on-policy first mini-batches, and the same run on 1 rank and on EP=2."""

import math
import os

import pytest

from megatron_gspo.trainer.metric_tags import known
from tests.distributed import run_layouts, run_ranks
from tests.trainer_workers import SHORT, merge, train_job

ARMS = {
    "gspo": {"algo": {"name": "gspo"}},
    "gspo_token": {"algo": {"name": "gspo_token"}},
    "grpo": {"algo": {"name": "grpo"}},
    "grpo_r2": {"algo": {"name": "grpo"}, "replay": {"mode": "r2"}},
    "grpo_r3": {"algo": {"name": "grpo"}, "replay": {"mode": "r3"}},
    "gspo_kl": {"algo": {"name": "gspo", "kl_coef": 0.05}},  # frozen reference model
    "grpo_tis": {"algo": {"name": "grpo", "rollout_correction": "token_tis"}},
    "gspo_dynamic": {"rollout": {"dynamic_sampling": True, "max_sampling_rounds": 3}},
    "grpo_overlong_mask": {"algo": {"name": "grpo"}, "rollout": {"overlong": "mask"}},
    "gspo_soft_penalty": {"rollout": {"overlong": "soft_penalty", "overlong_buffer": 2}},
}

REQUIRED_TAGS = ["train/loss", "train/clip_fraction", "train/ratio_mean", "train/ratio_min",
                 "train/ratio_max", "train/grad_norm", "train/lr", "train/entropy", "train/kl",
                 "train/skipped_updates", "rollout/reward_mean", "rollout/reward_std",
                 "rollout/response_length", "rollout/truncated_fraction",
                 "rollout/informative_fraction", "rollout/logprob_mismatch", "perf/step_time_s",
                 "perf/tokens_per_s", "eval/accuracy", "moe/drift/update/mean",
                 "moe/drift/update/jaccard_mean", "moe/drift/update/tokens_changed",
                 "moe/drift/rollout_train/mean", "moe/load/max_share"]


def tensorboard_tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


EP_CHECK = merge(SHORT, {"trainer": {"steps": 2, "save_interval": 0}, "seed": 11})


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    """Every arm, and the 1-rank half of the EP=2 comparison, in one process."""
    cases, dirs = [], {}
    for name, over in ARMS.items():
        dirs[name] = str(tmp_path_factory.mktemp(name))
        # The router aux loss moves the policy even on a step whose rewards are all equal, so
        # that every later mini-batch is measurably off-policy (and it runs in every arm).
        cfg = merge(merge(SHORT, {"algo": {"aux_loss_coeff": 1e-3}}),
                    {**over, "run_dir": dirs[name], "seed": 5})
        cases.append((train_job, (cfg,)))
    cases.append((train_job, ({**EP_CHECK, "run_dir": str(tmp_path_factory.mktemp("one"))},)))
    results = run_layouts(1, cases)
    out = {name: (dirs[name], per_rank[0]) for name, per_rank in zip(ARMS, results)}
    out["ep_check_one_rank"] = (None, results[-1][0])
    return out


@pytest.mark.parametrize("name", list(ARMS))
def test_three_steps_log_every_documented_tag(arms, name):
    run_dir, result = arms[name]
    tags = tensorboard_tags(run_dir)
    for tag in REQUIRED_TAGS:
        assert tag in tags, f"{name}: {tag} missing"
        assert known(tag), f"{tag} undocumented (trainer.metric_tags)"
    assert tags["train/loss"] == [1, 2, 3]
    assert any(t.startswith("moe/drift/update/layer_") for t in tags)
    rows = [r for r in result["rows"] if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for tag in REQUIRED_TAGS:
            if tag != "eval/accuracy":
                assert tag in r and math.isfinite(r[tag]), (name, tag)
    assert os.path.isfile(os.path.join(run_dir, "drift_report.html"))
    assert os.path.isfile(os.path.join(run_dir, "resolved_config.json"))
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000003", "MANIFEST.json"))


# (the overlong-mask arm: its untrained responses are cut at 5 tokens and masked, nothing to train)
@pytest.mark.parametrize("name", [n for n in ARMS if n != "grpo_overlong_mask"])
def test_first_minibatch_is_on_policy(arms, name):
    _, result = arms[name]
    rows = [r for r in result["rows"] if "minibatch/ratio_mean" in r]
    assert rows, name  # every RL step logs its mini-batches
    for r in rows:
        ratios, clips = r["minibatch/ratio_mean"], r["minibatch/clip_fraction"]
        assert len(ratios) == 4 and all(math.isfinite(x) for x in ratios), (name, ratios)
        assert ratios[0] == 1.0 and clips[0] == 0.0, (name, r["step"], ratios, clips)
        # later mini-batches are off-policy: the policy moved
        assert any(x != 1.0 for x in ratios[1:]), (name, r["step"], ratios)


def test_reference_model_gives_the_kl_term(arms):
    run_dir, result = arms["gspo_kl"]
    rows = [r for r in result["rows"] if "train/kl" in r]
    assert all(r["train/kl"] > 0 for r in rows)  # the policy moves away from the reference
    assert all(r["train/kl"] == 0 for r in arms["gspo"][1]["rows"] if "train/kl" in r)
    assert os.path.isfile(os.path.join(run_dir, "reference", "model_config.json"))


def test_expert_parallel_run_matches_one_rank(arms, tmp_path):
    """`torchrun --nproc-per-node 2 ... parallel.ep=2` computes the same run as one rank."""
    one = arms["ep_check_one_rank"][1]
    two = run_ranks(train_job, 2, merge(EP_CHECK, {"parallel": {"ep": 2},
                                                   "run_dir": str(tmp_path / "two")}))[0]
    rows1 = [r for r in one["rows"] if "train/loss" in r]
    rows2 = [r for r in two["rows"] if "train/loss" in r]
    assert len(rows1) == len(rows2) == 2
    for a, b in zip(rows1, rows2):
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["rollout/response_length"] == b["rollout/response_length"]
        for key in ("train/loss", "train/ratio_mean", "train/entropy", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert one["history"]["accuracy_after_rl"] == two["history"]["accuracy_after_rl"]


def test_rollout_correction_weights_are_one_with_the_local_engine(arms):
    """The local engine samples from the trainer's own model: importance weights 1 up to
    rounding, nothing masked, the run trains as without correction."""
    rows = [r for r in arms["grpo_tis"][1]["rows"] if "train/loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert abs(r["train/rollout_correction/mean_weight"] - 1.0) < 1e-4
        assert r["train/rollout_correction/masked_fraction"] == 0.0
    assert not any("train/rollout_correction/mean_weight" in r
                   for r in arms["grpo"][1]["rows"])


def test_dynamic_sampling_counts_rounds_and_dropped_groups(arms):
    """Untrained, every group's rewards are equal: each step samples its 3 rounds, drops every
    group but the 4 that fill the batch (they carry no advantage)."""
    for r in (r for r in arms["gspo_dynamic"][1]["rows"] if "train/loss" in r):
        rounds = r["rollout/sampling_rounds"]
        assert 1 <= rounds <= 3
        assert r["rollout/dropped_groups"] == rounds * 4 - 4
        if rounds < 3:  # filled with groups whose rewards differ
            assert r["rollout/informative_fraction"] == 1.0
        else:
            assert r["rollout/informative_fraction"] < 1.0


def test_masked_overlong_responses_carry_no_loss(arms):
    rows = [r for r in arms["grpo_overlong_mask"][1]["rows"] if "train/loss" in r]
    for r in rows:
        assert r["rollout/overlong_masked"] == r["rollout/truncated_fraction"]
        if r["rollout/truncated_fraction"] == 1.0:  # every response cut: nothing to learn from
            assert r["train/policy_loss"] == 0.0 and r["train/entropy"] == 0.0
    assert any(r["rollout/truncated_fraction"] > 0 for r in rows)


def test_soft_overlong_penalty_enters_the_reward(arms):
    rows = [r for r in arms["gspo_soft_penalty"][1]["rows"] if "train/loss" in r]
    base = [r for r in arms["gspo"][1]["rows"] if "train/loss" in r]
    for r, b in zip(rows, base):
        assert -1.0 <= r["rollout/overlong_penalty"] <= 0.0
        # the same responses as the plain gspo arm at step 1 (same seed): reward + penalty
        if r["step"] == 1:
            assert r["rollout/reward_mean"] == pytest.approx(
                b["rollout/reward_mean"] + r["rollout/overlong_penalty"], abs=1e-6)
    assert any(r["rollout/overlong_penalty"] < 0 for r in rows)
