"""What the host queues on a GPU, counted on CPU: operators, kernels and host synchronisations per
decoding step of a batch and per update micro-batch, ours against transformers'
``Qwen3MoeForCausalLM`` on the same weights.

    python benchmarks/launches.py [--batch 32] [--prompt-tokens 64] [--update-tokens 2048]

The model is the 1B MoE's structure (``scripts/gpu_check.py``: 16 MoE layers,
16 experts, top-4, GQA) with its widths scaled down, in bf16; ours is built from the GPU backend's
layers (SDPA attention, the sort dispatcher, the grouped experts), as a GPU runs them. The counts
do not depend on the widths: on a GPU each operator that is not a view is one kernel launch or
more, each costing the host several microseconds (torch's dispatcher, Python around it), and
each host synchronisation makes the host wait for the GPU. A step whose launches cost the host
more than the GPU's work is host-bound. (transformers' counts are its default eager paths on this
version; a GPU run may pick others.)

Per decoding step: two generations of the same prompts, of ``--short`` and ``--long`` new tokens,
their difference divided by the steps between them (the prefill and the fixed costs cancel; our
static decoder's reads every 8 steps are shared out), and apart the part of our step that
``rollout.cuda_graphs`` captures (``forward_tokens``). Per update micro-batch: the forward and the
backward of a log-likelihood loss on ``--update-tokens`` tokens (the optimizer's step, which
differs between CPU and GPU builds, is left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import warnings
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from transformers import AutoModelForCausalLM  # noqa: E402

from megatron_gspo.algorithms.logprobs import token_logprobs  # noqa: E402
from megatron_gspo.backends.gpu import GPU_ON_HOST  # noqa: E402
from megatron_gspo.config import ParallelConfig  # noqa: E402
from megatron_gspo.debug import count_host_syncs  # noqa: E402
from megatron_gspo.distributed.parallel import init_parallel  # noqa: E402
from megatron_gspo.models.hf_io import SeededTensors  # noqa: E402
from megatron_gspo.models.hf_mapping import export_hf, load_hf_weights  # noqa: E402
from megatron_gspo.models.model import build_model  # noqa: E402
from megatron_gspo.rollout.local_engine import LocalEngine  # noqa: E402
from megatron_gspo.rollout.static_decode import StaticGenerator  # noqa: E402
from megatron_gspo.rollout.static_model import (StaticModel, forward_tokens,  # noqa: E402
                                                 new_cache, rope_tables)
from megatron_gspo.rollout.types import SamplingParams  # noqa: E402
from scripts.gpu_check import MODEL_1B  # noqa: E402

# operators that allocate without writing or only describe other memory: no kernel
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
             "lift_fresh", "_unsafe_view", "alias", "set_", "resize_", "_local_scalar_dense"}


class Operators(TorchDispatchMode):
    """Counts the operators dispatched in its block: ``ops`` all of them, ``kernels`` those that
    are not views nor allocations, ``fused`` the kernels inside ``F.rms_norm`` calls (``calls``:
    how many), which a CUDA build of torch runs as one kernel (``aten::_fused_rms_norm``) where
    the CPU dispatches its parts."""

    def __init__(self):
        super().__init__()
        self.ops, self.kernels, self.fused, self.calls, self.inside = Counter(), 0, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if not func.is_view and name not in NO_KERNEL:
            self.kernels += 1
            self.fused += self.inside > 0
        return func(*args, **(kwargs or {}))


class RMSNormCalls(TorchFunctionMode):
    """Marks ``ops``'s operators dispatched inside ``F.rms_norm`` (its forward)."""

    def __init__(self, ops: Operators):
        super().__init__()
        self.seen = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.rms_norm:
            return func(*args, **(kwargs or {}))
        self.seen.calls += 1
        self.seen.inside += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.seen.inside -= 1


def counted(fn) -> dict:
    ops = Operators()
    with count_host_syncs() as syncs, ops, RMSNormCalls(ops):
        fn()
    return {"ops": sum(ops.ops.values()), "kernels": ops.kernels,
            "cuda_kernels": ops.kernels - ops.fused + ops.calls, "syncs": syncs.total,
            "syncs_by_op": dict(syncs.by_op)}


def per_step(generate, short: int, long: int) -> dict:
    """Counts per decoding step: ``generate(k)`` generates k new tokens."""
    a, b = counted(lambda: generate(short)), counted(lambda: generate(long))
    steps = long - short
    out = {k: (b[k] - a[k]) / steps for k in ("ops", "kernels", "cuda_kernels", "syncs")}
    out["syncs_by_op"] = {k: (v - a["syncs_by_op"].get(k, 0)) / steps
                          for k, v in b["syncs_by_op"].items()
                          if v != a["syncs_by_op"].get(k, 0)}
    return out


