"""Trainer runs against the SGLang stand-in, on spawned ranks (importable by child processes)."""

from __future__ import annotations

import os

from tests.conftest import TINY_HF_CONFIG
from tests.trainer_workers import SHORT, merge, read_metrics

# The trainer's model is the stand-in's (tests.conftest.TINY_HF_CONFIG), started from its weights.
TINY = TINY_HF_CONFIG
SGLANG_JOB = merge(SHORT, {
    "model": {"vocab_size": TINY["vocab_size"], "hidden_size": TINY["hidden_size"],
              "num_layers": TINY["num_hidden_layers"],
              "num_attention_heads": TINY["num_attention_heads"],
              "num_query_groups": TINY["num_key_value_heads"], "head_dim": TINY["head_dim"],
              "ffn_hidden_size": TINY["intermediate_size"],
              "moe_ffn_hidden_size": TINY["moe_intermediate_size"],
              "num_experts": TINY["num_experts"], "top_k": TINY["num_experts_per_tok"],
              "norm_topk_prob": TINY["norm_topk_prob"], "first_k_dense": 1,
              "max_position_embeddings": TINY["max_position_embeddings"],
              "rope_theta": TINY["rope_theta"], "rms_norm_eps": TINY["rms_norm_eps"]},
    "rollout": {"engine": "sglang", "prompts_per_step": 4, "group_size": 4,
                "max_new_tokens": 6, "sglang_rows_per_request": 4, "sglang_max_in_flight": 4,
                "weight_sync_bucket_mb": 0.05},
    "algo": {"minibatches": 2},
    "data": {"eval_size": 4},
    "trainer": {"steps": 2, "sft_steps": 0, "save_interval": 0, "keep_checkpoints": 1},
})


def sglang_jobs(cfgs: list) -> list:
    """Run each job (its own parallel layout) in turn in this process group; per job, this
    rank's record of every RL step: the batch's token ids and each response's ids (taken where
    the trainer builds its batch), and on rank 0 the logged metrics."""
    import torch.distributed as dist

    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.distributed.parallel import destroy_parallel
    from megatron_gspo.trainer import loop as trainer

    out = []
    make_batch = trainer.make_batch  # the loop's: a spy there sees every step's batch
    for cfg in cfgs:
        steps = []

        def spy(job, ctx, samples, rewards, **kw):
            batch, metrics = make_batch(job, ctx, samples, rewards, **kw)
            steps.append({"tokens": batch.tokens_BS1.tolist(),
                          "responses": [s.response_ids for s in samples],
                          "prompts": [s.prompt_ids for s in samples]})
            return batch, metrics

        trainer.make_batch = spy
        try:
            trainer.train(job_from_dict(cfg))
        finally:
            trainer.make_batch = make_batch
        rows = read_metrics(cfg["run_dir"]) if dist.get_rank() == 0 else None
        out.append({"steps": steps, "rows": rows, "rank": dist.get_rank()})
        destroy_parallel(keep_process_group=True)
    return out


def job(hf_dir: str, url: str, run_dir: str, **over) -> dict:
    cfg = merge(SGLANG_JOB, over)
    cfg["rollout"] = {"sglang_model_path": hf_dir, **cfg["rollout"], "sglang_urls": [url]}
    cfg["trainer"] = {**cfg["trainer"], "init_from": hf_dir}
    cfg["run_dir"] = os.path.join(run_dir)
    return cfg


def rollout_correction_job(cfg: dict) -> dict:
    """One step's batch from the stand-in through the old-policy pass and the rollout correction
    (1 rank): per row, its response ids and its advantage before and after the correction; and
    the correction's metrics."""
    import torch

    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.trainer.batching import make_batch
    from megatron_gspo.trainer.behaviour import (behaviour_logprobs, correct_for_the_engine,
                                                 step_plan)
    from megatron_gspo.trainer.generation import rollout, score
    from megatron_gspo.trainer.setup import setup
    from megatron_gspo.trainer.warmup import init_weights

    job = job_from_dict(cfg)
    run = setup(job)
    try:
        init_weights(run.policy.gpt, job, run.ctx, cfg["trainer"]["init_from"])
        records, samples = rollout(job, run.ctx, run.prompts, run.engine, 1)
        rewards, _ = score(run.prompts, run.ctx, records, samples)
        batch, _ = make_batch(job, run.ctx, samples, rewards,
                              pad_id=run.prompts.tokenizer.pad_id)
        batch.advantages_B = torch.linspace(-1, 1, batch.rows)  # no row without a signal
        before = batch.advantages_B.clone()
        behaviour_logprobs(run, batch, step_plan(run, batch))
        metrics = correct_for_the_engine(job.algo, run.ctx, batch)
        responses = [batch.tokens_BS1[i, 1:][batch.mask_BS[i] > 0].tolist()
                     for i in range(batch.rows)]
        return {"responses": responses, "before": before.tolist(),
                "after": batch.advantages_B.tolist(), "metrics": metrics,
                "mismatch": float(((batch.trainer_logp_BS - batch.engine_logp_BS).abs()
                                   * batch.mask_BS).sum() / batch.mask_BS.sum())}
    finally:
        run.signals.uninstall()
        run.prompts.scorer.close()
        run.logger.close()
