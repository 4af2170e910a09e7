"""Where one GPU's time goes, ours against Hugging Face transformers on the same weights.

    python scripts/perf_probe.py [--model 1b|tiny] [--device cuda|cpu] [--batch 32]
                                 [--new-tokens 512] [--update-batch 32] [--update-seq 1024]
                                 [--compile-decode] [--compile-experts] [--budget-s 540]

One JSON line per section (``{"section": ..., ...}``), within ``--budget-s`` (9 minutes unless
told), for the 1B MoE (0.31B active; ``scripts/gpu_check.py``'s shape), seeded weights:

- ``launch``: microseconds per kernel launch (a tiny add, queued) and per host synchronisation;
- ``parity``: our model's logits against transformers' ``Qwen3MoeForCausalLM`` loaded from our
  export of the same weights (largest difference; where it does not load, transformers' paths
  fail, ours are measured);
- ``update``: a training step (forward, backward, Adam) on ``--update-batch`` x
  ``--update-seq`` tokens, by default one micro-batch of ``trainer=gpu`` (its
  ``max_tokens_per_micro_batch``: what the trainer feeds a GPU at a time): ours (megatron DDP,
  the distributed optimizer, bf16, sort dispatch) against a plain transformers step (bf16
  autocast, fused AdamW), model TFLOP/s (6 x active parameters x tokens) and MFU against 989
  TFLOP/s (H100 / H200 dense bf16); where the GPU's memory runs out, both again with half the
  rows (the sizes that did not fit listed); with ``--compile-experts``
  also ours with the grouped experts compiled (``backend.compile_experts``; its compilation
  before the timed steps; the sections after it run the eager experts again). It comes before
  the rollout (the slower measurement), so a run stopped by a time limit keeps both goals'
  figures as long as it can;
- ``rollout``: generated tokens/s at ``--batch`` rows x ``--new-tokens`` tokens: ours through
  the engine as it was (megatron's forward on a GPU), through the static decoder (no host
  synchronisation per step) and with its CUDA graphs (their captures counted: the engine makes
  them within each call and drops them after it); transformers' ``generate`` with its dynamic
  cache and with its static cache; with ``--compile-decode`` also the static decoder compiled
  (``rollout.compile_decode``, with CUDA graphs on a GPU);
- ``profile``: kernels and device-busy share of one update step (its micro-batch's forward,
  backward and Adam) and of a prefill with 5 decoding steps;
- ``memory``: peak memory.

A path that fails (a CUDA graph's capture, a compilation, memory but where the update halves its
rows) is listed in its section's ``failed`` (``{path: "Error: first line"}``) and the other paths
are measured; the probe then exits with status 1. So is a path that the time budget
(``--budget-s``, from the start) stops, and every path after it is skipped: the sections and
the summary line still print, inside a time limit a few seconds longer than the budget. The
last line: ``ours vs HF: rollout X.XXx, update X.XXx`` (the best of ours; "n/a" where a side
has no figure). ``--device cpu --model tiny`` runs every section but CUDA graphs on CPU (the
tests do).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

from gpu_check import MODEL_1B, param_counts  # noqa: E402
from megatron_gspo.config import ModelConfig, ParallelConfig  # noqa: E402
from probe_paths import Paths, note, release_memory  # noqa: E402

PEAK_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
GPU_TRAINER = os.path.join(ROOT, "conf", "trainer", "gpu.yaml")  # trainer=gpu


def emit(section: str, **fields) -> None:
    print(json.dumps({"section": section, **fields}), flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int = 1) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats


def launch_costs(device) -> dict:
    x = torch.zeros(1, device=device)
    n = 2000
    per_launch = timed(lambda: [x.add_(1) for _ in range(n)], device) / n
    per_sync = timed(lambda: [float(x.sum()) for _ in range(200)], device) / 200
    return {"launch_us": 1e6 * per_launch, "sync_us": 1e6 * per_sync}


def build(m: ModelConfig, device_name: str):
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.models.hf_io import SeededTensors
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model

    ctx = init_parallel(ParallelConfig(device=device_name), m, seed=0)
    gpt = build_model(m, ctx, moe_enable_routing_replay=False)
    load_hf_weights(gpt, SeededTensors(m, 1), m, ctx)
    return ctx, gpt


def loaded(hf):
    """transformers' model, for a path that runs it (None: it did not load; the path fails)."""
    if hf is None:
        raise RuntimeError("transformers' model did not load (the parity section says why)")
    return hf


