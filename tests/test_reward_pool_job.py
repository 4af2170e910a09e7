"""Rewards through the pool in the job: 2 RL steps on a prompt file of stdin/stdout programming
tasks with the code reward (tests.reward_fixtures.scripted_code): some programs are right, some
loop forever (killed by the sandbox), some rewards raise and some hang past the pool's timeout.
The steps complete, failures are counted, nothing crashes."""

import json

from tests.distributed import run_ranks
from tests.trainer_workers import SHORT, merge, scripted_code_job


def test_code_rewards_through_the_pool(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    with open(tasks, "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"Task {i}: print the number doubled.",
                                "tests": [["2\n", "4\n"], [f"{i}\n", f"{2 * i}\n"]]}) + "\n")
    cfg = merge(SHORT, {
        "data": {"task": "files", "files": [str(tasks)], "eval_files": [str(tasks)],
                 "eval_size": 2, "reward": "scripted_code", "reward_workers": 2,
                 "reward_timeout_s": 5.0},
        "trainer": {"steps": 2, "sft_steps": 0, "save_interval": 0},
        "run_dir": str(tmp_path / "run"), "seed": 4})
    result = run_ranks(scripted_code_job, 1, cfg, timeout=600)[0]
    rows = [r for r in result["rows"] if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    failures = sum(r["rollout/reward_failures"] for r in rows)
    assert failures > 0  # rewards that raised (and any that hung) scored 0 and were counted
    assert any(r["rollout/reward_mean"] > 0 for r in rows)  # right programs still scored
    assert all(r["rollout/reward_mean"] < 1 for r in rows)  # looping programs scored 0
