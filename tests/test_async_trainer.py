"""The trainer with asynchronous rollouts (``rollout.mode``), end to end on real gloo ranks
against the async stand-in (tests/async_standin.py): eta = 0 trains on the synchronous loop's
batches, bitwise; partial rollouts in segments give the same batches (tokens, versions,
behaviour log-probs) and the same final weights whatever the servers' timing, and after a kill
and a resume; TP=2+SP and DP=2 (two replica leaders) keep the staleness bound and SGLang's sync
protocol; the local engine's one-step-off trains each batch one version late."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import async_standin
from tests.async_workers import async_job, async_jobs, checkpoints, events_of
from tests.distributed import run_ranks
from tests.trainer_workers import SHORT, merge, to_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def server(tiny_hf_checkpoint):
    started = []

    def start(**kw):
        url, proc = async_standin.start(tiny_hf_checkpoint, **kw)
        started.append(proc)
        return url

    yield start
    for proc in started:
        proc.kill()
        proc.join()


def test_eta_zero_trains_on_the_synchronous_batches(server, tiny_hf_checkpoint, tmp_path):
    url = server(base_tokens=5, tail_every=3, tail_factor=2, token_latency_s=0.002)
    hf = tiny_hf_checkpoint
    sync, eta0 = run_ranks(async_jobs, 1, [
        async_job(hf, url, str(tmp_path / "sync"), rollout={"mode": "sync"}),
        async_job(hf, url, str(tmp_path / "eta0"), rollout={"max_staleness": 0})])[0]
    assert [s["tokens_and_logprobs"] for s in sync["steps"]] == \
        [s["tokens_and_logprobs"] for s in eta0["steps"]]
    assert sync["params"] == eta0["params"]
    assert all(lag == 0 for s in eta0["steps"] for lag in s["staleness"])
    trained = [r for r in eta0["rows"] if "train/grad_norm" in r]
    assert len(trained) == 3 and all(r["train/grad_norm"] > 0 for r in trained)  # it learns


def test_partial_rollouts_reproduce_across_timing_and_a_kill(server, tiny_hf_checkpoint,
                                                            tmp_path):
    """Segments of 3 tokens, eta 1: one run against a fast server, one against a slow one
    with other jitter, one killed while writing checkpoint 2 and resumed: the same batch of
    every step (tokens, versions, behaviour log-probs) and the same final weights."""
    hf = tiny_hf_checkpoint
    over = {"rollout": {"partial": True, "partial_segment_tokens": 3, "max_new_tokens": 9}}
    fast = server(base_tokens=7, tail_every=3, tail_factor=2, token_latency_s=0.001,
                  jitter=0.5, jitter_seed=1)
    slow = server(base_tokens=7, tail_every=3, tail_factor=2, token_latency_s=0.01,
                  jitter=2.0, jitter_seed=2)
    a, b = run_ranks(async_jobs, 1, [async_job(hf, fast, str(tmp_path / "a"), **over),
                                     async_job(hf, slow, str(tmp_path / "b"), **over)])[0]
    assert [s["hash"] for s in a["steps"]] == [s["hash"] for s in b["steps"]]
    assert a["params"] == b["params"]
    assert all(r["train/grad_norm"] > 0 for r in a["rows"] if "train/grad_norm" in r)
    versions = [max(s["staleness"]) for s in a["steps"]]
    assert versions[1:] == [1, 1]  # admitted a version ahead, as eta 1 allows
    # killed while writing checkpoint 2, resumed from checkpoint 1
    killed = async_job(hf, slow, str(tmp_path / "c"), **over)
    cmd = [sys.executable, "-c", "import json, sys; from tests.async_workers import kill_at; "
           "kill_at(json.loads(sys.argv[1]), 2)", json.dumps(killed)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    assert out.returncode == -9, out.stderr[-2000:]
    assert checkpoints(str(tmp_path / "c")) == ["step_000000", "step_000001"]
    (c,) = run_ranks(async_jobs, 1, [killed])[0]
    assert [s["step"] for s in c["steps"]] == [2, 3]
    assert [s["hash"] for s in c["steps"]] == [s["hash"] for s in a["steps"][1:]]
    assert c["params"] == a["params"]


@pytest.mark.parametrize("layout", [{"tp": 2, "sequence_parallel": True}, {}])
def test_async_layouts_keep_the_bound_and_the_protocol(server, tiny_hf_checkpoint, tmp_path,
                                                       layout):
    """TP=2 with SP (one replica: its leader's producer, the batch broadcast) and DP=2 (two
    replica leaders, each its own producer and server): every sample within eta, every rank of
    a replica on the same batch, and each server's log pause -> update(k) -> continue."""
    hf = tiny_hf_checkpoint
    urls = [server(base_tokens=5, tail_every=3, tail_factor=2, token_latency_s=0.005)
            for _ in range(2 if not layout else 1)]
    cfg = async_job(hf, urls[0], str(tmp_path / "run"), parallel=layout,
                    rollout={"partial": True, "partial_segment_tokens": 2})
    cfg["rollout"]["sglang_urls"] = urls
    ranks = [r[0] for r in run_ranks(async_jobs, 2, [cfg])]
    for r in ranks:
        assert [s["step"] for s in r["steps"]] == [1, 2, 3]
        assert all(0 <= lag <= 1 for s in r["steps"] for lag in s["staleness"])
    if layout:  # one replica: both ranks trained on the leader's batch
        assert [s["hash"] for s in ranks[0]["steps"]] == [s["hash"] for s in ranks[1]["steps"]]
    else:  # two replicas: each its own half of the prompts
        assert all(x["hash"] != y["hash"] for x, y in zip(ranks[0]["steps"], ranks[1]["steps"]))
    rows = [row for row in ranks[0]["rows"] if "rollout/staleness_max" in row]
    assert [row["rollout/staleness_max"] for row in rows] == [0, 1, 1]
    for url in urls:
        control = [(e["kind"], e.get("version")) for e in events_of(url) if e["kind"] != "token"]
        syncs = [c for c in control if c[0] != "update"]
        assert syncs == [("pause", None), ("continue", None)] * 4  # warm-up and three steps
        assert [v for k, v in control if k == "update"][-1] == "3"


def test_the_local_engine_trains_one_step_off(tmp_path):
    """The in-process engine: no overlap on one device, but the schedule of one-step-off (each
    batch generated by the policy one version older than the one it trains)."""
    from tests.trainer_workers import read_metrics

    cfg = merge(SHORT, {"rollout": {"mode": "one_step_off"}, "algo": {"rollout_correction":
                                                                      "decoupled"},
                        "trainer": {"steps": 3, "sft_steps": 0, "save_interval": 0},
                        "logging": {"drift": False, "progress": False}, "data": {"eval_size": 4}})
    out = subprocess.run([sys.executable, "-m", "megatron_gspo", *to_overrides(cfg),
                          f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore",
                                               OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in read_metrics(str(tmp_path)) if "rollout/staleness_max" in r]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    assert [r["rollout/staleness/01"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["perf/overlap_fraction"] == 0.0 for r in rows)
    assert all(0 < r["train/rollout_correction/mean_weight"] for r in rows)
