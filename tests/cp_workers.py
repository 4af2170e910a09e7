"""Context-parallel model runs on spawned ranks (importable by child processes)."""

from __future__ import annotations

import torch


def cp_logprobs_job(hf_dir, parallel_kwargs, tokens_BS, sequences):
    """Per-token log-probs of a padded batch (whole rows gathered from the CP ranks) and of the
    same sequences packed in one THD row (each padded to 2 x cp chunks)."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.forward import MicroBatch
    from megatron_gspo.hf_qwen3moe import load_hf_weights
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.policy import logprob_pass
    from megatron_gspo.seqshard import pack_sequences
    from tests.model_workers import tiny_model_config

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=0)
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    mbs = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens_BS.chunk(2)]
    padded, _ = logprob_pass(gpt, mbs, ctx, temperature=1.0)
    chunks = 2 * ctx.cp
    packed = pack_sequences(sequences, multiple_of=chunks * (ctx.tp if ctx.sequence_parallel else 1),
                            seq_multiple_of=chunks)
    mb = MicroBatch(packed.tokens_1N, packed.targets_1N, packed.position_ids_1N,
                    cu_seqlens=packed.cu_seqlens)
    packed_logp, _ = logprob_pass(gpt, [mb], ctx, temperature=1.0)
    return padded, packed_logp[0][packed.valid_N]
