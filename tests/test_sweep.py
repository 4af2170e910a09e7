"""A local Hydra sweep of the main job (algo x replay, short settings), each run in its own
directory, and the side-by-side report of tools.compare_runs over it."""

import os
import subprocess
import sys

from tests.trainer_workers import SHORT, merge, to_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_local_sweep_and_compare_runs(tmp_path):
    short = to_overrides(merge(SHORT, {"trainer": {"steps": 2, "sft_steps": 0, "save_interval": 0},
                                       "algo": {}}))
    short = [o for o in short if not o.startswith("algo.")] + ["algo.minibatches=4"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "megatron_gspo", "-m", "algo=gspo,grpo",
                          "replay=none,r2", *short, f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted(d for d in os.listdir(sweep) if os.path.isfile(sweep / d / "metrics.jsonl"))
    assert len(runs) == 4, os.listdir(sweep)
    assert [d.split("-", 1)[1] for d in runs] == ["gspo-none-seed1234", "gspo-r2-seed1234",
                                                   "grpo-none-seed1234", "grpo-r2-seed1234"]
    report = tmp_path / "report.html"
    out = subprocess.run([sys.executable, "-m", "tools.compare_runs", str(sweep), "-o", str(report),
                          "--png-dir", str(tmp_path / "png")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    table = out.stdout
    for label in ("gspo (no replay)", "gspo + R2", "grpo (no replay)", "grpo + R2"):
        assert f"| {label} |" in table, table
    page = report.read_text()
    assert page.count("<tr>") == 5 and "data:image/png;base64," in page
    assert (tmp_path / "png" / "compare_runs.png").stat().st_size > 10_000


def test_compare_runs_names_a_bad_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.compare_runs", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == f"compare_runs: no run directories (with metrics.jsonl) under {tmp_path}"


def test_collapse_rule_and_the_per_arm_table():
    from tools.compare_runs import collapsed, table_by_arm

    assert not collapsed([0.1, 0.3, 0.5], 0.5)  # learned, kept it
    assert collapsed([0.1, 0.5, 0.2], 0.2)  # gained 0.4, kept 0.1 of it
    assert not collapsed([0.1, 0.5, 0.2], 0.4)  # fell, recovered
    assert not collapsed([0.3, 0.2], 0.1)  # never gained: no collapse to speak of
    base = {"reward_last10": 0.5, "clip_fraction": 0.01, "update_drift": 0.1,
            "ratio_noise_quotient": float("nan")}
    sums = [dict(base, run="grpo (no replay)", accuracy_start=0.1, accuracy_final=0.5,
                 collapsed=False),
            dict(base, run="grpo (no replay)", accuracy_start=0.1, accuracy_final=0.2,
                 collapsed=True)]
    table = table_by_arm(sums)
    assert "| grpo (no replay) | 2 | +0.250 (+0.100 .. +0.400) |" in table
    assert table.endswith("| n/a | 1 of 2 |")
