"""Checkpoints and faults on the real entry point: SIGKILL and exact resume, a kill while writing a
checkpoint, SIGTERM and the requeue exit code, NaN updates, and loading into another layout."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_gspo.checkpoint.manager import check_complete
from megatron_gspo.trainer.faults import NONFINITE_EXIT_CODE, REQUEUE_EXIT_CODE
from tests.distributed import run_ranks
from tests.trainer_workers import (SHORT, merge, nan_update_job, read_metrics, step0_resume_job,
                                   to_overrides, train_job)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESUME_CFG = merge(SHORT, {"trainer": {"steps": 6}, "seed": 3})


def command(cfg, run_dir):
    return [sys.executable, "-m", "megatron_gspo", *to_overrides(cfg), f"hydra.run.dir={run_dir}"]


def launch(cfg, run_dir):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen(command(cfg, run_dir), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def latest_step(run_dir):
    try:
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            return int(f.read().strip().split("_")[1])
    except (OSError, ValueError, IndexError):
        return -1


def wait_for_step(proc, run_dir, step, timeout=300):
    t0 = time.time()
    while latest_step(run_dir) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout
        time.sleep(0.05)


def comparable(rows):
    """Per-step metrics without wall-clock figures."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    code, _, err = finish(launch(RESUME_CFG, run_dir))
    assert code == 0, err[-3000:]
    return read_metrics(run_dir)


def test_sigkill_then_resume_is_bitwise_identical(uninterrupted, tmp_path):
    proc = launch(RESUME_CFG, tmp_path)
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(tmp_path / "checkpoints" / "step_000003" / "trainer_state.json") as f:
        assert json.load(f)["optimizer_format"] == "fully_reshardable"  # auto, on CPU
    code, out, err = finish(launch(RESUME_CFG, tmp_path))
    assert code == 0, err[-3000:]
    assert "resumed from" in out
    assert comparable(read_metrics(tmp_path)) == comparable(uninterrupted)


def test_kill_while_writing_a_checkpoint(uninterrupted, tmp_path):
    cfg = merge(RESUME_CFG, {"trainer": {"kill_during_save": 2}})
    code, _, _ = finish(launch(cfg, tmp_path))
    assert code == -signal.SIGKILL
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / ".tmp-step_000002").is_dir()  # the shards were on disk, nothing committed
    assert latest_step(tmp_path) == 1 and check_complete(str(ckpts / "step_000001")) is None
    code, out, err = finish(launch(RESUME_CFG, tmp_path))
    assert code == 0, err[-3000:]
    assert "step_000001 (step 1" in out
    assert not any(p.name.startswith(".tmp-") for p in ckpts.iterdir())  # cleaned up
    assert comparable(read_metrics(tmp_path)) == comparable(uninterrupted)


