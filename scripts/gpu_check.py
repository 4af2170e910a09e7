"""GPU check: a ~0.9B-parameter (0.31B active) Qwen3-MoE-shaped model in bf16 on one GPU.
Runs forward+backward steps:

    python scripts/gpu_check.py [--steps 10] [--batch 8] [--seq 2048]

Prints parameters (total / active per token), tokens/s and model TFLOP/s (6 x active params x
tokens, plus causal attention). Uses Transformer Engine layers when installed, else Megatron's local
spec with SDPA (flash) attention.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_gspo.config import ModelConfig, ParallelConfig

MODEL_1B = ModelConfig(
    name="moe_1b", vocab_size=32768, hidden_size=1024, num_layers=16, num_attention_heads=16,
    num_query_groups=4, head_dim=64, ffn_hidden_size=4096, moe_ffn_hidden_size=1024,
    num_experts=16, top_k=4, norm_topk_prob=True, aux_loss_coeff=1e-3, params_dtype="bfloat16",
    max_position_embeddings=4096)


def param_counts(m: ModelConfig) -> tuple[int, int]:
    h = m.hidden_size
    attn = h * (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim \
        + m.num_attention_heads * m.head_dim * h + 2 * m.head_dim + 2 * h
    expert = 3 * h * m.moe_ffn_hidden_size
    layer_total = attn + m.num_experts * expert + m.num_experts * h
    layer_active = attn + m.top_k * expert + m.num_experts * h
    emb = 2 * m.vocab_size * h + h
    return (m.num_layers * layer_total + emb, m.num_layers * layer_active + emb)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")

    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.models.model import build_model, count_parameters
    from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel
    from megatron_gspo.models import te

    m = MODEL_1B
    ctx = init_parallel(ParallelConfig(), m, seed=0)
    gpt = build_model(m, ctx)
    total, active = param_counts(m)
    print(f"device {torch.cuda.get_device_name()}  TE layers: {te.use_te_spec('cuda')}")
    print(f"parameters: {count_parameters(gpt) / 1e9:.3f} B built ({total / 1e9:.3f} B by formula), "
          f"{active / 1e9:.3f} B active per token")
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, chunk_size=4096)
        return -logp.mean(), {}

    tokens = torch.randint(0, m.vocab_size, (args.batch, args.seq + 1), device="cuda")
    batch = [MicroBatch(tokens[:, :-1], tokens[:, 1:])]
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        forward_backward(gpt, batch, ctx, loss_fn)
        opt.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    n_tokens = args.batch * args.seq
    attn_flops = 6 * m.num_layers * m.num_attention_heads * m.head_dim * args.seq * n_tokens
    flops = 6 * active * n_tokens + attn_flops
    print(f"batch {args.batch} x seq {args.seq}: median step {dt * 1e3:.1f} ms, "
          f"{n_tokens / dt:,.0f} tokens/s, {flops / dt / 1e12:.1f} model TFLOP/s, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    destroy_parallel()


if __name__ == "__main__":
    main()
