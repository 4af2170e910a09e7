"""What a job will do on a cluster shape, before it is queued; refuses jobs that cannot fit.

    python -m tools.plan_layout --nodes 4 --gpus-per-node 8 --model-path /models/Qwen3-30B-A3B \
        -- +experiment=qwen3_30b_a3b +arm=gspo data.files=[/data/train.parquet]
    python -m tools.plan_layout --world-size 2 parallel.ep=2      # a one-node job of 2 ranks

Composes the Hydra config with the overrides (``--model-path`` adds the ones launch/submit.sh
adds: the trainer starts from the checkpoint, with its tokenizer, and SGLang servers serve it),
validates it as the trainer does at start-up, and prints: the placement (training nodes and
SGLang server nodes), world = tp x pp x cp x dp and the expert layout, an estimate of each GPU's
memory (parameters, gradients, optimizer, activations of the largest micro-batch, engine KV
cache), the host memory per rank while a checkpoint is written, the bytes of one weight sync and
the timeouts in force. Exit status 2 with one line when the config does not validate or the
estimate does not fit the GPUs.

The memory figures are estimates from the shapes (documented below, +-20%): they say whether a
layout is far from fitting, not the last GiB.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
# CUDA context, NCCL buffers and the allocator's fragmentation, per GPU.
FIXED_OVERHEAD_GIB = 4.0


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters: ``dense`` (attention, norms, routers, dense MLPs) and ``experts``
    of all layers; ``embedding`` and ``output`` (untied)."""

    embedding: int
    output: int
    dense: int
    experts: int

    @property
    def total(self) -> int:
        return self.embedding + self.output + self.dense + self.experts


