"""Evaluate a checkpoint on prompts: accuracy, pass@k, and a jsonl of every response.

    python -m tools.evaluate RUN_DIR                       # the run's held-out prompts, greedy
    python -m tools.evaluate CKPT --data eval.jsonl --samples 8 --temperature 1.0
    python -m tools.evaluate HF_DIR --task reverse --size 200 --max-new-tokens 8
    torchrun --nproc-per-node 2 -m tools.evaluate CKPT --tp 2 --sequence-parallel ...

``CKPT`` is a training checkpoint (``RUN_DIR/checkpoints/step_N``, or ``RUN_DIR`` for its newest
complete one), a weights checkpoint or a Hugging Face directory, loaded into any layout. Without
``--data`` / ``--task``, a training checkpoint is evaluated on its run's own held-out prompts with
the run's reward, tokenizer and response length, as the trainer evaluates (greedy): the accuracy
it prints is the run's. Generation uses the in-process engine; with ``--samples K`` each prompt
gets K sampled responses and pass@k is the unbiased estimator (a response counts as right when
its reward is 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from tools import run_guarded


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.evaluate",
                                description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="a prompt file (jsonl or parquet)")
    src.add_argument("--task", choices=("add", "reverse"), help="a synthetic task")
    p.add_argument("--size", type=int, default=200, help="prompts of --task")
    p.add_argument("--reward", default=None, help="exact_match | math | code (default: the run's)")
    p.add_argument("--tokenizer", default=None, help="builtin or a HF tokenizer directory")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=None,
                   help="default: 0 (greedy) with one sample, 1.0 with several")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="responses jsonl (default: ./evaluation.jsonl)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    return p


def _records(args, src):
    """(prompt records, reward name, tokenizer spec, max new tokens) of this evaluation."""
    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.data.prompts import read_prompt_file
    from megatron_gspo.data.synthetic import make_task
    from megatron_gspo.trainer.setup import load_data

    job = job_from_dict(src.job) if src.job is not None else None
    reward = args.reward or (job.data.reward if job else "exact_match")
    tokenizer = args.tokenizer or (job.data.tokenizer if job else src.tokenizer)
    max_new = args.max_new_tokens or (job.rollout.max_new_tokens if job else 32)
    if args.data:
        if not os.path.isfile(args.data):
            raise FileNotFoundError(f"--data {args.data}: no such file")
        return read_prompt_file(args.data), reward, tokenizer, max_new
    if args.task:
        return make_task(args.task, args.size, seed=args.seed + 7919), reward, tokenizer, max_new
    if job is None:
        raise ValueError(f"{args.checkpoint}: not a training checkpoint; give --data or --task")
    return load_data(job)[1], reward, tokenizer, max_new


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    import torch

    from megatron_gspo.checkpoint.manager import CheckpointError
    from megatron_gspo.config import ConfigError, ParallelConfig
    from megatron_gspo.data.prompts import PromptDataError
    from megatron_gspo.data.tokenizer import load_tokenizer
    from megatron_gspo.rewards.scoring import score_samples
    from megatron_gspo.trainer.evaluation import evaluate_records
    from megatron_gspo.models.hf_config import HFCheckpointError
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.checkpoint.export import load_source, open_source
    from megatron_gspo.rewards import get_reward
    from megatron_gspo.rewards.pool import InlineScorer
    from megatron_gspo.rollout.local_engine import LocalEngine
    from megatron_gspo.rollout.types import SamplingParams

    def body() -> None:
        if args.samples < 1:
            raise ValueError(f"--samples {args.samples}: must be >= 1")
        src = open_source(args.checkpoint)
        records, reward, tok_spec, max_new = _records(args, src)
        tokenizer = load_tokenizer(tok_spec)
        scorer = InlineScorer(get_reward(reward))
        ctx = init_parallel(ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep,
                                           sequence_parallel=args.sequence_parallel),
                            src.model, seed=args.seed)
        gpt = build_model(src.model, ctx)
        load_source(gpt, src, ctx)
        lockstep = torch.distributed.group.WORLD if ctx.ep > 1 and ctx.dp > 1 else None
        engine = LocalEngine(gpt, ctx, pad_id=tokenizer.pad_id, lockstep_group=lockstep)
        temperature = args.temperature if args.temperature is not None else (
            0.0 if args.samples == 1 else 1.0)
        params = SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                stop_token_ids=(tokenizer.eos_id,), seed=args.seed)
        result = evaluate_records(
            records, ctx=ctx, params=params, samples=args.samples, decode=tokenizer.decode,
            generate=engine.generate,
            score=lambda recs, out: score_samples(recs, out, decode=tokenizer.decode,
                                                  scorer=scorer, ctx=ctx),
            render=lambda p: tokenizer.render_prompt(p.prompt, p.messages))
        rows = [None] * ctx.world_size
        torch.distributed.all_gather_object(rows, result.rows if ctx.is_replica_leader else [])
        if ctx.rank == 0:
            out = args.out or os.path.join(os.getcwd(), "evaluation.jsonl")
            with open(out, "w") as f:
                for row in (r for part in rows for r in part):
                    f.write(json.dumps(row) + "\n")
            print(f"{src.describe()}: {result.prompts} prompts x {args.samples} responses "
                  f"(temperature {temperature:g}, reward {reward})")
            print(f"accuracy {result.accuracy:.4f}")
            for k, value in result.pass_at.items():
                print(f"pass@{k} {value:.4f}")
            print(f"responses: {out}")

    return run_guarded("evaluate", body, (CheckpointError, ConfigError, HFCheckpointError,
                                          PromptDataError, FileNotFoundError, KeyError,
                                          ValueError))


if __name__ == "__main__":
    sys.exit(main())
