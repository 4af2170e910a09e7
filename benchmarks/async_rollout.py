"""Synchronous against asynchronous rollouts: wall clock of N RL steps, generation overlapped
with training.

    python benchmarks/async_rollout.py [--steps 20] [--train-s 0.5] [--gen-s 0.5]

The rollout side is real: the project's SGLang client and rollout producer against the SGLang
stand-in for asynchronous rollouts (``tests/async_standin.py``: SGLang's HTTP API, tokens known
functions of seed and position, time spent in sleeps so that two CPU cores are not the limit;
each weight sync is SGLang's protocol: pause, update with a version label, continue, every server
asked for its version). The trainer is a sleep of ``--train-s`` per step, so that what is
measured is the schedule. Each step's batch: ``--prompts`` x ``--group`` responses of
``--gen-s / --token-latency-s`` tokens; the heavy-tail workload makes one response in
``--tail-every`` ``--tail-factor`` times longer. Modes:

- sync: generate the step's batch, train, sync;
- one_step_off: the next batch generated while the step trains (staleness 1);
- async (eta = --staleness): batches admitted ahead; with partial rollouts in segments of
  ``--segment`` tokens (a sync waits for the round: a reproducible schedule) or aborted at each
  sync (``--segment 0``).

Prints each mode's wall clock, its speed-up over sync, the overlap of generation with training
(steps 2 to N-1), the weight sync's share of a step (the protocol's calls, not the wait for a
round to end) and the largest staleness; the last line is the speed-up of
async over sync on the heavy-tail workload.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_mode(url: str, hf_dir: str, *, mode: str, args, staleness: int, segment: int,
             abort_at_sync: bool) -> dict:
    from megatron_gspo.rollout.producer import Producer, Schedule, staleness_of
    from megatron_gspo.rollout.sglang.engine import SGLangEngine
    from megatron_gspo.rollout.types import SamplingParams

    engine = SGLangEngine([url], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3],
                          rows_per_request=args.prompts * args.group, max_in_flight=4)
    engine.update_weights_from_disk(hf_dir, 0)
    threaded = mode != "sync"
    schedule = Schedule(staleness=staleness, segment=segment, abort_at_sync=abort_at_sync,
                        last_step=args.steps)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                            stop_token_ids=(2,))
    def draw(step: int) -> list:
        return [(None, [5, 6, 7 + i % 50], (i * args.group)) for i in range(args.prompts)]

    # the same seeds in every mode: the same responses (and the same long ones) to generate
    producer = Producer(engine, draw=draw, seed_of=lambda step: 1_000 * step,
                        params=params, group_size=args.group, schedule=schedule,
                        threaded=threaded, wait_s=600)
    sync_s, worst, trained = [], 0, []
    t0 = time.monotonic()
    try:
        for step in range(1, args.steps + 1):
            _, samples = producer.batch(step)
            worst = max([worst] + [staleness_of(step, s) for s in samples])
            start = time.monotonic()
            time.sleep(args.train_s)  # the trainer's step
            trained.append((start, time.monotonic()))
            producer.quiesce()  # (one_step_off: the next batch is generated first)
            t1 = time.monotonic()
            engine.update_weights_from_disk(hf_dir, step)  # pause, update(version), continue
            engine.check_version(step)
            producer.set_version(step)
            sync_s.append(time.monotonic() - t1)
        wall = time.monotonic() - t0
    finally:
        producer.close()
    inner = trained[1:-1] or trained
    busy = sum(producer.busy_within(a, b) for a, b in inner)
    overlap = busy / sum(b - a for a, b in inner)
    return {"wall": wall, "overlap": overlap, "sync_share": statistics.mean(sync_s) / (
        wall / args.steps), "staleness": worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--train-s", type=float, default=0.5)
    p.add_argument("--gen-s", type=float, default=0.5, help="a batch of regular responses")
    p.add_argument("--token-latency-s", type=float, default=0.025)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--tail-every", type=int, default=16)
    p.add_argument("--tail-factor", type=int, default=8)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--segment", type=int, default=20)
    args = p.parse_args()
    from tests import async_standin
    from tests.conftest import make_hf_checkpoint

    tokens = max(2, round(args.gen_s / args.token_latency_s))
    args.max_new_tokens = tokens * args.tail_factor
    hf_dir = make_hf_checkpoint(tempfile.mkdtemp(prefix="async_bench_"))
    atexit.register(shutil.rmtree, hf_dir, True)
    print(f"{args.steps} steps, training {args.train_s:g} s per step (a sleep); batches of "
          f"{args.prompts} x {args.group} responses of {tokens} tokens at "
          f"{1e3 * args.token_latency_s:g} ms per decoding step ({args.gen_s:g} s per batch); "
          f"heavy tail: 1 response in {args.tail_every} {args.tail_factor}x longer")
    print(f"{'workload':10s} {'mode':34s} {'wall s':>7s} {'x sync':>7s} {'overlap':>8s} "
          f"{'sync/step':>10s} {'staleness':>9s}")
    results = {}
    for workload, tail in (("regular", 0), ("tail", args.tail_every)):
        url, proc = async_standin.start(hf_dir, base_tokens=tokens, tail_every=tail,
                                        tail_factor=args.tail_factor,
                                        token_latency_s=args.token_latency_s)
        modes = [("sync", "sync", 0, 0, False), ("one_step_off", "one_step_off", 1, 0, False),
                 (f"async eta={args.staleness}, partial segments of {args.segment}", "async",
                  args.staleness, args.segment, False),
                 (f"async eta={args.staleness}, partial, abort at sync", "async",
                  args.staleness, 0, True)]
        try:
            for label, mode, eta, segment, abort in modes:
                r = run_mode(url, hf_dir, mode=mode, args=args, staleness=eta,
                             segment=segment, abort_at_sync=abort)
                results[(workload, label)] = r
                base = results[(workload, "sync")]["wall"]
                print(f"{workload:10s} {label:34s} {r['wall']:7.2f} {base / r['wall']:6.2f}x "
                      f"{r['overlap']:8.2f} {100 * r['sync_share']:9.1f}% {r['staleness']:9d}")
        finally:
            proc.kill()
    regular_off = results[("regular", "one_step_off")]["wall"]
    print(f"one_step_off speed-up over sync (regular): "
          f"{results[('regular', 'sync')]['wall'] / regular_off:.2f}x")
    tail_off = results[("tail", "one_step_off")]["wall"]
    best = min(r["wall"] for (w, label), r in results.items()
               if w == "tail" and label.startswith("async"))
    print(f"async + partial over one_step_off (heavy tail): {tail_off / best:.2f}x")
    print(f"async speed-up over sync: {results[('tail', 'sync')]['wall'] / best:.2f}x")


if __name__ == "__main__":
    main()