def count_parameters(m) -> ParamCounts:
    """Parameters of a Qwen3-MoE shaped ``ModelConfig`` (no biases, untied embeddings)."""
    h, d = m.hidden_size, m.head_dim
    attention = (h * (m.num_attention_heads + 2 * m.num_query_groups) * d
                 + m.num_attention_heads * d * h + 2 * h + 2 * d)
    dense, experts = 0, 0
    for moe in m.moe_layer_pattern:
        dense += attention
        if moe:
            dense += m.num_experts * h + 3 * h * m.shared_expert_ffn_hidden_size
            experts += 3 * m.num_experts * m.moe_ffn_hidden_size * h
        else:
            dense += 3 * h * m.ffn_hidden_size
    return ParamCounts(embedding=m.vocab_size * h, output=m.vocab_size * h, dense=dense + h,
                       experts=experts)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of the busiest rank (the first pipeline stage, which holds the most
    micro-batches in flight), and bytes of host memory per rank at a checkpoint."""

    params: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    reference: float
    checkpoint_host: float
    tokens_per_micro_batch: int

    @property
    def gpu_total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.kv_cache
                + self.reference + FIXED_OVERHEAD_GIB * GiB)


def memory_plan(job, world: int, dp: int, checkpoint_format: str) -> MemoryPlan:
    """Estimate per GPU for ``job`` on ``world`` ranks (see the module docstring).

    - parameters in ``model.params_dtype``, gradients in fp32 (Megatron DDP's main_grad), the
      distributed optimizer's fp32 main copy and Adam moments (12 bytes per parameter) sharded
      over data x context parallel ranks (dense) and the experts' data-parallel ranks;
    - activations of one micro-batch of the largest packed size (``max_tokens_per_micro_batch``,
      or one whole row of prompt + ``max_new_tokens`` when that is longer), bf16, per token and
      layer: attention (norm input and output, q/k/v, attention output, o_proj input; split by
      TP) and MoE (norm, each of the top-k copies' input, fc1 output, SwiGLU output, fc2 output;
      tokens split by TP under sequence parallelism, expert widths by ETP), times the
      micro-batches a first pipeline stage holds (pp); with ``model.activation_recompute=full``,
      each layer's input plus one layer's activations;
    - the local engine's KV cache for a step's rows, a reference model's parameters (kl_coef).
    """
    m, p, t, r = job.model, job.parallel, job.trainer, job.rollout
    c = count_parameters(m)
    tp, pp, ep, etp, cp = p.tp, p.pp, p.ep, p.expert_tp, p.cp
    per_stage_dense = c.dense / pp / tp
    edges = (c.embedding + c.output if pp == 1 else max(c.embedding, c.output)) / tp
    dense = per_stage_dense + edges
    experts = c.experts / pp / (ep * etp)
    width = 2 if m.params_dtype == "bfloat16" else 4
    edp = world // (ep * etp * pp)
    params = (dense + experts) * width
    grads = (dense + experts) * 4
    optimizer = 12 * (dense / (dp * cp) + experts / max(edp, 1))

    row = 512 + r.max_new_tokens  # a prompt of up to 512 tokens, and its response
    tokens = max(t.max_tokens_per_micro_batch, row) if t.packing else t.micro_batch_size * row
    local = tokens / cp
    h, d, k = m.hidden_size, m.head_dim, max(m.top_k, 1)
    sp = tp if p.sequence_parallel else 1
    attention = (2 * h / sp + (3 * m.num_attention_heads + 2 * m.num_query_groups) * d / tp)
    moe = (2 * h + k * (2 * h + 4 * m.moe_ffn_hidden_size / etp)) / sp
    dense_mlp = (2 * h + 4 * m.ffn_hidden_size / tp) / sp
    per_layer = [attention + (moe if x else dense_mlp) for x in m.moe_layer_pattern]
    layers = len(per_layer) / pp
    if m.activation_recompute == "full":
        per_token = layers * h / sp + max(per_layer)
    else:
        per_token = layers * sum(per_layer) / len(per_layer)
    in_flight = pp  # 1F1B: the first stage holds pp micro-batches' activations
    # The log-prob loss keeps chunks of [C, V / tp] fp32 logits (megatron_gspo/algorithms/logprobs.py).
    logits = 4 * 4096 * m.vocab_size / tp * 2
    activations = 2 * local * per_token * in_flight + logits

    kv_cache = 0.0
    if r.engine == "local":
        rows = r.prompts_per_step * r.group_size // max(dp, 1)
        kv_cache = (2 * rows * row * len(m.moe_layer_pattern) / pp
                    * max(1, m.num_query_groups // tp) * d * width)
    reference = params if job.algo.kl_coef > 0 else 0.0

    # Host memory at a checkpoint: the writer stages what the rank saves; dp_reshardable saves
    # each rank's own optimizer shard, fully_reshardable gathers a model-parallel shard's whole
    # fp32 state on its data-parallel rank 0 (gloo).
    if checkpoint_format == "fully_reshardable":
        host = params + 12 * (dense + experts)
    else:
        host = params + optimizer
    return MemoryPlan(params, grads, optimizer, activations, kv_cache, reference, host,
                      int(tokens))


def model_overrides(model_path: str, sglang: bool) -> list[str]:
    """What launch/train.sbatch adds for ``--model-path`` (train the checkpoint with its own
    tokenizer; the servers serve it)."""
    out = [f"trainer.init_from={model_path}", f"data.tokenizer={model_path}",
           f"rollout.sglang_model_path={model_path}"]
    if sglang:
        out += ["rollout=sglang", "rollout.sglang_urls=[http://planned:30000]"]
    return out


def plan(args, overrides: list[str]) -> list[str]:
    """The plan's lines; raises ``ConfigError`` when the job does not validate or fit."""
    from megatron_gspo.config import ConfigError
    from megatron_gspo.checkpoint.manager import optimizer_format
    from megatron_gspo.config.load import compose_job

    import torch

    nodes = args.nodes
    gpus = args.gpus_per_node
    sg_nodes = args.sglang_nodes
    if sg_nodes and not 1 <= sg_nodes < nodes:
        raise ConfigError(f"--sglang-nodes {sg_nodes}: needs 1 <= K < --nodes {nodes}")
    world = (nodes - sg_nodes) * gpus
    extra = model_overrides(args.model_path, sg_nodes > 0) if args.model_path else []
    if sg_nodes and not args.model_path:
        extra += ["rollout=sglang", "rollout.sglang_urls=[http://planned:30000]"]
    if sg_nodes:
        extra += [f"rollout.sglang_gpus_per_server={args.sglang_tp or gpus}",
                  f"rollout.sglang_ep_per_server={args.sglang_ep}"]
    try:
        job = compose_job(extra + overrides)
    except ConfigError as e:
        if not str(e).startswith("rollout.sglang_urls=[]"):
            raise
        # Servers started outside this job: their URLs are only known when it runs.
        job = compose_job(extra + overrides + ["rollout.sglang_urls=[http://planned:30000]"])
    p, m, r = job.parallel, job.model, job.rollout
    # A cluster plan is a GPU job unless the config says otherwise; a local one follows the config.
    device = p.device if p.device != "auto" else ("cuda" if args.world_size is None else "cpu")
    gpu_job = device == "cuda"
    dp = p.validate(world, m, device_type=device, have_te=not args.without_te)
    job.check_layout(dp)
    fmt = optimizer_format(job.trainer.checkpoint_format, torch.device(device))
    mem = memory_plan(job, world, dp, fmt)
    counts = count_parameters(m)

    lines = []
    if args.world_size is None:
        servers = (f"SGLang on {sg_nodes} node(s), one server per node (tp {args.sglang_tp or gpus}"
                   f", ep {args.sglang_ep})" if sg_nodes else f"rollout engine {r.engine}")
        lines.append(f"placement: {nodes} node(s) x {gpus} GPUs: trainer on {nodes - sg_nodes} "
                     f"node(s) ({world} ranks); {servers}")
    lines.append(
        f"layout: world {world} = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {dp}; experts: ep "
        f"{p.ep} x etp {p.expert_tp} ({m.num_experts // p.ep if m.is_moe else 0} of "
        f"{m.num_experts} experts per rank); sequence parallel {p.sequence_parallel}; model "
        f"{m.name} ({counts.total / 1e9:.2f} B parameters); algo {job.algo.name}, replay "
        f"{job.replay.mode}, engine {r.engine}; {r.prompts_per_step} prompts x {r.group_size} per "
        f"step, {job.algo.minibatches} updates per step")
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    lines.append(
        f"memory per GPU (estimate): parameters {g(mem.params)} GiB ({m.params_dtype}), gradients "
        f"{g(mem.grads)}, optimizer {g(mem.optimizer)} (fp32 main + Adam, sharded), activations "
        f"{g(mem.activations)} (micro-batches of {mem.tokens_per_micro_batch} tokens, recompute "
        f"{m.activation_recompute})" + (f", engine KV cache {g(mem.kv_cache)}" if mem.kv_cache else "")
        + (f", reference model {g(mem.reference)}" if mem.reference else "")
        + f", overhead {FIXED_OVERHEAD_GIB:.0f}: total {g(mem.gpu_total)} GiB of "
        f"{args.gpu_memory_gb:g}")
    lines.append(f"host memory per rank at a checkpoint (estimate): {g(mem.checkpoint_host)} GiB "
                 f"(optimizer moments saved {fmt})")
    sync_bytes = counts.total * (2 if m.params_dtype == "bfloat16" else 4)
    bucket = r.weight_sync_bucket_mb * 2**20
    if r.engine == "sglang":
        lines.append(f"weight sync: {sync_bytes / 1e9:.2f} GB per step ({r.weight_sync}, from "
                     f"trainer rank 0 to every server, {math.ceil(sync_bytes / bucket)} buckets "
                     f"of {r.weight_sync_bucket_mb:g} MiB)")
        lines.append(f"timeouts: process groups {p.timeout_s:g} s; SGLang start-up "
                     f"{r.sglang_startup_timeout_s:g} s, /generate {r.sglang_generate_timeout_s:g} "
                     f"s (retried), weight update {r.sglang_update_timeout_s:g} s (never "
                     f"retried), other calls {r.sglang_control_timeout_s:g} s (retried)")
    else:
        lines.append(f"weight sync: none (the in-process engine shares the trainer's weights); "
                     f"timeouts: process groups {p.timeout_s:g} s")
    if gpu_job and mem.gpu_total > args.gpu_memory_gb * GiB:
        raise ConfigError(
            f"the job does not fit: about {g(mem.gpu_total)} GiB per GPU (parameters "
            f"{g(mem.params)}, gradients {g(mem.grads)}, optimizer {g(mem.optimizer)}, "
            f"activations {g(mem.activations)}) > {args.gpu_memory_gb:g} GiB; fix: more "
            "tp/ep/pp, model.activation_recompute=full, or a smaller "
            "trainer.max_tokens_per_micro_batch")
    if sg_nodes:
        served = sync_bytes / (args.sglang_tp or gpus)
        if served > 0.9 * args.gpu_memory_gb * GiB:
            raise ConfigError(f"--sglang-tp {args.sglang_tp or gpus}: each server GPU would hold "
                              f"{g(served)} GiB of weights, no room for its KV cache; fix: a "
                              "larger --sglang-tp")
    return lines


def main(argv=None) -> int:
    from megatron_gspo.config import ConfigError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=None,
                    help="a one-node job of this many ranks (instead of --nodes/--gpus-per-node)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--sglang-nodes", type=int, default=0)
    ap.add_argument("--sglang-tp", type=int, default=0)
    ap.add_argument("--sglang-ep", type=int, default=1)
    ap.add_argument("--model-path", default="")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0)
    ap.add_argument("--without-te", action="store_true",
                    help="the GPUs' environment has no Transformer Engine")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.world_size is not None:
        args.nodes, args.gpus_per_node = 1, args.world_size
    try:
        for line in plan(args, args.overrides):
            print(line)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