def logit_difference(gpt, hf, ids) -> float:
    """The largest difference of our logits and transformers' for the same ``ids``."""
    with torch.no_grad():
        ours = gpt(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids),
                   attention_mask=None)
        theirs = loaded(hf)(input_ids=ids).logits
    return float((ours.float() - theirs.float()).abs().max())


def hf_model(gpt, m, ctx, dtype):
    from transformers import AutoModelForCausalLM

    from megatron_gspo.models.hf_mapping import export_hf

    with tempfile.TemporaryDirectory(prefix="perf_probe_hf_") as out:  # (loaded, then removed)
        export_hf(gpt, m, ctx, out)
        return AutoModelForCausalLM.from_pretrained(out, dtype=dtype).to(ctx.device).eval()


def rollout_rates(gpt, hf, ctx, args, prompts, paths: Paths) -> dict:
    from megatron_gspo.rollout.local_engine import LocalEngine
    from megatron_gspo.rollout.static_decode import StaticGenerator
    from megatron_gspo.rollout.types import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=1)
    tokens = len(prompts) * args.new_tokens
    out = {}
    # (the engine as it was comes last: the slowest, and measured before, so a run stopped by a
    # time limit loses it first)
    engines = {"ours_static": LocalEngine(gpt, ctx, pad_id=0,
                                          static=StaticGenerator(gpt, pad_id=0))}
    if ctx.device.type == "cuda":
        engines["ours_cuda_graphs"] = LocalEngine(
            gpt, ctx, pad_id=0, static=StaticGenerator(gpt, pad_id=0, cuda_graphs=True))
    if args.compile_decode:  # (rollout.compile_decode, with the CUDA graphs where they run)
        graphs = ctx.device.type == "cuda"
        engines["ours_compiled" + ("_cuda_graphs" if graphs else "")] = LocalEngine(
            gpt, ctx, pad_id=0, static=StaticGenerator(gpt, pad_id=0, compile=True,
                                                       cuda_graphs=graphs))
    short = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)

    def measure(name, run):
        rate = paths.attempt(f"rollout {name}", run)
        if rate is not None:
            out[name] = rate
            note(f"rollout {name}: {rate:.0f} tokens/s")

    def ours(name, engine):  # (CUDA graphs are captured within each call)
        def run():
            # warm-up; a compiled step's on the timed shapes (it compiles for its cache's length)
            engine.generate(prompts, 1, params if "compiled" in name else short)
            return tokens / timed(lambda: engine.generate(prompts, 1, params), ctx.device)

        measure(name, run)

    for name, engine in engines.items():
        ours(name, engine)
    ids = torch.tensor(prompts, device=ctx.device)
    for name, extra in (("hf_dynamic_cache", {}), ("hf_static_cache",
                                                   {"cache_implementation": "static"})):
        kw = dict(do_sample=True, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                  pad_token_id=0, **extra)

        @torch.no_grad()
        def run(kw=kw, extra=extra):
            # the static cache compiles its forward for the cache's shape: warm up on that shape
            model = loaded(hf)
            model.generate(ids, **(kw if extra else dict(kw, max_new_tokens=4,
                                                         min_new_tokens=4)))
            return tokens / timed(lambda: model.generate(ids, **kw), ctx.device)

        measure(name, run)
    ours("ours_as_is", LocalEngine(gpt, ctx, pad_id=0))
    return {f"{k}_tokens_per_s": v for k, v in out.items()}


def gpu_micro_batch_tokens() -> int:
    """Tokens of one packed micro-batch under ``trainer=gpu``: its
    ``max_tokens_per_micro_batch``."""
    from omegaconf import OmegaConf

    return int(OmegaConf.load(GPU_TRAINER).max_tokens_per_micro_batch)


