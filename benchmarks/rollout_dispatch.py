"""One rollout through the SGLang client: one blocking request per prompt (the client before
batched dispatch) vs the whole batch in flight (batched requests, several at once), against the
stand-in SGLang server with an injected latency per request.

    python benchmarks/rollout_dispatch.py          # 64 prompts x 8 responses, 50 ms per request

The stand-in (tests/sglang_standin.py) speaks SGLang's HTTP protocol and generates with the local
engine on a tiny Qwen3-MoE; requests waiting together decode as one batch, as SGLang's continuous
batching does (coarser: a request joins at the next batch, not the next decoding step).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--rows-per-request", type=int, default=64)
    ap.add_argument("--max-in-flight", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from megatron_gspo.rollout.sglang.engine import SGLangEngine
    from megatron_gspo.rollout.types import SamplingParams
    from tests.conftest import make_hf_checkpoint
    from tests.sglang_standin import start

    hf_dir = make_hf_checkpoint(tempfile.mkdtemp(prefix="hf_tiny_"))
    atexit.register(shutil.rmtree, hf_dir, True)
    url, proc = start(hf_dir, latency_s=args.latency_ms / 1000)
    try:
        prompts = [[5 + i % 50, 6 + i % 40, 7] for i in range(args.prompts)]
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1)
        arms = {
            "serial (one request per prompt)": SGLangEngine(
                [url], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3],
                rows_per_request=args.group, max_in_flight=1),
            f"batch in flight ({args.rows_per_request} rows/request, <= {args.max_in_flight} "
            "at once)": SGLangEngine(
                [url], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3],
                rows_per_request=args.rows_per_request, max_in_flight=args.max_in_flight),
        }
        times = {name: [] for name in arms}
        batches = {}
        for _ in range(args.reps):
            for name, engine in arms.items():
                engine.clients[0].post("/_reset_stats")
                t0 = time.perf_counter()
                samples = engine.generate(prompts, args.group, params)
                times[name].append(time.perf_counter() - t0)
                assert len(samples) == args.prompts * args.group
                batches[name] = engine.clients[0].request("GET", "/_stats")["batches"]
    finally:
        proc.kill()
        proc.join()
    print(f"one rollout: {args.prompts} prompts x {args.group} responses, {args.max_new_tokens} "
          f"new tokens, {args.latency_ms:g} ms per request (median of {args.reps})")
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = next(iter(medians.values()))
    for name, sec in medians.items():
        print(f"  {name:<58} {sec:7.2f} s   speed-up {base / sec:5.1f}x   server batches "
              f"{len(batches[name])} (largest {max(batches[name])} rows)")


if __name__ == "__main__":
    main()
