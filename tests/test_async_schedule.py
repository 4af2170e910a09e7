"""The asynchronous rollout producer's schedule (megatron_gspo/rollout/producer.py), in process
against an engine whose outputs are known functions (the async stand-in's) and whose requests
take random time: the staleness bound, the admission bound, every prompt trained once, no
length bias, eta = 0 as the synchronous loop's batches, and the same batches whatever the
timing."""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch

from megatron_gspo.rollout.producer import Producer, Schedule, admissible, staleness_of
from megatron_gspo.rollout.types import RolloutError, Sample, SamplingParams
from tests.async_standin import row_length, synthetic_logprob, synthetic_token

VOCAB, STOP, GROUP, PROMPTS = 64, 2, 3, 4


class KnownEngine:
    """``generate_rows`` in process: a row's tokens are ``synthetic_token(seed, position)``, it
    ends after ``row_length(seed)`` tokens counted from its first input, log-probs are
    ``synthetic_logprob`` under the engine's version; each call sleeps a random time (its own
    jitter RNG) and checks the producer's bounds while it generates."""

    def __init__(self, jitter_seed: int, base: int = 5, tail_every: int = 4, factor: int = 3,
                 latency_s: float = 0.004):
        self.rng, self.lock = random.Random(jitter_seed), threading.Lock()
        self.base, self.tail_every, self.factor, self.latency_s = base, tail_every, factor, latency_s
        self.version, self.first, self.producer, self.calls = 0, {}, None, 0
        self.generated = []  # (seed, length) of every finished response

    def generate_rows(self, requests, params, *, aborted_ok=False):
        with self.lock:
            delay = self.rng.random() * self.latency_s
            self.calls += 1
        time.sleep(delay)
        p = self.producer
        waiting = len(p.groups)  # admitted, not yet trained
        assert waiting <= (p.schedule.staleness + 1) * PROMPTS, waiting
        out = []
        for r in requests:
            first = self.first.setdefault(r.seed, len(r.input_ids))
            end = first + row_length(r.seed, self.base, self.tail_every, self.factor)
            n = min(r.max_new_tokens, end - len(r.input_ids))
            pos = len(r.input_ids)
            tokens = [STOP if pos + i == end - 1 else synthetic_token(r.seed, pos + i, VOCAB, STOP)
                      for i in range(n)]
            done = pos + n == end
            if done:
                self.generated.append((r.seed, end - first))
            out.append(Sample(prompt_ids=list(r.input_ids), response_ids=tokens,
                              logprobs_R=torch.tensor([synthetic_logprob(t, pos + i, self.version)
                                                       for i, t in enumerate(tokens)]),
                              finish_reason="stop" if done else "length",
                              meta={"weight_version": str(self.version)}))
        return out


def producer_for(engine, *, staleness: int, segment: int, steps: int, threaded: bool = True):
    drawn = []

    def draw(step):
        drawn.append(step)
        return [((step, i), [1, 4 + i, 5 + step % 7], i * GROUP) for i in range(PROMPTS)]

    p = Producer(engine, draw=draw, seed_of=lambda step: 31 * step,
                 params=SamplingParams(max_new_tokens=24, stop_token_ids=(STOP,)),
                 group_size=GROUP, schedule=Schedule(staleness=staleness, segment=segment,
                                                     abort_at_sync=False, last_step=steps),
                 threaded=threaded, wait_s=60)
    engine.producer = p
    return p, drawn


def train(p, engine, steps: int, trainer_rng: random.Random):
    """The trainer's side: take each batch, 'train' a random while, sync the version."""
    batches = []
    try:
        for step in range(1, steps + 1):
            records, samples = p.batch(step)
            batches.append((records, samples))
            time.sleep(trainer_rng.random() * 0.004)
            p.quiesce()
            engine.version = step
            p.set_version(step)
    finally:
        p.close()
    return batches


def batch_hash(samples) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(repr((s.prompt_ids, s.response_ids, s.versions_R.tolist(),
                       s.logprobs_R.tolist())).encode())
    return h.hexdigest()


def test_admission_and_staleness_definitions():
    assert admissible(step=3, version=1, staleness=1) and not admissible(4, 1, 1)
    assert admissible(1, 0, 0) and not admissible(2, 0, 0)
    s = Sample([1], [5, 6, 7], torch.zeros(3), "stop", versions_R=torch.tensor([2, 3, 3]))
    assert staleness_of(5, s) == 2  # step 5 trains version 4; its oldest token is version 2


