"""intra_op: the training thread keeps its intra-op threads, gloo's work threads run on one and
start no OpenMP team (which would throttle the training thread's: see intra_op's docstring)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(mode: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "tests.intra_op_workers", mode], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
    return {mode: _run(mode) for mode in ("nopin", "pin", "init_parallel")}


def test_without_pinning_a_gloo_gather_starts_an_openmp_team(runs):
    # The failure the adaptation exists for, seen here: every thread takes two intra-op threads
    # and gloo's work thread starts a team of its own (one more OS thread) for a large gather.
    r = runs["nopin"]
    assert r["before"] == {"this": 2, "new": 2}
    assert r["after"]["new"] == 2
    assert r["gathered"]
    assert r["new_os_threads"] == 1


@pytest.mark.parametrize("mode", ["pin", "init_parallel"])
def test_pinning_keeps_this_threads_count_and_gives_others_one(runs, mode):
    r = runs[mode]
    assert r["pinned"] is (mode == "pin")
    assert r["before"] == {"this": 2, "new": 2}
    assert r["after"] == {"this": 2, "new": 1, "mkl": 2}
    assert r["gathered"] and r["matmul_ok"]
    assert r["new_os_threads"] == 0
