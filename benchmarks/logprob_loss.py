"""Log-prob + GSPO loss, forward and backward through the output projection, on CPU (fp32).

Paths (each in its own process, same inputs):
- naive:  logits = h @ W.T, full log_softmax, gather
- trl:    logits = h @ W.T, TRL's selective_log_softmax (per-sequence log-softmax), if installed
- ours:   logits = h @ W.T, chunked log-probs, logits' gradient written in place
- fused:  chunked h @ W.T fused with the log-probs; logits never exist as a whole (recomputed
          per chunk in the backward)
All paths then apply the same GSPO loss and backpropagate to h and W. W's gradient accumulates
into a preallocated buffer (as Megatron's DDP main_grad), so "extra memory" is what the step adds
on top of h, W and their gradient buffers: peak resident memory minus resident memory before it.

    python benchmarks/logprob_loss.py                    # V=151936, H=2048, 8 x 512 = 4096 tokens
    python benchmarks/logprob_loss.py --vocab 32000      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PATHS = ("naive", "trl", "ours", "fused")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_path(path: str, b: int, t: int, v: int, h: int, chunk: int) -> dict:
    import torch

    from megatron_gspo.algorithms.logprobs import linear_token_logprobs, token_logprobs
    from megatron_gspo.algorithms.losses import policy_loss

    torch.manual_seed(0)
    hidden = (torch.randn(b, t, h) * 0.5).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(v, h) * 0.02)
    weight.main_grad = torch.zeros_like(weight)
    hidden.grad = torch.zeros_like(hidden)
    target = torch.randint(0, v, (b, t))
    old = -torch.rand(b, t) * 5
    adv = torch.randn(b)
    mask = torch.ones(b, t)

    def logp_of():
        if path == "fused":
            return linear_token_logprobs(hidden, weight, target, chunk_size=chunk)
        logits = hidden @ weight.t()
        if path == "ours":
            return token_logprobs(logits, target, chunk_size=chunk, inplace_backward=True)[0]
        if path == "naive":
            return torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
        from trl.trainer.utils import selective_log_softmax
        return selective_log_softmax(logits, target)

    def accumulate_weight_grad(grad):  # what Megatron's DDP hook does with a returned grad
        if grad is not None:
            weight.main_grad.add_(grad)
        return None

    weight.register_hook(accumulate_weight_grad)
    # Warm up on a few tokens (thread pools and kernel workspaces count as baseline, not step).
    keep = (hidden, target, old, mask)
    hidden, target, old, mask = (x[:1, :8] for x in keep)
    policy_loss("gspo", logp_of(), old, adv[:1], mask)[0].backward()
    hidden, target, old, mask = keep
    hidden.grad.zero_()
    weight.main_grad.zero_()
    before = rss_bytes()
    start = time.perf_counter()
    loss, _ = policy_loss("gspo", logp_of(), old, adv, mask)
    loss.backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"time_s": elapsed, "extra_bytes": max(0, peak - before), "loss": float(loss),
            "grad_checksum": float(weight.main_grad.double().abs().sum())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.path:
        print(json.dumps(run_path(args.path, args.seqs, args.seq_len, args.vocab, args.hidden,
                                  args.chunk)))
        return
    try:
        import trl  # noqa: F401
        paths = PATHS
    except ImportError:
        paths = tuple(x for x in PATHS if x != "trl")
    results = {}
    for path in paths:
        cmd = [sys.executable, __file__, "--path", path, "--vocab", str(args.vocab), "--hidden",
               str(args.hidden), "--seqs", str(args.seqs), "--seq-len", str(args.seq_len),
               "--chunk", str(args.chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[path] = json.loads(out.stdout.strip().splitlines()[-1])
    tokens = args.seqs * args.seq_len
    print(f"log-prob + GSPO loss fwd+bwd incl. output projection, fp32 CPU ({os.cpu_count()} cores)"
          f": V={args.vocab}, H={args.hidden}, {args.seqs} x {args.seq_len} = {tokens} tokens, "
          f"logits {tokens * args.vocab * 4 / 2**30:.2f} GiB, chunk {args.chunk}")
    naive = results["naive"]
    print(f"{'path':6s} {'time (s)':>9s} {'x naive':>8s} {'extra mem (GiB)':>16s} {'x naive':>8s} "
          f"{'loss':>12s}")
    for path, r in results.items():
        print(f"{path:6s} {r['time_s']:9.2f} {r['time_s'] / naive['time_s']:8.2f} "
              f"{r['extra_bytes'] / 2**30:16.2f} {r['extra_bytes'] / max(naive['extra_bytes'], 1):8.3f} "
              f"{r['loss']:12.6f}")
    same = all(abs(r["grad_checksum"] - naive["grad_checksum"]) <= 1e-4 * naive["grad_checksum"]
               for r in results.values())
    print(f"weight gradients agree across paths: {same}")
    if "trl" not in results:
        print("trl not installed: `pip install trl` adds TRL's per-sequence selective log-softmax")


if __name__ == "__main__":
    main()
