"""Asynchronous rollouts over HTTP: the project's SGLang client and rollout producer against the
stand-in of tests/async_standin.py (SGLang's API; tokens, log-probs and routes known functions of
seed, position and weight version; time spent in sleeps). Partial rollouts aborted at every
sync and resumed give the tokens of an uninterrupted generation, each token with the version
that sampled it; the sync protocol (pause, update(k), continue) shows in the server's event log
with no token emitted while paused; generation overlaps training in one_step_off and not in
sync; a failed update or a hung server ends a run with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from megatron_gspo.rollout.producer import Producer, Schedule, staleness_of
from megatron_gspo.rollout.sglang.engine import SGLangEngine
from megatron_gspo.rollout.types import SamplingParams
from tests import async_standin
from tests.async_standin import synthetic_logprob, synthetic_routes, synthetic_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP, GROUP, PROMPTS = 2, 2, 3


def events(url: str) -> list:
    with urllib.request.urlopen(url + "/_events", timeout=30) as r:
        return json.loads(r.read())


def run_schedule(url, hf_dir, *, steps, staleness, segment, abort_at_sync, train_s,
                 max_new_tokens=40, routes=True):
    """The trainer's side, its training a sleep of ``train_s``: per step the batch, then the
    sync through SGLang's protocol (pause, update with the version label, continue; every
    server then reports it). Returns each step's samples and the producer's busy spans with
    the training spans."""
    engine = SGLangEngine([url], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3],
                          return_routes=routes, rows_per_request=4, max_in_flight=4)
    engine.update_weights_from_disk(hf_dir, 0)
    producer = Producer(
        engine, draw=lambda step: [((step, i), [1, 5 + i, 9 + step], i * GROUP)
                                   for i in range(PROMPTS)],
        seed_of=lambda step: 1_000 + step, group_size=GROUP,
        params=SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(STOP,)),
        schedule=Schedule(staleness=staleness, segment=segment, abort_at_sync=abort_at_sync,
                          last_step=steps), threaded=True, wait_s=120)
    out, trained = [], []
    try:
        for step in range(1, steps + 1):
            _, samples = producer.batch(step)
            out.append(samples)
            start = time.monotonic()
            time.sleep(train_s)
            trained.append((start, time.monotonic()))
            producer.quiesce()
            engine.update_weights_from_disk(hf_dir, step)
            engine.check_version(step)
            producer.set_version(step)
    finally:
        producer.close()
    return out, producer, trained


@pytest.fixture(scope="module")
def slow_server(tiny_hf_checkpoint):
    url, proc = async_standin.start(tiny_hf_checkpoint, base_tokens=14, tail_every=3,
                                    tail_factor=2, token_latency_s=0.02)
    yield url
    proc.kill()
    proc.join()


def test_partial_rollouts_resume_exactly_with_a_version_per_token(slow_server,
                                                                  tiny_hf_checkpoint):
    """Every sync aborts the requests in flight; each resumes under the new weights. Tokens:
    those of an uninterrupted generation; per token a behaviour log-prob and a version, the
    stand-in's log-prob under that version; the routes of every position fed spliced from the
    segment that sampled its token."""
    batches, _, _ = run_schedule(slow_server, tiny_hf_checkpoint, steps=5, staleness=2,
                                 segment=0, abort_at_sync=True, train_s=0.12)
    spanning = 0
    for step, samples in enumerate(batches, 1):
        for k, s in enumerate(samples):
            seed = (1_000 + step) * 7_919 + k  # row k of the step's batch (rows i * GROUP + j)
            p, n = len(s.prompt_ids), len(s.response_ids)
            want = [synthetic_token(seed, p + i, 128, STOP) for i in range(n - 1)] + [STOP]
            assert s.response_ids == want and s.finish_reason == "stop"
            assert n in (14, 28)  # the whole response: none cut short by an abort
            versions = s.versions_R.tolist()
            assert len(versions) == n == len(s.logprobs_R)
            assert versions == sorted(versions) and 0 <= staleness_of(step, s) <= 2
            assert s.logprobs_R.tolist() == pytest.approx(
                [synthetic_logprob(t, p + i, v) for i, (t, v) in enumerate(
                    zip(s.response_ids, versions))], abs=1e-6)
            seq = s.prompt_ids + s.response_ids
            assert s.routes_TLK.shape[0] == p - 1 + n  # every position fed: one row each
            for q in range(p - 1, p - 1 + n):  # the position that sampled token q + 1
                want_route = synthetic_routes(seq[q], q, versions[q - p + 1], 4, 2)
                assert s.routes_TLK[q, 0].tolist() == want_route
            spanning += len(set(versions)) > 1
    assert spanning >= 3  # responses generated across syncs, resumed under new weights


def test_the_sync_protocol_in_the_servers_log(tiny_hf_checkpoint):
    """pause -> update(k) -> continue at every sync, no token emitted while paused, and the
    server holds version k before it emits any token of version k."""
    url, proc = async_standin.start(tiny_hf_checkpoint, base_tokens=10, token_latency_s=0.01)
    try:
        run_schedule(url, tiny_hf_checkpoint, steps=4, staleness=1, segment=4,
                     abort_at_sync=False, train_s=0.05, routes=False)
        log = events(url)
    finally:
        proc.kill()
        proc.join()
    control = [(e["kind"], e.get("version")) for e in log if e["kind"] != "token"]
    assert control == [x for k in range(5) for x in
                       (("pause", None), ("update", str(k)), ("continue", None))]
    paused = None
    updated_at = {}
    for e in log:
        if e["kind"] == "pause":
            paused = e["t"]
        elif e["kind"] == "continue":
            paused = None
        elif e["kind"] == "update":
            updated_at[e["version"]] = e["t"]
        elif e["kind"] == "token":
            assert paused is None, "a token emitted while paused"
            assert e["t"] >= updated_at[e["version"]]
    assert sum(e["kind"] == "token" for e in log) > 0


def test_generation_overlaps_training_in_one_step_off_and_not_in_sync(tiny_hf_checkpoint):
    """Busy time of generation inside the trainer's steps 2..N-1: none in the synchronous
    schedule (eta 0: each batch is generated before its step), nearly all of it in
    one_step_off when generating a batch takes longer than training."""
    url, proc = async_standin.start(tiny_hf_checkpoint, base_tokens=12, token_latency_s=0.025)
    try:
        share = {}
        for name, eta in (("sync", 0), ("one_step_off", 1)):
            _, producer, trained = run_schedule(url, tiny_hf_checkpoint, steps=5, staleness=eta,
                                                segment=0, abort_at_sync=False, train_s=0.2,
                                                routes=False)
            inner = trained[1:-1]
            busy = sum(producer.busy_within(a, b) for a, b in inner)
            share[name] = busy / sum(b - a for a, b in inner)
    finally:
        proc.kill()
        proc.join()
    assert share["sync"] == 0.0
    assert share["one_step_off"] >= 0.9, share


def trainer_command(hf_dir: str, url: str, run_dir: str, *extra: str) -> list:
    from tests.sglang_workers import SGLANG_JOB
    from tests.trainer_workers import merge, to_overrides

    cfg = merge(SGLANG_JOB, {
        "rollout": {"sglang_urls": [url], "sglang_model_path": hf_dir, "mode": "async",
                    "max_staleness": 1, "weight_sync": "distributed", "weight_sync_port": 0,
                    "sglang_gpus_per_server": 1, "sglang_generate_timeout_s": 1.0,
                    "sglang_control_timeout_s": 5.0, "sglang_update_timeout_s": 10.0},
        "algo": {"rollout_correction": "decoupled"},
        "trainer": {"init_from": hf_dir, "steps": 4}, "data": {"eval_size": 0},
        "logging": {"drift": False, "progress": False}})
    return [sys.executable, "-m", "megatron_gspo", *to_overrides(cfg), *extra,
            f"hydra.run.dir={run_dir}"]


@pytest.mark.parametrize("fault, message", [
    ({"mode": "update_500", "version": 2},
     "rollout error: POST {url}/update_weights_from_distributed failed (a weight update is sent "
     "once, never retried): HTTP 500"),
    ({"mode": "hang_generate", "version": 1},
     "rollout error: POST {url}/generate failed after 4 attempts: TimeoutError")])
def test_a_failed_update_or_a_hung_server_ends_the_run_with_one_line(tiny_hf_checkpoint, tmp_path,
                                                                    fault, message):
    url, proc = async_standin.start(tiny_hf_checkpoint, base_tokens=4, token_latency_s=0.002)
    try:
        req = urllib.request.Request(url + "/_fault", data=json.dumps(fault).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()
        cmd = trainer_command(tiny_hf_checkpoint, url, str(tmp_path / "run"))
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        ended = time.monotonic()  # (CLOCK_MONOTONIC: the server's clock too)
        struck = [e["t"] for e in events(url) if e["kind"] == "fault"]
    finally:
        proc.kill()
        proc.join()
    assert out.returncode == 4, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(url=url)), out.stderr[-3000:]
    assert struck and ended - struck[0] < 30  # the process, threads and all, gone within 30 s
