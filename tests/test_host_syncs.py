"""Host synchronisations (megatron_gspo.debug.count_host_syncs), counted on CPU for the code that
a GPU runs: the counter itself on planted cases; none in the log-prob loss, in an MoE layer with
every expert local (the sort dispatcher: the same outputs and gradients as megatron's), in a
decoding step of the static decoder (which compiles as one graph and equals the model's forward);
the static generator's log-probs equal the trainer's, its routes the routers', seeded or not;
its experts' three paths and Transformer Engine's layout read as the local one."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from megatron_gspo.debug import count_host_syncs


def test_the_counter_on_planted_cases():
    x = torch.randn(6)
    mask = x > 0
    syncing = {
        "item": lambda: x.sum().item(), "bool": lambda: bool(x.sum() > 0),
        "int": lambda: int(x.argmax()), "tolist": lambda: x.tolist(), "cpu": lambda: x.cpu(),
        "numpy": lambda: x.numpy(), "nonzero": lambda: x.nonzero(),
        "mask index": lambda: x[mask], "mask assignment": lambda: x.clone().__setitem__(mask, 0.0),
        "masked_select": lambda: x.masked_select(mask), "bincount": lambda: torch.bincount(
            torch.tensor([0, 2, 2])), "unique": lambda: torch.unique(torch.tensor([1, 1, 2])),
        "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2]),
                                                             torch.tensor([2, 1])),
        "a tensor as an index": lambda: x[:torch.tensor(3)],
        "isin of many test elements": lambda: torch.isin(torch.arange(32), torch.arange(16)),
        "equal": lambda: torch.equal(x, x), "allclose": lambda: torch.allclose(x, x),
        "histc of the data's range": lambda: torch.histc(x, bins=4),
    }
    for name, fn in syncing.items():
        with count_host_syncs() as syncs:
            fn()
        assert syncs.total == 1, (name, syncs.by_op)
    free = {
        "where": lambda: torch.where(mask, x, 0.0), "scatter_add": lambda: torch.zeros(3)
        .scatter_add_(0, torch.tensor([0, 2]), torch.ones(2)),
        "index by ints": lambda: x[torch.tensor([0, 3])], "sort": lambda: x.sort(),
        "repeat_interleave with output_size": lambda: torch.repeat_interleave(
            torch.tensor([1, 2]), torch.tensor([2, 1]), output_size=3),
        "to the same device": lambda: x.to(x.device), "isin": lambda: torch.isin(x, x[:2]),
        "isclose": lambda: torch.isclose(x, x), "histc of a range": lambda: torch.histc(
            x, bins=4, min=-1, max=1),
    }
    for name, fn in free.items():
        with count_host_syncs() as syncs:
            fn()
        assert syncs.total == 0, (name, syncs.by_op)


def test_the_counter_sees_the_unique_inside_isin_where_torch_calls_it():
    """``isin`` sorts, calling ``unique`` (a host read on CUDA), above a threshold of test
    elements that grows with the elements: the counter counts it exactly where torch's profiler
    records a ``unique`` inside (on either side of the threshold, for a scalar of elements,
    and never with ``assume_unique``)."""
    from torch.profiler import ProfilerActivity, profile

    cases = [(n, m, unique) for n in (1, 12, 32, 1000) for m in range(1, 32)
             for unique in (False, True)]
    seen = {}
    for n, m, unique in cases:
        elements = 7 if n == 1 else torch.arange(n)
        with count_host_syncs() as syncs:
            torch.isin(elements, torch.arange(m), assume_unique=unique)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.isin(elements, torch.arange(m), assume_unique=unique)
        inside = any(e.name == "aten::_unique" for e in prof.events())
        assert syncs.total == inside, (n, m, unique, syncs.by_op)
        seen[n, m, unique] = inside
    assert seen[32, 15, False] is False and seen[32, 16, False] is True  # 10 * 32 ** 0.145
    assert seen[1, 9, False] is False and seen[1, 10, False] is True
    assert not any(v for (_, _, unique), v in seen.items() if unique)


@pytest.mark.parametrize("algo", ["gspo", "gspo_token", "grpo"])
def test_the_log_prob_loss_never_waits_for_the_host(algo):
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.algorithms.losses import policy_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 64, generator=g, requires_grad=True)
    targets = torch.randint(0, 64, (3, 9), generator=g)
    mask = torch.ones(3, 9)
    mask[1, :4] = 0
    old = -3 + 0.01 * torch.randn(3, 9, generator=g)
    with count_host_syncs() as syncs:
        logp, ent = token_logprobs(logits, targets, group=None, with_entropy=True)
        loss, _ = policy_loss(algo, logp, old, torch.randn(3, generator=g), mask)
        loss.backward()
    assert syncs.total == 0, syncs.by_op
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def tiny_moe_config(**overrides):
    """The 1B shape's structure at small widths: a dense first layer, GQA, top-2 of 8 experts
    (the model of the host-sync, compiled-experts and GPU-path tests)."""
    from megatron_gspo.config import ModelConfig

    return ModelConfig(**{**dict(
        vocab_size=128, hidden_size=64, num_layers=3, num_attention_heads=4, num_query_groups=2,
        head_dim=16, ffn_hidden_size=128, moe_ffn_hidden_size=32, num_experts=8, top_k=2,
        first_k_dense=1, init_method_std=0.1), **overrides})


@contextlib.contextmanager
def tiny_moe_model(seed: int, device: str = "cpu", config: dict | None = None, **build):
    """``tiny_moe_config(**config)`` built on one rank of ``device`` by its backend
    (``build_model(**build)``), weights seeded by ``seed``: ``(config, ctx, gpt)``, the parallel
    state torn down after the block."""
    warnings.filterwarnings("ignore")
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel
    from megatron_gspo.models.hf_io import SeededTensors
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model

    m = tiny_moe_config(**(config or {}))
    ctx = init_parallel(ParallelConfig(device=device), m, seed=0)
    try:
        gpt = build_model(m, ctx, **build)
        load_hf_weights(gpt, SeededTensors(m, seed), m, ctx)
        yield m, ctx, gpt
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def tiny():
    """A whole MoE model on one rank (the 1B shape's structure at small widths: a dense first
    layer, GQA, top-k of more experts than k), seeded weights."""
    with tiny_moe_model(3, moe_enable_routing_replay=True) as (m, ctx, gpt):
        gpt.eval()
        yield m, ctx, gpt


def test_an_moe_layer_with_local_experts_never_waits_for_the_host(tiny):
    """The GPU path of an MoE layer (every expert on this rank): the sort dispatcher and the
    grouped experts, forward and backward without a host synchronisation, equal to megatron's
    dispatcher (which reads the counts on the host 4 times forward, once backward)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_gspo.models.dispatch import SortTokenDispatcher
    from megatron_gspo.models.grouped_experts import GroupedSequentialMLP

    _, ctx, gpt = tiny
    moe = next(m for m in gpt.modules() if isinstance(m, MoELayer))
    cls, dtypes, dispatcher = moe.experts.__class__, moe.experts.grouped_dtypes, moe.token_dispatcher
    moe.experts.__class__ = GroupedSequentialMLP  # the GPU backend's experts
    moe.experts.grouped_dtypes = None  # (grouped_mm in fp32 on CPU; bf16 on the GPU)
    try:
        x0 = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(1))
        runs = {}
        for name in ("megatron", "sort"):
            if name == "sort":
                moe.token_dispatcher = SortTokenDispatcher(moe.config, pg_collection=ctx.pg)
            for p in moe.parameters():
                p.grad = None
            x = x0.clone().requires_grad_()
            with count_host_syncs() as forward:
                out, _ = moe(x)
            with count_host_syncs() as backward:
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            runs[name] = (forward.total, backward.total, out.detach(), x.grad,
                          [p.grad.clone() for p in moe.parameters()])
    finally:
        moe.experts.__class__, moe.experts.grouped_dtypes = cls, dtypes
        moe.token_dispatcher = dispatcher
    assert runs["megatron"][0] >= 3 and runs["megatron"][1] >= 1  # (megatron-core 0.16: 3, 1)
    assert runs["sort"][:2] == (0, 0)
    assert torch.equal(runs["sort"][2], runs["megatron"][2])
    assert torch.equal(runs["sort"][3], runs["megatron"][3])
    assert all(torch.equal(a, b) for a, b in zip(runs["sort"][4], runs["megatron"][4]))


