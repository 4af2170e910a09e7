"""The GPU path at the 1B MoE's own widths, run on CPU where a GPU would fail first: on the meta
device (shapes and dtypes, no values) under ``host_operands``, which raises where an operation
takes a host tensor beside device ones (CUDA refuses them; the meta device lets some through:
``matmul``, ``gather``). So, before any GPU runs them:

- the update: the whole model built from the GPU backend's layers (SDPA attention, the sort
  dispatcher, the grouped experts with their groups padded for Hopper) on three packed
  micro-batches of host tensors through the trainer's ``forward_backward`` (Megatron's schedule,
  the moves to the device), forward, the policy loss of each algorithm, backward: every tensor on
  the device, no read of the device in any micro-batch (the meta device has no values: a read
  raises), ``grouped_mm``'s CUDA rules met (its meta kernel checks the dtype and the 16-byte
  strides);
- the static decoder at the rollout's batch of 32 (the prefill, sampling, stop tokens, routes,
  the decoding loop): the same; and with the host's reads of the rows left answered from a
  script (``scripted_reads``), its readbacks and the moves of the rows into smaller buckets,
  each decoding step touching no host tensor at all (``no_host_tensors``: a CUDA graph's
  capture);
- planted host tensors and a planted read are caught.

(The bf16 model's values are not checked here: the tests on CPU compare them, the GPU tier runs
them.)"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scripts.gpu_check import MODEL_1B

META = torch.device("meta")


class HostOperand(RuntimeError):
    pass


class host_operands(TorchDispatchMode):
    """Raises ``HostOperand`` at an operation that takes a host tensor (not a 0-dim scalar)
    beside a device tensor, other than a copy to the device; ``ops`` counts the operations
    seen."""

    COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if (func not in self.COPIES and any(t.device.type != "cpu" for t in tensors)
                and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors)):
            raise HostOperand(f"{func} takes a host tensor beside device tensors")
        return func(*args, **kwargs)


class no_host_tensors(TorchDispatchMode):
    """Raises ``HostOperand`` at any operation on a host tensor, copies and 0-dim scalars
    included: what a CUDA graph's capture needs (a copy from pageable host memory is not
    allowed while capturing; a host scalar would be frozen into the graph)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
               for t in tree_leaves((args, kwargs))):
            raise HostOperand(f"{func} takes a host tensor inside a step to be captured")
        return func(*args, **kwargs)


class scripted_reads(host_operands):
    """``host_operands`` that answers the host's reads of a device scalar (``.item()``,
    ``int(t)``) from ``answers``, in order, where the meta device has no value to give."""

    def __init__(self, answers):
        super().__init__()
        self.answers = list(answers)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device == META:
            self.ops += 1
            return self.answers.pop(0)
        return super().__torch_dispatch__(func, types, args, kwargs)


class Decoded(Exception):
    """Raised with the decoding loop's results, before the host reads them back (the meta
    device has no values to read)."""


def stop_after_decoding(gen) -> None:
    """Makes ``gen.generate`` raise ``Decoded`` with its decoding loop's results."""
    decode = gen._decode

    def decode_then_stop(*args):
        raise Decoded(decode(*args))

    gen._decode = decode_then_stop


def test_the_check_on_planted_cases():
    x = torch.randn(4, 3, device=META)
    for op, fn in (("mm", lambda: x @ torch.ones(3, 3)),
                   ("gather", lambda: x.gather(1, torch.zeros(4, 1, dtype=torch.long))),
                   ("add", lambda: x + torch.ones(3))):
        with pytest.raises(HostOperand, match=f"aten.{op}"), host_operands():
            fn()
    with host_operands():
        y = (x + torch.tensor(2.0)) @ torch.ones(3, 3).to(META)  # a 0-dim scalar; a copy
    assert y.device == META
    two = torch.tensor(2.0)
    for op, fn in (("add", lambda: x + two), ("_to_copy", lambda: torch.ones(3).to(META))):
        with pytest.raises(HostOperand, match=f"aten.{op}"), no_host_tensors():
            fn()
    with no_host_tensors():
        assert (x * 2.0 + torch.arange(3, device=META)).device == META  # Python numbers pass