@pytest.mark.parametrize("seed", range(50))
def test_schedule_holds_its_bounds_over_random_timing(seed):
    rng = random.Random(seed)
    staleness, segment, steps = rng.choice([0, 1, 2, 3]), rng.choice([0, 2, 5]), rng.randint(3, 6)
    engine = KnownEngine(jitter_seed=seed)
    p, drawn = producer_for(engine, staleness=staleness, segment=segment, steps=steps)
    batches = train(p, engine, steps, random.Random(1000 + seed))
    assert drawn == list(range(1, steps + 1))  # admitted in order, nothing past the last step
    consumed = [rec for records, _ in batches for rec in records[::GROUP]]
    assert consumed == [(s, i) for s in range(1, steps + 1) for i in range(PROMPTS)]  # once each
    lengths = []
    for step, (records, samples) in enumerate(batches, 1):
        assert all(rec[0] == step for rec in records)
        for s in samples:
            assert 0 <= staleness_of(step, s) <= staleness
            assert len(s.response_ids) == len(s.logprobs_R) == len(s.versions_R)
            assert s.versions_R.tolist() == sorted(s.versions_R.tolist())
            lengths.append(len(s.response_ids))
    # every generated response is trained, at its full length: no length bias
    assert sorted(lengths) == sorted(n for _, n in engine.generated)


def test_eta_zero_gives_the_synchronous_batches():
    """At eta = 0 every batch is generated after the previous sync, by the version its step
    trains: the rows the synchronous loop would generate (same prompts, seeds, version)."""
    engine = KnownEngine(jitter_seed=3)
    p, _ = producer_for(engine, staleness=0, segment=0, steps=4)
    batches = train(p, engine, 4, random.Random(0))
    sync = KnownEngine(jitter_seed=9)
    for step, (_, samples) in enumerate(batches, 1):
        sync.version = step - 1
        from megatron_gspo.rollout.types import RowRequest

        reqs = [RowRequest(s.prompt_ids, 24, 31 * step * 7_919 + i * GROUP + j)
                for i in range(PROMPTS) for j in range(GROUP) for s in [samples[i * GROUP + j]]]
        sync.producer = p
        expected = sync.generate_rows(reqs, None)
        for got, want in zip(samples, expected):
            assert got.response_ids == want.response_ids
            assert torch.equal(got.logprobs_R, want.logprobs_R)
            assert set(got.versions_R.tolist()) == {step - 1}


@pytest.mark.parametrize("segment", [0, 3])
def test_the_same_batches_whatever_the_timing(segment):
    """Segments (or whole responses) per round and syncs between rounds: the tokens, their
    versions and behaviour log-probs of every step do not depend on how long anything took."""
    hashes = []
    for jitter in (1, 2, 3):
        engine = KnownEngine(jitter_seed=jitter, latency_s=0.01 * jitter)
        p, _ = producer_for(engine, staleness=2, segment=segment, steps=5)
        batches = train(p, engine, 5, random.Random(jitter))
        hashes.append([batch_hash(samples) for _, samples in batches])
    assert hashes[0] == hashes[1] == hashes[2]
    assert len(set(hashes[0])) == 5


def test_a_failing_engine_ends_the_wait_with_its_error():
    class Broken(KnownEngine):
        def generate_rows(self, requests, params, *, aborted_ok=False):
            raise RuntimeError("connection refused")

    engine = Broken(jitter_seed=0)
    p, _ = producer_for(engine, staleness=1, segment=0, steps=3)
    with pytest.raises(RolloutError, match="the rollout producer failed: RuntimeError: "
                                           "connection refused"):
        p.batch(1)
    p.close()
    assert p._thread is None


def test_a_reply_of_another_version_is_caught():
    engine = KnownEngine(jitter_seed=0)
    p, _ = producer_for(engine, staleness=1, segment=0, steps=3)
    engine.version = 7  # the servers hold other weights than the producer was told
    with pytest.raises(RolloutError, match="generated by weight version '7' while the producer "
                                           "expected 0"):
        p.batch(1)
    p.close()
