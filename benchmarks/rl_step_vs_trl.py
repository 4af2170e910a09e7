"""Wall time of one GSPO RL step on CPU: our trainer against TRL's GRPOTrainer (GSPO mode).

One RL step = one rollout batch of P prompts x G completions (at most M new tokens each, sampled at
temperature 1), its exact-match rewards, the old policy's log-probs, and K optimizer updates of
P*G/K completions each (Adam, lr 1e-3, grad clip 1.0). Both stacks train the same model shape from
scratch on the same synthetic "reverse" prompts ("rev:abc=" -> "cba") with the same character
tokenizer (<pad>, <bos>, <eos>, then 96 printable characters, vocabulary padded to 128):

- ours: ``python -m megatron_gspo`` (Megatron-core tiny_moe: hidden 128, 4 layers, 4 heads, 2 KV
        groups, head_dim 32, 8 experts top-2 of width 64, untied embeddings, fp32), timed by its own
        ``perf/step_time_s`` rows in metrics.jsonl
- trl:  ``trl.GRPOTrainer`` with ``importance_sampling_level="sequence"`` on a transformers
        ``Qwen3MoeForCausalLM`` of the same shape, fp32, ``use_cpu=True``, no vLLM, no gradient
        checkpointing; one RL step = ``steps_per_generation=K`` optimizer steps, timed between
        ``on_step_end`` callbacks

Each stack runs in its own process with the same thread count. The first RL step (thread pools,
allocator and kernel warm-up) is dropped; the table shows the median of the rest. Generated tokens/s
is the sampled completion tokens of a step over its time (completions end early at <eos>, so both
columns also show the mean completion length).

Shapes (``--shape``; ``--hidden``, ``--layers``, ``--heads``, ``--kv-groups``, ``--head-dim``,
``--experts``, ``--top-k``, ``--expert-width`` override single fields):

- ``tiny``: the CPU default (hidden 128, 4 layers, 4 heads / 2 KV groups, head_dim 32, 8 experts
  top-2 of width 64), 8 new tokens;
- ``compute``: hidden 256, 6 layers, 8 heads / 4 KV groups, head_dim 32, 16 experts top-4 of
  width 256 (about 19M parameters), 24 new tokens.

It also prints the machine's fp32 matmul rate on the same threads, and our update phase's model
FLOP rate (6 x active parameters x tokens fed, over the phase's time) as a share of it. Next to the
matmul rate it prints the time of one small parallel operator (an add of two 64k fp32 vectors),
the fixed cost that each of the update's thousands of small operators pays and that the 1024^3
product does not show: on a shared 2-core machine it can move by half while that rate does not.

    python benchmarks/rl_step_vs_trl.py --shape tiny       # 8 RL steps, 16 prompts x 8
    python benchmarks/rl_step_vs_trl.py --shape compute
    python benchmarks/rl_step_vs_trl.py --quick            # 4 RL steps
    python benchmarks/rl_step_vs_trl.py --shape compute --rounds 3   # both stacks 3 times, alternating
    python benchmarks/rl_step_vs_trl.py --shape compute --paths ours --ours-override trainer.packing=false
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import string
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PATHS = ("ours", "trl")
# Model shapes (Qwen3-MoE, untied, every layer MoE) and their generation length; --hidden etc.
# override single fields of the chosen shape.
SHAPES = {
    # the CPU default (conf/model/tiny_moe.yaml), about 1.0M parameters
    "tiny": dict(hidden=128, layers=4, heads=4, kv_groups=2, head_dim=32, experts=8, top_k=2,
                 expert_width=64, max_new_tokens=8),
    # compute-bound on 2 cores: about 19M parameters, 6.0M active per token
    "compute": dict(hidden=256, layers=6, heads=8, kv_groups=4, head_dim=32, experts=16,
                    top_k=4, expert_width=256, max_new_tokens=24),
}
SHAPE_FIELDS = ("hidden", "layers", "heads", "kv_groups", "head_dim", "experts", "top_k",
                "expert_width")
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = string.printable[:95] + "\n"  # the order of megatron_gspo.data.tokenizer.CharTokenizer
VOCAB = 128


def thread_env(args) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    # On cores shared with other jobs, spinning OpenMP workers that get descheduled stall every
    # tiny op at the barrier (seen: a 0.05 s fwd+bwd taking 5-20 s with 2 threads); sleeping
    # workers keep both stacks measurable. "active" suits a dedicated machine.
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    return env


def active_params(args) -> int:
    """Parameters a token's forward multiplies by (weights of its matmuls): attention, the router,
    its top-k experts (gate, up, down) and the output layer; embedding lookups and norms left out.
    Model FLOPs of a forward + backward = 6 x this x tokens."""
    q, kv = args.heads * args.head_dim, args.kv_groups * args.head_dim
    attention = args.hidden * (q + 2 * kv) + q * args.hidden
    moe = args.hidden * args.experts + args.top_k * 3 * args.hidden * args.expert_width
    return args.layers * (attention + moe) + VOCAB * args.hidden


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 9) -> float:
    """This machine's fp32 matmul rate on ``threads`` threads: median of square n x n products."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def small_op_us(threads: int, n: int = 65536, repeats: int = 400) -> float:
    """Microseconds per add of two ``n``-element fp32 vectors on ``threads`` threads (above torch's
    grain size, so one OpenMP region each), median of 5 batches of ``repeats``."""
    import torch

    torch.set_num_threads(threads)
    a, out = torch.randn(n), torch.empty(n)
    batches = []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.add(a, a, out=out)
        batches.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(batches[1:])