def test_the_grouping_with_offsets_is_the_grouping_with_counts():
    """The decoding step's grouping (the groups' ends from a search of the sorted ids) equals the
    dispatcher's (the counts, whose cumulative sum grouped_mm takes), empty experts included,
    without reading the host."""
    from megatron_gspo.models.dispatch import group_by_expert, group_by_expert_offsets

    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(14, generator=g)[:4] + 1 for _ in range(50)])  # 0, 15 empty
    order, rows, counts = group_by_expert(ids, 16)
    with count_host_syncs() as syncs:
        order2, rows2, offsets = group_by_expert_offsets(ids, torch.arange(16))
    assert syncs.total == 0
    assert torch.equal(order2, order) and torch.equal(rows2, rows)
    assert offsets.dtype == torch.int32 and torch.equal(offsets, counts.cumsum(0).int())
    assert counts[0] == 0 and counts[15] == 0 and counts.sum() == 200


def _reference_logits(gpt, tokens):
    with torch.no_grad():
        return gpt(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)


def test_a_decoding_step_never_waits_for_the_host_and_compiles_as_one_graph(tiny):
    from megatron_gspo.rollout.sampling import row_uniform, sample_next
    from megatron_gspo.rollout.static_model import (StaticModel, forward_tokens, new_cache,
                                                    rope_tables, unsupported)
    from megatron_gspo.rollout.types import SamplingParams

    _, ctx, gpt = tiny
    assert unsupported(gpt, ctx) is None
    model = StaticModel(gpt)
    cos, sin = rope_tables(gpt, 32, torch.float32)
    tokens = torch.randint(3, 128, (3, 10), generator=torch.Generator().manual_seed(2))
    ref = _reference_logits(gpt, tokens)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95)
    seeds, step = torch.tensor([11, 12, 13]), torch.zeros((), dtype=torch.long)
    with torch.no_grad():
        cache = new_cache(model, 3, 32, "cpu", torch.float32)
        logits, _ = forward_tokens(model, cache, tokens[:, :7], torch.arange(7).expand(3, 7),
                                   cos, sin)
        assert (logits - ref[:, 6]).abs().max() <= 1e-5
        for p in (7, 8):
            with count_host_syncs() as syncs:
                logits, routes = forward_tokens(model, cache, tokens[:, p:p + 1],
                                                torch.full((3, 1), p), cos, sin)
                sample_next(logits, params, uniform_B=row_uniform(seeds, step))
                step += 1
            assert syncs.total == 0, syncs.by_op
            assert (logits - ref[:, p]).abs().max() <= 1e-5
            assert len(routes) == 2 and routes[0].shape == (3, 1, 2)
        compiled = torch.compile(forward_tokens, fullgraph=True, dynamic=False)
        logits, _ = compiled(model, cache, tokens[:, 9:10], torch.full((3, 1), 9), cos, sin)
        assert (logits - ref[:, 9]).abs().max() <= 1e-5

    # a planted host read in the step is counted
    import megatron_gspo.rollout.static_model as sd

    norm = sd._norm

    def reading(x, weight, eps):
        float(x.sum())
        return norm(x, weight, eps)

    sd._norm = reading
    try:
        with count_host_syncs() as syncs, torch.no_grad():
            forward_tokens(model, new_cache(model, 3, 32, "cpu", torch.float32),
                           tokens[:, :1], torch.zeros(3, 1, dtype=torch.long), cos, sin)
        assert syncs.by_op["_local_scalar_dense"] > 0
    finally:
        sd._norm = norm