def test_corrupt_latest_checkpoint_is_skipped(uninterrupted, tmp_path):
    cfg = merge(RESUME_CFG, {"trainer": {"steps": 4, "keep_checkpoints": 3}})
    code, _, err = finish(launch(cfg, tmp_path))
    assert code == 0, err[-3000:]
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == [
        "step_000002", "step_000003", "step_000004"]  # keep the last 3
    shard = max((p for p in (ckpts / "step_000004").rglob("*") if p.is_file()
                 and p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    code, out, err = finish(launch(RESUME_CFG, tmp_path))
    assert code == 0, err[-3000:]
    assert "skipping checkpoint" in err and "step_000004" in err
    assert "step_000003 (step 3" in out
    assert comparable(read_metrics(tmp_path)) == comparable(uninterrupted)


def test_sigterm_checkpoints_and_exits_for_requeue(uninterrupted, tmp_path):
    proc = launch(RESUME_CFG, tmp_path)
    wait_for_step(proc, tmp_path, 1)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == REQUEUE_EXIT_CODE, err[-3000:]
    assert "stopped by SIGTERM" in err
    stopped_at = latest_step(tmp_path)
    assert 2 <= stopped_at < 6  # the step boundary after the signal
    assert check_complete(str(tmp_path / "checkpoints" / f"step_{stopped_at:06d}")) is None
    resumed = subprocess.Popen(command(RESUME_CFG, tmp_path), cwd=ROOT, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"),  # (warnings shown)
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    code, out, err = finish(resumed)
    assert code == 0 and err == "", err[-3000:]  # a resume's console is as clean as a start's
    assert f"(step {stopped_at}," in out and "differs from the checkpoint's" not in out
    assert comparable(read_metrics(tmp_path)) == comparable(uninterrupted)
    # the same directory with a model of another shape: one line, nothing loaded or written
    other = merge(RESUME_CFG, {"model": {"num_experts": 8}, "trainer": {"steps": 8}})
    code, out, err = finish(launch(other, tmp_path))
    assert code == 2 and err.splitlines() == [
        f"config error: model.num_experts=8: the checkpoint {tmp_path}/checkpoints/step_000006 "
        "holds a model with model.num_experts=4; fix: resume with model.num_experts=4, or start "
        "another run directory (hydra.run.dir=...)"], err[-3000:]
    assert latest_step(tmp_path) == 6


def test_a_resume_names_what_differs_from_the_checkpoints_configuration():
    from megatron_gspo.trainer.resume_point import config_changes

    saved = {"algo": {"name": "gspo", "clip_low": 3e-4}, "trainer": {"steps": 4, "resume": "auto"},
             "model": {"stop_ids": [1, 2]}, "run_dir": "/a"}
    now = {"algo": {"name": "grpo", "clip_low": 3e-4}, "trainer": {"steps": 8, "resume": "x"},
           "model": {"stop_ids": (1, 2)}, "run_dir": "/b", "seed": 5}
    assert config_changes(saved, now) == [("algo.name", "gspo", "grpo"),  # (seed: added since)
                                          ("trainer.steps", 4, 8)]
    assert config_changes(saved, saved) == []


def test_nan_update_is_skipped_with_state_unchanged(tmp_path):
    cfg = merge(SHORT, {"run_dir": str(tmp_path)})
    for world, extra in ((1, {}), (2, {"parallel": {"ep": 2}})):
        out = run_ranks(nan_update_job, world, merge(cfg, extra))[0]
        assert out["first_applied"] and not out["second_applied"], out
        assert out["skipped"] == 1
        assert out["params_equal"] and out["moments_equal"] and out["num_moments"] > 0
        assert out["third_applied"] and out["params_changed_after"]


def test_resume_from_checkpoint_zero_starts_a_fresh_optimizer(tmp_path):
    """Checkpoint 0 (after the warm-up, before RL) has no optimizer state: resuming from it must
    not leave the zero-gradient step that allocates Adam's state for a load (step 1, a smaller
    bias-corrected first update): the same updates give bitwise the same weights."""
    out = run_ranks(step0_resume_job, 1, merge(SHORT, {"run_dir": str(tmp_path)}))[0]
    assert out["weights_restored"] and out["moved"]
    assert out["steps_after_load"] == []  # no Adam state before the first RL update
    assert out["fresh_steps"] == out["resumed_steps"] == [2.0]
    assert out["same_weights"]


def test_consecutive_nan_updates_stop_the_run(tmp_path):
    cfg = merge(RESUME_CFG, {"trainer": {"nan_at_updates": [5, 6, 7], "max_consecutive_skips": 3}})
    code, _, err = finish(launch(cfg, tmp_path))
    assert code == NONFINITE_EXIT_CODE, err[-3000:]
    assert "3 consecutive non-finite updates (last at update 7)" in err
    assert latest_step(tmp_path) == 1  # updates 5-7 are in step 2: step 1's checkpoint is the last
    assert check_complete(str(tmp_path / "checkpoints" / "step_000001")) is None
    rows = read_metrics(tmp_path)
    assert [r["train/skipped_updates"] for r in rows if "train/skipped_updates" in r] == [0.0]


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """A 3-step EP=2 run (2 ranks), whose step-2 checkpoint the layout tests resume from."""
    root = tmp_path_factory.mktemp("ep2")
    cfg = merge(SHORT, {"seed": 9, "trainer": {"steps": 3}})
    out = run_ranks(train_job, 2, merge(cfg, {"parallel": {"ep": 2}, "run_dir": str(root)}))[0]
    return cfg, root / "checkpoints" / "step_000002", out


def test_checkpoint_loads_into_another_layout(ep2_run, tmp_path):
    """Saved on EP=2 (2 ranks), resumed on PP=2 x EP=2 (4 ranks): the next step matches the EP=2
    run's (weights, Adam moments, schedule and data position all carried over)."""
    cfg, src, two = ep2_run
    tp = run_ranks(train_job, 4, merge(cfg, {
        "parallel": {"pp": 2, "ep": 2}, "trainer": {"resume": str(src)},
        "run_dir": str(tmp_path / "pp2ep2")}))[0]
    a = [r for r in two["rows"] if r["step"] == 3 and "train/loss" in r][0]
    b = [r for r in tp["rows"] if r["step"] == 3 and "train/loss" in r][0]
    assert [r["step"] for r in tp["rows"] if "train/loss" in r] == [3]
    assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
    for key in ("train/loss", "train/ratio_mean", "train/grad_norm", "train/lr", "train/entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    with open(tmp_path / "pp2ep2" / "checkpoints" / "step_000003" / "trainer_state.json") as f:
        assert json.load(f)["layout"]["pp"] == 2


def test_checkpoint_loads_into_one_rank(ep2_run, tmp_path, capfd):
    """EP=2 -> 1 rank splits the optimizer differently (no separate expert group): the weights,
    schedule and data position load, the moments restart with a warning, training continues."""
    cfg, src, _ = ep2_run
    capfd.readouterr()
    one = run_ranks(train_job, 1, merge(cfg, {"trainer": {"resume": str(src)},
                                              "run_dir": str(tmp_path / "one")}))[0]
    assert "its moments restart" in capfd.readouterr().err
    rows = [r for r in one["rows"] if "train/loss" in r]
    assert [r["step"] for r in rows] == [3] and rows[0]["minibatch/ratio_mean"][0] == 1.0


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """A 3-step DP=2 run saving its moments dp_reshardable (each rank its own shard)."""
    root = tmp_path_factory.mktemp("dp2")
    cfg = merge(SHORT, {"seed": 5, "trainer": {"steps": 3, "checkpoint_format": "dp_reshardable"}})
    out = run_ranks(train_job, 2, merge(cfg, {"run_dir": str(root)}))[0]
    return cfg, root / "checkpoints" / "step_000002", out


def test_dp_reshardable_moments_load_into_another_data_parallel_size(dp2_run, tmp_path, capfd):
    """DP=2 -> 1 rank: the moments load (no warning) and the next step matches the DP=2 run's
    (dp_reshardable: each rank writes its own shard, the GPU default)."""
    cfg, src, two = dp2_run
    with open(src / "trainer_state.json") as f:
        assert json.load(f)["optimizer_format"] == "dp_reshardable"
    capfd.readouterr()
    one = run_ranks(train_job, 1, merge(cfg, {"trainer": {"resume": str(src)},
                                              "run_dir": str(tmp_path / "one")}))[0]
    assert "moments restart" not in capfd.readouterr().err
    a = [r for r in two["rows"] if r["step"] == 3 and "train/loss" in r][0]
    b = [r for r in one["rows"] if r["step"] == 3 and "train/loss" in r][0]
    assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
    for key in ("train/loss", "train/ratio_mean", "train/grad_norm", "train/lr", "train/entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_dp_reshardable_moments_restart_on_another_model_parallel_layout(dp2_run, tmp_path, capfd):
    """DP=2 -> TP=2 with SP: dp_reshardable moments fit only their own model-parallel layout, so
    the weights, schedule and data position load and the moments restart, with a warning that
    says how to save for a layout change."""
    cfg, src, _ = dp2_run
    capfd.readouterr()
    tp = run_ranks(train_job, 2, merge(cfg, {
        "parallel": {"tp": 2, "sequence_parallel": True}, "trainer": {"resume": str(src)},
        "run_dir": str(tmp_path / "tp2")}))[0]
    err = capfd.readouterr().err
    assert "saved dp_reshardable" in err and "its moments restart" in err
    assert "trainer.checkpoint_format=fully_reshardable" in err
    rows = [r for r in tp["rows"] if "train/loss" in r]
    assert [r["step"] for r in rows] == [3] and rows[0]["minibatch/ratio_mean"][0] == 1.0