def largest_that_fits(measure, rows: int) -> tuple:
    """``measure(rows)``, with half as many rows each time the device's memory runs out (both
    sides of a comparison measured again on the same tokens): ``(rows, result, rows that did not
    fit)``."""
    too_many = []
    while True:
        try:
            return rows, measure(rows), too_many
        except torch.OutOfMemoryError:
            pass  # (the failed step's tensors go with the exception, before the next try)
        too_many.append(rows)
        note(f"out of memory at {rows} rows; {rows // 2} next")
        release_memory()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # (the memory section: the sizes that fit)
        rows //= 2
        if rows == 0:
            raise SystemExit("perf_probe: not one row fits the device's memory")


def eager_experts(gpt) -> None:
    """The grouped experts uncompiled again (``compile_grouped_experts`` undone)."""
    for layer in gpt.modules():
        if getattr(layer, "compiled", None) is not None:
            layer.compiled = None


def update_rates(gpt, hf, m, ctx, args, paths: Paths) -> tuple:
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.models.grouped_experts import compile_grouped_experts
    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer

    _, active = param_counts(m)
    ddp, opt = wrap_and_build_optimizer(gpt, ctx, OptimConfig(lr=1e-6))
    hf_opt = None if hf is None else torch.optim.AdamW(hf.parameters(), lr=1e-6,
                                                       fused=ctx.device.type == "cuda")
    gpt.train()
    if hf is not None:
        hf.train()

    def steps_at(rows: int):
        g = torch.Generator().manual_seed(2)
        batch = torch.randint(3, m.vocab_size, (rows, args.update_seq + 1), generator=g)
        batch = batch.to(ctx.device)
        x, y = batch[:, :-1], batch[:, 1:]
        pos = torch.arange(args.update_seq, device=ctx.device).expand_as(x)

        def ours():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            logits = ddp(x, pos, attention_mask=None)
            logp, _ = token_logprobs(logits, y, group=None)
            (-logp.mean()).backward()
            opt.step()

        def theirs():
            model = loaded(hf)
            hf_opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16,
                                enabled=ctx.device.type == "cuda"):
                logits = model(input_ids=x).logits
            logp = torch.log_softmax(logits.float(), -1).gather(-1, y[..., None])[..., 0]
            (-logp.mean()).backward()
            hf_opt.step()

        return ours, theirs, 6 * active * x.numel()

    def measure(rows: int) -> dict:
        eager_experts(gpt)  # (a try after running out of memory starts uncompiled again)
        ours, theirs, flops = steps_at(rows)
        out = {}
        runs = [("ours", ours), ("hf", theirs)] + ([("ours_compiled", ours)]
                                                    if args.compile_experts else [])
        for name, fn in runs:
            if name == "ours_compiled" and not compile_grouped_experts(gpt):
                raise SystemExit("perf_probe: --compile-experts: no layer runs the grouped "
                                 "experts")

            def run(fn=fn):
                fn()  # (warm-up; the compilation where compiled)
                return timed(fn, ctx.device, repeats=3)

            seconds = paths.attempt(f"update {name}", run, keep=(torch.OutOfMemoryError,))
            if seconds is None:
                continue
            paths.failed.pop(f"update {name}", None)  # (a smaller try's success replaces a failure)
            out[f"{name}_s"] = seconds
            out[f"{name}_tflops"] = flops / seconds / 1e12
            out[f"{name}_mfu"] = out[f"{name}_tflops"] / PEAK_TFLOPS
            note(f"update {name} ({rows * args.update_seq} tokens): "
                 f"{out[f'{name}_tflops']:.1f} TFLOP/s")
        return out

    rows, out, too_many = largest_that_fits(measure, args.update_batch)
    out = {"tokens": rows * args.update_seq,
           "out_of_memory_at_tokens": [r * args.update_seq for r in too_many], **out}
    eager_experts(gpt)  # the rollout and the profile after this run the eager experts
    gpt.eval()
    if hf is not None:
        hf.eval()
    return out, steps_at(rows)[0]