@pytest.mark.parametrize("experts", ["grouped", "every expert"])
def test_each_experts_path_of_the_decoding_step_equals_the_model(tiny, experts, monkeypatch):
    """The decoding step's experts as grouped_mm over the tokens sorted by expert, and without
    grouped_mm (every expert on chunks of tokens, in a dtype it does not take): the model's
    logits within 1e-5, no host synchronisation."""
    import megatron_gspo.rollout.static_model as sm

    _, _, gpt = tiny
    model = sm.StaticModel(gpt)
    if experts == "every expert":
        model.grouped_dtypes = ()
        monkeypatch.setattr(sm, "EVERY_EXPERT_CHUNK", 4)  # chunks of 4 of the 3 x 7 prefill
    assert model.grouped(torch.zeros(1, 64), model.layers[1].fc1) == (experts != "every expert")
    cos, sin = sm.rope_tables(gpt, 32, torch.float32)
    tokens = torch.randint(3, 128, (3, 10), generator=torch.Generator().manual_seed(4))
    ref = _reference_logits(gpt, tokens)
    with torch.no_grad():
        cache = sm.new_cache(model, 3, 32, "cpu", torch.float32)
        logits, _ = sm.forward_tokens(model, cache, tokens[:, :7], torch.arange(7).expand(3, 7),
                                      cos, sin)
        assert (logits - ref[:, 6]).abs().max() <= 1e-5
        for p in (7, 8):
            with count_host_syncs() as syncs:
                logits, _ = sm.forward_tokens(model, cache, tokens[:, p:p + 1],
                                              torch.full((3, 1), p), cos, sin)
            assert syncs.total == 0, syncs.by_op
            assert (logits - ref[:, p]).abs().max() <= 1e-5


