"""Per-TP-rank shards in SGLang's parameter layout (``load_format: "direct"``): the trainer's
converter (``megatron_gspo.rollout.sglang.layout``) against the stand-in server's description of
where SGLang's weight loaders put each HF tensor (``tests.sglang_standin.hf_slots``)."""

import pytest
import torch



def hf_model(tmp_path, **overrides):
    """(ModelConfig, {HF name: tensor}) of a saved transformers Qwen3-MoE of the tiny shape."""
    import json

    from megatron_gspo.models.hf_config import model_config_from_hf
    from tests.conftest import load_hf_tensors, make_hf_checkpoint

    path = make_hf_checkpoint(str(tmp_path), **overrides)
    with open(f"{path}/config.json") as f:
        cfg = model_config_from_hf(json.load(f))
    g = torch.Generator().manual_seed(3)  # distinct values everywhere, norms included
    return cfg, {k: torch.randn(v.shape, generator=g) for k, v in load_hf_tensors(path).items()}


CASES = [
    ("tp2", {}, 2, 1),
    ("tp1", {}, 1, 1),
    ("tp4_kv_replicated", {}, 4, 1),  # 2 KV heads over 4 ranks: each on 2 consecutive ranks
    ("tp4_ep2", {}, 4, 2),
    ("tp4_ep4", {}, 4, 4),
    ("tp2_vocab_padded", {"vocab_size": 100}, 2, 1),  # padded to 128 rows, 64 per rank
    ("tp2_kv4", {"num_key_value_heads": 4}, 2, 1),  # 2 KV heads per rank
]


@pytest.mark.parametrize("name,overrides,tp,ep", CASES, ids=[c[0] for c in CASES])
def test_rank_shards_match_sglang_loaders(name, overrides, tp, ep, tmp_path):
    from megatron_gspo.rollout.sglang.layout import ServerLayout
    from tests.sglang_standin import from_ranks, sglang_param_shapes, to_ranks

    cfg, hf = hf_model(tmp_path, **overrides)
    layout = ServerLayout(cfg, tp=tp, ep=ep)
    expected = to_ranks(hf, cfg, tp, ep)  # as SGLang's loaders fill the ranks from HF tensors
    shapes = sglang_param_shapes(cfg, tp, ep)
    rank_bytes = []
    for rank in range(tp):
        shards = layout.rank_shards(hf, rank)
        names = [n for n, _ in shards]
        assert sorted(names) == sorted(shapes)  # every parameter of the rank, once
        for param, t in shards:
            assert tuple(t.shape) == shapes[param], param
            assert torch.equal(t, expected[rank][param]), (rank, param)
            assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * 4, param
        rank_bytes.append(sum(t.numel() * 4 for _, t in shards))
    # And back: the ranks' shards hold exactly the HF model.
    back = from_ranks([dict(layout.rank_shards(hf, r)) for r in range(tp)], hf, cfg, tp, ep)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
    if tp > 1:  # a rank holds its share, not the model
        assert max(rank_bytes) < 0.75 * sum(v.numel() * 4 for v in hf.values())


def test_padding_rows_are_zero(tmp_path):
    from megatron_gspo.rollout.sglang.layout import ServerLayout

    cfg, hf = hf_model(tmp_path, vocab_size=100)
    last = dict(ServerLayout(cfg, tp=2).rank_shards(hf, 1))
    assert last["model.embed_tokens.weight"].shape == (64, 64)
    assert torch.equal(last["lm_head.weight"][:36], hf["lm_head.weight"][64:])
    assert not last["lm_head.weight"][36:].any()


def test_a_parameter_split_over_buckets_is_refused(tmp_path):
    from megatron_gspo.rollout.sglang.layout import ServerLayout, param_of

    cfg, hf = hf_model(tmp_path)
    assert param_of("model.layers.2.self_attn.v_proj.weight") == \
        "model.layers.2.self_attn.qkv_proj.weight"
    assert param_of("model.layers.1.mlp.experts.3.up_proj.weight") == \
        "model.layers.1.mlp.experts.w13_weight"
    assert param_of("model.layers.1.mlp.experts.3.down_proj.weight") == \
        "model.layers.1.mlp.experts.w2_weight"
    assert param_of("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    part = {k: v for k, v in hf.items() if k != "model.layers.2.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match=r"qkv_proj.*v_proj.weight is not in the same bucket"):
        ServerLayout(cfg, tp=2).rank_shards(part, 0)


@pytest.mark.parametrize("tp,ep,why", [(3, 1, "attention heads"), (4, 3, "multiple of ep"),
                                       (4, 1, "KV heads"), (2, 8, "multiple of ep")])
def test_layouts_that_do_not_split_are_refused(tp, ep, why):
    from megatron_gspo.models.hf_config import model_config_from_hf
    from megatron_gspo.rollout.sglang.layout import ServerLayout
    from tests.conftest import TINY_HF_CONFIG

    heads, kv = (12, 3) if why == "KV heads" else (8, 2)  # 3 KV heads over 4 ranks
    cfg = model_config_from_hf({**TINY_HF_CONFIG, "model_type": "qwen3_moe",
                                "num_attention_heads": heads, "num_key_value_heads": kv})
    with pytest.raises(ValueError, match=why):
        ServerLayout(cfg, tp=tp, ep=ep)