def profiled(fn, device) -> tuple:
    """Kernels launched by ``fn`` and the share of its wall time the device was busy (on a
    GPU: the kernels' own time, counted once, from the device's events; on a CPU: the operators'
    self time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = sum(e.device_time_total for e in kernels) / 1e6
    else:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CPU]
        busy = sum(e.self_cpu_time_total for e in kernels) / 1e6
    return len(kernels), busy / wall


def profile_counts(gpt, ctx, prompts, micro_batch) -> dict:
    from megatron_gspo.rollout.static_decode import StaticGenerator
    from megatron_gspo.rollout.types import SamplingParams

    gen = StaticGenerator(gpt, pad_id=0, readback_steps=10_000)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)  # prefill + 5 steps
    gen.generate(prompts, 1, params)
    decode_kernels, decode_busy = profiled(lambda: gen.generate(prompts, 1, params), ctx.device)
    gpt.train()
    micro_batch()
    step_kernels, step_busy = profiled(micro_batch, ctx.device)
    gpt.eval()
    return {"decode_5_steps_kernels": decode_kernels, "decode_busy_share": decode_busy,
            "update_step_kernels": step_kernels, "update_busy_share": step_busy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("1b", "tiny"), default="1b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--update-batch", type=int, default=None,
                   help="rows of the update (default: trainer=gpu's micro-batch of tokens)")
    p.add_argument("--update-seq", type=int, default=1024)
    p.add_argument("--compile-decode", action="store_true",
                   help="also time the static decoder compiled (rollout.compile_decode)")
    p.add_argument("--compile-experts", action="store_true",
                   help="also time the update with the grouped experts compiled")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds from the start: a path running then is stopped, the later ones "
                        "skipped (the sections and the summary still print)")
    args = p.parse_args()
    paths = Paths(args.budget_s)
    if args.update_batch is None:
        args.update_batch = max(1, gpu_micro_batch_tokens() // args.update_seq)
    warnings.filterwarnings("ignore")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("perf_probe: no CUDA device (use --device cpu --model tiny to try it)")
    m = MODEL_1B if args.model == "1b" else ModelConfig(vocab_size=128, params_dtype="float32")
    ctx, gpt = build(m, args.device)
    device = ctx.device
    emit("launch", device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
         **launch_costs(device))
    dtype = torch.bfloat16 if m.params_dtype == "bfloat16" else torch.float32
    # (transformers' model not loading, another version's for instance, fails its own paths)
    hf = paths.attempt("parity load", lambda: hf_model(gpt, m, ctx, dtype))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, m.vocab_size, (2, 33), generator=g).to(device)
    diff = paths.attempt("parity", lambda: logit_difference(gpt, hf, ids))
    emit("parity", **({} if diff is None else {"max_abs_logit_diff": diff}),
         **paths.section("parity"))
    prompts = torch.randint(3, m.vocab_size, (args.batch, args.prompt_tokens),
                            generator=g).tolist()
    # (the update first: see the docstring). A path that fails is listed in its section's
    # "failed" ({path: "Error: message"}) and the others are measured.
    update, micro_batch = update_rates(gpt, hf, m, ctx, args, paths)
    emit("update", **update, **paths.section("update"))
    rollout = rollout_rates(gpt, hf, ctx, args, prompts, paths)
    emit("rollout", batch=args.batch, new_tokens=args.new_tokens, **rollout,
         **paths.section("rollout"))
    profile = paths.attempt("profile", lambda: profile_counts(
        gpt, ctx, prompts[:min(8, len(prompts))], micro_batch))
    emit("profile", **(profile or {}), **paths.section("profile"))
    emit("memory", peak_gib=(torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
                             else None))
    rollout_x = times(best(rollout, "ours", "_tokens_per_s", max),
                      best(rollout, "hf", "_tokens_per_s", max))
    update_x = times(best(update, "hf", "_s", min), best(update, "ours", "_s", min))
    print(f"ours vs HF: rollout {rollout_x}, update {update_x}", flush=True)
    if paths.failed:  # (every figure printed; the exit status says that some are missing)
        sys.exit(f"perf_probe: {len(paths.failed)} failed: {', '.join(paths.failed)}")


def best(figures: dict, prefix: str, suffix: str, pick):
    """The best (``pick``: max or min) of the figures named ``prefix...suffix`` (None: none)."""
    values = [v for k, v in figures.items() if k.startswith(prefix) and k.endswith(suffix)]
    return pick(values) if values else None


def times(a, b) -> str:
    """``a / b`` as "X.XXx" ("n/a" where a side was not measured)."""
    return f"{a / b:.2f}x" if a is not None and b is not None else "n/a"


if __name__ == "__main__":
    main()