@pytest.fixture(scope="module")
def gpu_model():
    """The 1B MoE at its widths with 2 layers, built from the GPU backend's layer classes
    (parameters made on the host, as the GPU backend makes them on the GPU; the all-to-all
    dispatcher, which makes a CUDA stream when built, is replaced by the sort dispatcher at ep=1
    either way), bf16, then moved to the meta device."""
    warnings.filterwarnings("ignore")
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_gspo.backends.gpu import GPU_ON_HOST
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel
    from megatron_gspo.models.dispatch import SortTokenDispatcher
    from megatron_gspo.models.grouped_experts import GroupedSequentialMLP
    from megatron_gspo.models.model import build_model

    m = dataclasses.replace(MODEL_1B, num_layers=2)
    ctx = init_parallel(ParallelConfig(device="cpu"), m, seed=0)
    try:
        gpt = build_model(m, ctx, backend=GPU_ON_HOST)
        moes = [x for x in gpt.modules() if isinstance(x, MoELayer)]
        assert len(moes) == 2 and all(isinstance(x.token_dispatcher, SortTokenDispatcher)
                                      and type(x.experts) is GroupedSequentialMLP for x in moes)
        gpt.to(META)
        # RoPE's frequencies are a plain attribute, made on the GPU there
        gpt.rotary_pos_emb.inv_freq = gpt.rotary_pos_emb.inv_freq.to(META)
        yield m, ctx, gpt
    finally:
        destroy_parallel()


def packed_micro_batch(lengths, vocab_size: int, g: torch.Generator):
    """A host micro-batch of one packed row of sequences of ``lengths`` (the first 40 tokens a
    prompt), as the trainer's packing makes it."""
    from megatron_gspo.batch.micro_batch import MicroBatch

    n = sum(lengths)
    tokens = torch.randint(0, vocab_size, (1, n + 1), generator=g)
    mask = torch.ones(1, n)
    mask[0, :40] = 0
    return MicroBatch(
        tokens[:, :-1], tokens[:, 1:],
        position_ids_BS=torch.cat([torch.arange(k) for k in lengths])[None],
        old_logp_BS=-torch.rand(1, n, generator=g), loss_mask_BS=mask,
        advantages_B=torch.randn(len(lengths), generator=g),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        seq_BS=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None])


@pytest.mark.parametrize("algo", ["gspo", "gspo_token", "grpo"])
def test_an_update_on_packed_micro_batches_stays_on_the_device(gpu_model, algo, monkeypatch):
    """Three packed micro-batches of host tensors through ``forward_backward`` as the policy
    update runs it (Megatron's schedule; each micro-batch's packed parameters made from its host
    bounds, then the micro-batch moved to the device; the routers' padding mask), the packed
    policy loss, the backward: no read of the device, no host operand, in any micro-batch."""
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.algorithms.losses import shard_policy_loss
    from megatron_gspo.distributed.seqshard import TokenShard
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_gspo.models.forward import forward_backward

    # Megatron keeps the auxiliary losses' backward scale in a class attribute, made on the
    # device of the first micro-batch in the process and copied into after: here the meta device
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    m, ctx, gpt = gpu_model
    g = torch.Generator().manual_seed(0)
    # (lengths not multiples of the experts' padded group rows; one row of a single sequence)
    mbs = [packed_micro_batch(lengths, m.vocab_size, g)
           for lengths in ([300, 517, 207], [128, 64, 800], [1000])]
    seen = []

    def loss_fn(mb, logits):
        seen.append((logits.shape, logits.dtype, mb.tokens_BS.device))
        logp, ent = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, with_entropy=True)
        shard = TokenShard.from_packed(logp, mb.old_logp_BS, mb.advantages_B, mb.loss_mask_BS,
                                       mb.seq_BS, mb.num_seqs, entropy_1N=ent.detach())
        return shard_policy_loss(algo, shard, normalizer=7.0, clip_low=3e-4, clip_high=4e-4)

    for p in gpt.parameters():
        p.grad = None
    with host_operands() as check:
        out = forward_backward(gpt, mbs, dataclasses.replace(ctx, device=META), loss_fn,
                               aux_mask=True)
    assert seen == [((1, mb.tokens_BS.shape[1], m.vocab_size), torch.bfloat16, META)
                    for mb in mbs]
    assert len(out) == 3 and check.ops > 0
    assert all(v.device == META for metrics in out for v in metrics.values())
    assert all(p.grad is not None and p.grad.device == META for p in gpt.parameters())