def build(args):
    """Our model from the GPU backend's layers on the host, seeded weights, and transformers'
    model loaded from our export of them."""
    h = args.hidden
    m = dataclasses.replace(MODEL_1B, vocab_size=1024, hidden_size=h, head_dim=h // 4,
                            num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * h,
                            moe_ffn_hidden_size=h // 2)
    ctx = init_parallel(ParallelConfig(device="cpu"), m, seed=0)
    gpt = build_model(m, ctx, backend=GPU_ON_HOST)
    load_hf_weights(gpt, SeededTensors(m, 1), m, ctx)
    with tempfile.TemporaryDirectory(prefix="launches_hf_") as out:  # (loaded, then removed)
        export_hf(gpt, m, ctx, out)
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    return m, ctx, gpt.eval(), hf


def decoding(m, ctx, gpt, hf, args) -> dict:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, m.vocab_size, (args.batch, args.prompt_tokens), generator=g)
    as_is = LocalEngine(gpt, ctx, pad_id=0)
    as_is.direct_decode = False  # (the CPU backend's own decoding step; a GPU's has none)
    engines = {"ours (static decoder)": LocalEngine(gpt, ctx, pad_id=0,
                                                    static=StaticGenerator(gpt, pad_id=0)),
               "ours (megatron's forward)": as_is}
    out = {}
    for name, engine in engines.items():
        out[name] = per_step(lambda k, e=engine: e.generate(
            prompts.tolist(), 1, SamplingParams(max_new_tokens=k, temperature=1.0, seed=1)),
            args.short, args.long)
    static = out.pop("ours (static decoder)")
    out = {"ours (static decoder)": static,
           "  of which its captured step": captured_step(gpt, prompts.shape[1], args), **out}
    for name, extra in (("transformers (dynamic cache)", {}),
                        ("transformers (static cache)", {"cache_implementation": "static"})):
        def generate(k, extra=extra):
            with torch.no_grad():
                hf.generate(prompts, do_sample=True, max_new_tokens=k, min_new_tokens=k,
                            pad_token_id=0, **extra)
        out[name] = per_step(generate, args.short, args.long)
    return out


def captured_step(gpt, position: int, args) -> dict:
    """The part of the static decoder's step that ``rollout.cuda_graphs`` captures and replays
    (``forward_tokens`` for the batch at one position); the rest of the step (sampling, the
    rows' buffers) is launched from the host in every step."""
    model = StaticModel(gpt)
    cache = new_cache(model, args.batch, position + args.long, "cpu", torch.bfloat16)
    cos, sin = rope_tables(gpt, position + args.long, torch.bfloat16)
    tokens = torch.randint(3, model.embedding.shape[0], (args.batch, 1),
                           generator=torch.Generator().manual_seed(2))
    positions = torch.full((args.batch, 1), position)
    with torch.no_grad():
        return counted(lambda: forward_tokens(model, cache, tokens, positions, cos, sin))


def update(m, ctx, gpt, hf, args) -> dict:
    g = torch.Generator().manual_seed(1)
    rows = max(1, args.update_tokens // 512)
    batch = torch.randint(3, m.vocab_size, (rows, 513), generator=g)
    x, y = batch[:, :-1], batch[:, 1:]
    pos = torch.arange(512).expand_as(x)

    def ours():
        logp, _ = token_logprobs(gpt(x, pos, attention_mask=None), y, group=None)
        (-logp.mean()).backward()

    def theirs():
        logits = hf(input_ids=x).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, y[..., None])[..., 0]
        (-logp.mean()).backward()

    gpt.train()
    hf.train()
    try:
        return {"ours": counted(ours), "transformers": counted(theirs)}
    finally:
        gpt.eval()
        hf.eval()


def table(title: str, rows: dict, baseline: str) -> None:
    print(f"\n{title}")
    print(f"{'':30} {'operators':>9} {'kernels':>8} {'on CUDA':>8} {'host syncs':>10}   "
          f"kernels on CUDA vs {baseline}")
    base = rows[baseline]["cuda_kernels"]
    for name, r in rows.items():
        print(f"{name:30} {r['ops']:9.0f} {r['kernels']:8.0f} {r['cuda_kernels']:8.0f} "
              f"{r['syncs']:10.2f}   {r['cuda_kernels'] / base:.2f}x")
    for name, r in rows.items():
        if r["syncs_by_op"]:
            print(f"  {name}: host syncs by operator {r['syncs_by_op']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--short", type=int, default=4, help="new tokens of the shorter generation")
    ap.add_argument("--long", type=int, default=20, help="new tokens of the longer generation")
    ap.add_argument("--update-tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128, help="the scaled-down hidden width")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    m, ctx, gpt, hf = build(args)
    print(f"the 1B MoE's structure ({m.num_layers} layers, {m.num_experts} experts, top-"
          f"{m.top_k}) at hidden {m.hidden_size}, bf16; torch {torch.__version__}")
    table(f"per decoding step, batch {args.batch} (prompts of {args.prompt_tokens} tokens)",
          decoding(m, ctx, gpt, hf, args), "transformers (dynamic cache)")
    table(f"per update micro-batch of {args.update_tokens} tokens (forward and backward)",
          update(m, ctx, gpt, hf, args), "transformers")


if __name__ == "__main__":
    main()