def model_fields(args) -> dict:
    """Our model config's fields for the shape (the dense FFN width is unused: every layer MoE)."""
    return {"hidden_size": args.hidden, "num_layers": args.layers,
            "num_attention_heads": args.heads, "num_query_groups": args.kv_groups,
            "head_dim": args.head_dim, "num_experts": args.experts, "top_k": args.top_k,
            "moe_ffn_hidden_size": args.expert_width, "ffn_hidden_size": 2 * args.hidden}


def model_overrides(args) -> list:
    return [f"model.{key}={value}" for key, value in model_fields(args).items()]


def run_ours(args) -> dict:
    run_dir = tempfile.mkdtemp(prefix="rl_step_ours_")
    overrides = [
        f"trainer.steps={args.steps}", "trainer.sft_steps=0", "trainer.save_interval=0",
        "trainer.eval_interval=0", "data.eval_size=0", "logging.progress=false",
        "logging.drift=false", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"algo.minibatches={args.minibatches}", f"trainer.micro_batch_size={args.micro_batch_size}",
        f"seed={args.seed}", f"hydra.run.dir={run_dir}", *model_overrides(args),
        *args.ours_override,
    ]
    cmd = [sys.executable, "-m", "megatron_gspo", *overrides]
    out = subprocess.run(cmd, cwd=REPO, env=thread_env(args), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"our trainer failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "perf/step_time_s" in r]
    batch = args.prompts * args.group_size
    return {"step_times": [r["perf/step_time_s"] for r in steps],
            "gen_tokens": [r["rollout/response_length"] * batch for r in steps],
            "model_tokens": [r.get("perf/model_tokens", math.nan) for r in steps],
            # where our step's time goes, to read the ratio against (warm-up step dropped)
            "phases_s": {k[len("perf/time/"):-2]: statistics.median(r[k] for r in steps[1:])
                         for k in steps[-1] if k.startswith("perf/time/") and
                         k != "perf/time/checkpoint_s"},
            "run_dir": run_dir}


def char_tokenizer():
    """A fast HF tokenizer with the same ids as our CharTokenizer: one token per character, <bos>
    prepended to a prompt (as our trainer does), decoding without separators."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # Ids past the 99 symbols exist only so that every id the 128-way head samples decodes (to a
    # name that never matches an answer, as our tokenizer's U+FFFD).
    names = list(SPECIALS) + list(CHARS)
    names += [f"<unused{i}>" for i in range(VOCAB - len(names))]
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(names)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def run_trl(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_gspo.data.synthetic import make_task

    torch.manual_seed(args.seed)
    tokenizer = char_tokenizer()
    assert tokenizer("rev:ab=")["input_ids"] == [1] + [3 + CHARS.index(c) for c in "rev:ab="]
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_width, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_groups,
        head_dim=args.head_dim, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=2048, initializer_range=0.02, router_aux_loss_coef=1e-3,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen3MoeForCausalLM(config).float()
    records = make_task("reverse", 2000, seed=args.seed)
    dataset = Dataset.from_list([{"prompt": r.prompt, "answer": r.answer} for r in records])

    gen_tokens = []

    def exact_match(completions, answer, completion_ids, **_):
        # TRL calls this once per generation batch, so it also counts the step's sampled tokens.
        gen_tokens.append(sum(len(ids) for ids in completion_ids))
        return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]

    boundaries = []

    class RLStepClock(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            boundaries.append(time.perf_counter())

        def on_step_end(self, targs, state, control, **kw):
            # K optimizer steps consume one generation batch: that is one RL step.
            if state.global_step % args.minibatches == 0:
                boundaries.append(time.perf_counter())

    batch = args.prompts * args.group_size
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rl_step_trl_"), report_to="none", use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, seed=args.seed,
        max_steps=args.steps * args.minibatches, learning_rate=1e-3, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        # K updates per rollout batch: the generation batch of P*G completions is cut into K
        # optimizer steps of P*G/K, with no gradient accumulation inside one update.
        per_device_train_batch_size=batch // args.minibatches, gradient_accumulation_steps=1,
        steps_per_generation=args.minibatches, num_iterations=1, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        beta=0.0, use_vllm=False, logging_strategy="no", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=cfg, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[RLStepClock()])
    # Per phase, as ours reports them: generation (``_generate``) and the old policy's log-probs
    # (the forward-only ``_get_per_token_logps_and_entropies``) are timed where TRL calls them;
    # the update is the rest of the step.
    spent = {"rollout": [], "old_logprobs": []}

    def timed(phase, fn, only_no_grad=False):
        def wrapper(*a, **kw):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[phase].append(time.perf_counter() - t0)
        return wrapper

    trainer._generate = timed("rollout", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed(
        "old_logprobs", trainer._get_per_token_logps_and_entropies, only_no_grad=True)
    trainer.train()
    times = [b - a for a, b in zip(boundaries, boundaries[1:])]
    phases = {}
    if len(spent["rollout"]) >= len(times) and len(spent["old_logprobs"]) >= len(times):
        rollout, old = spent["rollout"][:len(times)], spent["old_logprobs"][:len(times)]
        phases = {"rollout": rollout, "old_logprobs": old,
                  "update": [t - r - o for t, r, o in zip(times, rollout, old)]}
    return {"step_times": times, "gen_tokens": gen_tokens[:len(times)], "phases": phases,
            "attn": model.config._attn_implementation,
            "experts": getattr(model.config, "_experts_implementation", None)}


def summarize(r: dict) -> dict:
    times, tokens = r["step_times"][1:], r["gen_tokens"][1:]  # drop the warm-up step
    median = statistics.median(times)
    return {"median_s": median, "steps_timed": len(times), "first_s": r["step_times"][0],
            "tok_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
            "mean_len": sum(tokens) / len(tokens)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                   help="model shape and generation length (fields below override it)")
    for field in SHAPE_FIELDS:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
    p.add_argument("--steps", type=int, default=8, help="RL steps per stack (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the shape's")
    p.add_argument("--minibatches", type=int, default=4, help="optimizer updates per RL step")
    p.add_argument("--micro-batch-size", type=int, default=32, help="ours: rows per micro-batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--omp-wait-policy", default="passive",
                   help="OMP_WAIT_POLICY for both stacks (passive | active | '' to inherit)")
    p.add_argument("--quick", action="store_true", help="4 RL steps")
    p.add_argument("--rounds", type=int, default=1,
                   help="run both stacks this many times, alternating; the last line gives the "
                        "median of the rounds' speed-ups (slow spells of shared cores hit one "
                        "stack's run, not a whole round)")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--ours-override", action="append", default=[],
                   help="extra Hydra override for our trainer (repeatable), e.g. to time a variant")
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    for field, value in SHAPES[args.shape].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    if args.quick:
        args.steps = 4
    if args.path == "trl":
        print(json.dumps(run_trl(args)))
        return
    if args.path == "matmul":
        print(json.dumps({"gflops": matmul_gflops(args.threads),
                          "small_op_us": small_op_us(args.threads)}))
        return
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first RL step is warm-up)")
    if (args.prompts * args.group_size) % args.minibatches:
        p.error("prompts x group size must divide into --minibatches updates")

    def subprocess_path(path):
        cmd = [sys.executable, os.path.abspath(__file__), "--path", path]
        for key in ("steps", "prompts", "group_size", "max_new_tokens", "minibatches",
                    "micro_batch_size", "threads", "seed", *SHAPE_FIELDS):
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        out = subprocess.run(cmd, cwd=REPO, env=thread_env(args), capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{path} run failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    ratios = []
    for round_ in range(args.rounds):
        if args.rounds > 1:
            print(f"round {round_ + 1} of {args.rounds}")
        paths = args.paths.split(",")  # each round in the other order than the one before
        ratio = one_round(args, subprocess_path, paths[::-1] if round_ % 2 else paths)
        if ratio is not None:
            ratios.append(ratio)
    if ratios:
        if len(ratios) > 1:
            print("speed-up per round: " + ", ".join(f"{r:.2f}x" for r in ratios)
                  + " (the median below)")
        print(f"speed-up of ours over TRL per RL step: {statistics.median(ratios):.2f}x")


def one_round(args, subprocess_path, paths):
    """The stacks of ``paths`` once each, in that order, and the machine's matmul rate before
    and after; prints the round's table and returns TRL's median step time over ours (None
    without both)."""
    machine_before = subprocess_path("matmul")
    before = machine_before["gflops"]
    results, extra = {}, {}
    for path in paths:
        t0 = time.perf_counter()
        raw = run_ours(args) if path == "ours" else subprocess_path(path)
        extra[path] = {k: v for k, v in raw.items()
                       if k not in ("step_times", "gen_tokens", "model_tokens")}
        results[path] = summarize(raw)
        results[path]["wall_s"] = time.perf_counter() - t0
        if "model_tokens" in raw:
            extra[path]["model_tokens"] = statistics.median(raw["model_tokens"][1:])

    # The machine's rate drifts between runs (shared cores): measured before and after both
    # stacks, and the update's share taken against the higher one.
    machine_after = subprocess_path("matmul")
    after = machine_after["gflops"]
    peak = max(before, after)
    batch = args.prompts * args.group_size
    active = active_params(args)
    print(f"GSPO RL step, fp32 CPU, {args.threads} threads ({os.cpu_count()} cores): "
          f"{args.prompts} prompts x {args.group_size} = {batch} completions, <= "
          f"{args.max_new_tokens} new tokens, {args.minibatches} updates of "
          f"{batch // args.minibatches}/step (ours: micro-batch {args.micro_batch_size}), "
          f"{args.steps} RL steps (first = warm-up), OMP_WAIT_POLICY="
          f"{args.omp_wait_policy or os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"model ({args.shape}): Qwen3-MoE shape, vocab {VOCAB}, hidden {args.hidden}, "
          f"{args.layers} layers, {args.heads} heads / {args.kv_groups} KV, head_dim "
          f"{args.head_dim}, {args.experts} experts top-{args.top_k} (width "
          f"{args.expert_width}), untied, {active / 1e6:.2f}M active parameters per token; "
          f"task reverse, exact-match reward")
    print(f"machine: fp32 matmul (1024^3, {args.threads} threads) {before:.1f} GFLOP/s before "
          f"the runs, {after:.1f} after; one small operator (add of 64k fp32) "
          f"{machine_before['small_op_us']:.1f} us before, {machine_after['small_op_us']:.1f} after")
    if "trl" in extra:
        print(f"trl: attention {extra['trl'].get('attn')}, experts {extra['trl'].get('experts')}")
    base = results.get("trl")
    print(f"{'path':5s} {'median s/step':>13s} {'speed-up':>8s} {'first s':>8s} {'gen tok/s':>10s} "
          f"{'mean len':>9s} {'steps':>6s} {'wall s':>7s}")
    for path, r in results.items():
        ratio = f"{base['median_s'] / r['median_s']:7.2f}x" if base else f"{'-':>8s}"
        print(f"{path:5s} {r['median_s']:13.3f} {ratio} {r['first_s']:8.2f} {r['tok_per_s']:10.0f} "
              f"{r['mean_len'] / batch:9.2f} {r['steps_timed']:6d} {r['wall_s']:7.1f}")
    if extra.get("trl", {}).get("phases"):
        trl_phases = {k: statistics.median(v[1:]) for k, v in extra["trl"]["phases"].items()}
        print("trl, median s per phase: " + ", ".join(f"{k} {v:.3f}" for k, v in trl_phases.items())
              + " (update: the step's rest)")
    if "ours" in extra:
        phases = extra["ours"]["phases_s"]
        print("ours, median s per phase: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
              + f"  (run dir {extra['ours']['run_dir']})")
        tokens = extra["ours"]["model_tokens"]
        gflops = 6 * active * tokens / phases["update"] / 1e9
        if not math.isnan(tokens):  # (a trainer older than perf/model_tokens does not log it)
            print(f"ours, update phase: {tokens:.0f} tokens x 6 x {active / 1e6:.2f}M = "
                  f"{6 * active * tokens / 1e9:.1f} GFLOP in {phases['update']:.3f} s: "
                  f"{gflops:.1f} GFLOP/s, {100 * gflops / peak:.0f}% of the fp32 matmul rate "
                  f"(the higher of the two)")
    if base and "ours" in results:
        return base["median_s"] / results["ours"]["median_s"]
    return None


if __name__ == "__main__":
    main()