def test_the_static_generator_at_the_rollouts_batch_stays_on_the_device(gpu_model):
    """8 prompts of several lengths x 4 samples (32 rows): the prefill, the rows' seeds and
    routes, and the decoding loop with sampling and stop tokens, up to the loop's results (read
    by the host once, after it; the finished flags every ``readback_steps``, past the end
    here)."""
    from megatron_gspo.rollout.static_decode import StaticGenerator
    from megatron_gspo.rollout.types import SamplingParams

    m, _, gpt = gpu_model

    gen = StaticGenerator(gpt, pad_id=0, readback_steps=8)
    stop_after_decoding(gen)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, m.vocab_size, (n,), generator=g).tolist()
               for n in (64, 40, 17, 64, 33, 8, 51, 60)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.95, seed=3,
                            stop_token_ids=(2, 7))
    with pytest.raises(Decoded) as decoded, host_operands() as check:
        gen.generate(prompts, 4, params, routes=True)
    tokens_BR, logp_BR, count_B, routes_BSLK = decoded.value.args[0]
    assert gen.steps_run == 5 and gen.readbacks_run == 0 and check.ops > 0
    assert tokens_BR.shape == logp_BR.shape == (32, 6) and count_B.shape == (32,)
    assert routes_BSLK.shape[::2] == (32, 2) and routes_BSLK.shape[3] == m.top_k
    assert all(t.device == META for t in (tokens_BR, logp_BR, count_B, routes_BSLK))


def test_the_readbacks_and_the_compaction_between_buckets_stay_on_the_device(gpu_model):
    """The decoding loop past its readbacks: every 4 steps the host reads how many rows are
    left, here 32 (no smaller bucket), 13 (the rows move into a bucket of 16), 16 (stay), 3
    (into 4), then 0 (the loop stops); the moves index the cache, the tokens and the positions
    on the device, and each decoding step touches no host tensor at all (as a CUDA graph's
    capture needs)."""
    from megatron_gspo.rollout.static_decode import StaticGenerator
    from megatron_gspo.rollout.types import SamplingParams

    m, _, gpt = gpu_model

    gen = StaticGenerator(gpt, pad_id=0, readback_steps=4)
    stop_after_decoding(gen)
    step, batches = gen._step, []

    def step_and_record(model, cache, token_B, pos_B, cos, sin):
        batches.append((len(token_B), len(pos_B), cache["valid"].shape[0],
                        cache["keys"][-1].shape[0]))
        with no_host_tensors():  # the step a CUDA graph captures
            return step(model, cache, token_B, pos_B, cos, sin)

    gen._step = step_and_record
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, m.vocab_size, (n,), generator=g).tolist()
               for n in (12, 30, 7, 64, 19, 41, 5, 26)]
    params = SamplingParams(max_new_tokens=32, temperature=1.0, top_k=20, seed=4,
                            stop_token_ids=(2,))
    with pytest.raises(Decoded) as decoded, scripted_reads([32, 13, 16, 3, 0]) as check:
        gen.generate(prompts, 4, params, routes=True)
    assert check.answers == [] and gen.readbacks_run == 5 and gen.steps_run == 19
    assert batches == [(32,) * 4] * 7 + [(16,) * 4] * 8 + [(4,) * 4] * 4
    tokens_BR, logp_BR, count_B, routes_BSLK = decoded.value.args[0]
    assert tokens_BR.shape == logp_BR.shape == (32, 32) and routes_BSLK.shape[0] == 32
    assert all(t.device == META for t in (tokens_BR, logp_BR, count_B, routes_BSLK))


def test_a_planted_host_tensor_and_a_planted_read_are_caught(gpu_model, monkeypatch):
    import megatron_gspo.rollout.static_model as sm

    _, _, gpt = gpu_model
    norm = sm._norm
    model = sm.StaticModel(gpt)
    tokens = torch.zeros(2, 3, dtype=torch.long, device=META)
    positions = torch.arange(3, device=META).expand(2, 3)
    for planted, caught, match in (
            (lambda x: x + torch.zeros(x.shape[-1]), HostOperand, "aten.add"),
            (lambda x: x * float(x.sum()), RuntimeError, "cannot be called on meta tensors")):
        monkeypatch.setattr(sm, "_norm", lambda x, w, eps, f=planted: norm(f(x), w, eps))
        with pytest.raises(caught, match=match), host_operands(), torch.no_grad():
            sm.forward_tokens(model, sm.new_cache(model, 2, 3, META, torch.bfloat16), tokens,
                              positions, *sm.rope_tables(gpt, 3, torch.bfloat16))