def test_transformer_engines_layout_is_read_as_the_local_one(tiny):
    """Transformer Engine's layers keep the attention's and a dense MLP's norm in the next
    linear (``layer_norm_weight``; the norm's slot an identity) and the experts as grouped
    linears (``weight0``, ``weight1``, ..): the same model in that layout decodes to the same
    logits; experts whose weights it cannot find are named by ``unsupported``."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_gspo.rollout.static_model as sm

    _, ctx, gpt = tiny
    tokens = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    cos, sin = sm.rope_tables(gpt, 8, torch.float32)

    def logits():
        model = sm.StaticModel(gpt)
        with torch.no_grad():
            return sm.forward_tokens(model, sm.new_cache(model, 2, 8, "cpu", torch.float32),
                                     tokens, torch.arange(6).expand(2, 6), cos, sin)[0]

    local = logits()
    kept = [(layer.input_layernorm, layer.pre_mlp_layernorm, layer.mlp.experts
             if isinstance(layer.mlp, MoELayer) else None) for layer in gpt.decoder.layers]
    try:  # the model in Transformer Engine's layout (the same parameters)
        for layer in gpt.decoder.layers:
            layer.self_attention.linear_qkv.layer_norm_weight = layer.input_layernorm.weight
            layer.input_layernorm = IdentityOp()
            if isinstance(layer.mlp, MoELayer):
                experts = layer.mlp.experts.local_experts
                grouped = torch.nn.Module()
                grouped.num_local_experts = len(experts)
                for name in ("linear_fc1", "linear_fc2"):
                    linear = torch.nn.Module()
                    for i, e in enumerate(experts):
                        linear.register_parameter(f"weight{i}", getattr(e, name).weight)
                    setattr(grouped, name, linear)
                layer.mlp.experts = grouped
            else:
                layer.mlp.linear_fc1.layer_norm_weight = layer.pre_mlp_layernorm.weight
                layer.pre_mlp_layernorm = IdentityOp()
        assert sm.unsupported(gpt, ctx) is None
        # (its experts take the GPU's rule, bf16 grouped_mm: in fp32 every expert runs)
        assert (logits() - local).abs().max() <= 1e-5
        moe = next(lay.mlp for lay in gpt.decoder.layers if isinstance(lay.mlp, MoELayer))
        del moe.experts.linear_fc2.weight1
        assert sm.unsupported(gpt, ctx) == "experts whose weights this step cannot read"
    finally:
        for layer, (norm1, norm2, experts) in zip(gpt.decoder.layers, kept):
            layer.input_layernorm, layer.pre_mlp_layernorm = norm1, norm2
            del layer.self_attention.linear_qkv.layer_norm_weight
            if experts is not None:
                layer.mlp.experts = experts
            else:
                del layer.mlp.linear_fc1.layer_norm_weight
    assert sm.unsupported(gpt, ctx) is None and torch.equal(logits(), local)


def test_a_compiled_step_takes_more_shapes_than_dynamos_default():
    """Each batch bucket and cache length is a compilation of the step; under ``fullgraph``
    dynamo's default limit (8) is a hard error, the generator's limit is not."""
    from megatron_gspo.rollout.static_decode import COMPILED_SHAPES, _compile_limit

    def step(x):
        return (x * 2).sum(-1)

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")
    shapes = range(1, 13)
    assert len(shapes) > torch._dynamo.config.recompile_limit and len(shapes) <= COMPILED_SHAPES
    with _compile_limit():
        for n in shapes:
            assert torch.equal(compiled(torch.ones(n, 3)), torch.full((n,), 6.0))


def test_past_its_compiled_shapes_the_generator_decodes_uncompiled(tiny, monkeypatch, caplog):
    """The compiled step met in more shapes than ``COMPILED_SHAPES`` (here 1: a second batch
    size) goes on uncompiled, with one log line, and the responses are the same."""
    import megatron_gspo.rollout.static_decode as sd
    from megatron_gspo.rollout.types import SamplingParams

    _, _, gpt = tiny
    monkeypatch.setattr(sd, "COMPILED_SHAPES", 1)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2)
    prompts = [[1, 5, 9], [1, 7, 8]]
    eager = sd.StaticGenerator(gpt, pad_id=0)
    compiled = sd.StaticGenerator(gpt, pad_id=0, compile=True)
    torch._dynamo.reset()
    compiled._compiled_step = torch.compile(sd.forward_tokens, fullgraph=True, dynamic=False,
                                            backend="eager")  # (dynamo's tracing, no codegen)
    with caplog.at_level("WARNING", logger=sd.__name__):
        for n in (1, 2):
            ours = compiled.generate(prompts, n, params)
            theirs = eager.generate(prompts, n, params)
            assert [s.response_ids for s in ours] == [s.response_ids for s in theirs]
    assert not compiled.compile
    assert [r.message for r in caplog.records].count(
        "rollout.compile_decode: the decoding step was compiled for 1 shapes; it runs "
        "uncompiled from here") == 1


@pytest.mark.parametrize("readback,seed,stops", [(1, 5, 3), (3, 5, 3), (3, None, 3), (3, 5, 16)])
def test_the_static_generator_equals_the_trainer(tiny, readback, seed, stops):
    """Prompts of several lengths, rows stopping at different steps (the batch moves to smaller
    buckets at the readbacks): each response's log-probs equal the trainer's recomputation, its
    routes the routers' own, and the decoding loop reads the host only at its readbacks, however
    many stop ids there are (3 or 16)."""
    from moe.replay import RoutingReplay

    from megatron_gspo.rollout.static_decode import StaticGenerator
    from megatron_gspo.rollout.types import SamplingParams

    _, _, gpt = tiny
    prompts = [[1, 5, 9, 11], [1, 7], [1, 20, 21, 22, 23, 24, 25], [1, 40, 41]]
    stop_ids = (9, 17, 33) if stops == 3 else tuple(range(3, 128, 8))
    params = SamplingParams(max_new_tokens=14, temperature=1.0, stop_token_ids=stop_ids, seed=seed)
    gen = StaticGenerator(gpt, pad_id=0, readback_steps=readback)
    loop = gen._decode
    reads = []

    def counted(*a, **k):
        with count_host_syncs() as syncs:
            out = loop(*a, **k)
        reads.append(syncs.total)
        return out

    gen._decode = counted
    samples = gen.generate(prompts, 3, params, routes=True)
    assert reads == [gen.readbacks_run] and 0 < gen.readbacks_run <= 13 // readback
    assert len({len(s.response_ids) for s in samples}) > 2  # rows stopped at different steps
    replay = RoutingReplay(gpt)
    for s in samples:
        seq = torch.tensor(s.prompt_ids + s.response_ids)[None]
        with replay.record() as rec, torch.no_grad():
            logits = _reference_logits(gpt, seq[:, :-1])[0]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
        assert (logp[len(s.prompt_ids) - 1:] - s.logprobs_R).abs().max() <= 1e-5
        trainer_routes = torch.stack(rec.forwards[0], 1)  # [T, L, K], this row's positions
        assert s.routes_TLK.shape == trainer_routes.shape
        same = (s.routes_TLK.sort(-1).values == trainer_routes.sort(-1).values).all(-1)
        assert same.float().mean() >= 0.99  # (a near tie may flip at float rounding)


@pytest.mark.parametrize("readback", [1, 3])
def test_seeded_rows_sample_what_the_engines_own_decoding_samples(tiny, readback, monkeypatch):
    """The static generator hashes the rows' sampling numbers for several steps at once
    (windows of 5 here, crossed by the readbacks that move the rows into smaller buckets): each
    seeded row samples the same tokens as the engine's own decoding, which hashes one step at a
    time. And the hash of ``[W]`` steps is the ``W`` hashes of one step, bit for bit."""
    import megatron_gspo.rollout.static_decode as sd
    from megatron_gspo.rollout.local_engine import LocalEngine
    from megatron_gspo.rollout.sampling import row_uniform
    from megatron_gspo.rollout.types import SamplingParams

    seeds = torch.arange(1000) * 7_919 + 2**40
    steps = torch.arange(5, 69)
    assert torch.equal(row_uniform(seeds, steps),
                       torch.stack([row_uniform(seeds, int(s)) for s in steps], 1))

    _, ctx, gpt = tiny
    monkeypatch.setattr(sd, "UNIFORM_STEPS", 5)
    prompts = [[1, 5, 9, 11], [1, 7], [1, 20, 21, 22, 23, 24, 25], [1, 40, 41]]
    params = SamplingParams(max_new_tokens=24, temperature=1.0,
                            stop_token_ids=tuple(range(3, 128, 8)), seed=5)
    own = LocalEngine(gpt, ctx, pad_id=0)
    gen = sd.StaticGenerator(gpt, pad_id=0, readback_steps=readback)
    static = LocalEngine(gpt, ctx, pad_id=0, static=gen)
    assert own.static is None and static.static is gen
    step, buckets = gen._step, []

    def recorded(model, cache, token_B, *a):
        buckets.append(len(token_B))
        return step(model, cache, token_B, *a)

    gen._step = recorded
    expected = own.generate(prompts, 3, params)
    got = static.generate(prompts, 3, params)
    assert buckets[0] == 12 and {2, 4} <= set(buckets)  # moved into smaller buckets twice
    assert len({len(s.response_ids) for s in got}) > 5  # rows stopped at different steps
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]


def test_a_failed_capture_names_the_setting_to_change(tiny, monkeypatch):
    """Where the decoding step cannot be captured as a CUDA graph on a GPU (planted here), the
    generation stops with one line naming ``rollout.cuda_graphs`` and the way out."""
    import megatron_gspo.rollout.static_decode as sd
    from megatron_gspo.config import ConfigError
    from megatron_gspo.rollout.types import SamplingParams

    def planted(*args):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(sd, "_capture", planted)
    gen = sd.StaticGenerator(tiny[2], pad_id=0, cuda_graphs=True)
    with pytest.raises(ConfigError) as e:
        gen.generate([[1, 5, 9]], 2, SamplingParams(max_new_tokens=4, seed=1))
    assert str(e.value) == (
        "rollout.cuda_graphs=True: capturing the decoding step as a CUDA graph failed (CUDA "
        "error: operation not permitted when stream is capturing); fix: set "
        "rollout.cuda_graphs=false")
    assert gen.graphs == {}
