"""HF checkpoint reading: config mapping, malformed checkpoints name the tensor, sharded files."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_gspo.models.hf_io import HFCheckpoint, write_hf_checkpoint
from megatron_gspo.models.hf_config import (HFCheckpointError, hf_config_from_model,
                                            model_config_from_hf)
from tests.distributed import run_ranks
from tests.model_workers import malformed_hf_job


def _copy(src, dst, mutate):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(tiny_hf_checkpoint, tmp_path):
    bad = _copy(tiny_hf_checkpoint, tmp_path / "bad",
                lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    message = run_ranks(malformed_hf_job, 1, str(bad))[0]
    assert message is not None and "missing tensor 'model.layers.2.mlp.experts.3.up_proj.weight'" \
        in message


def test_wrong_shape_is_named(tiny_hf_checkpoint, tmp_path):
    def shrink(t):
        t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    bad = _copy(tiny_hf_checkpoint, tmp_path / "bad", shrink)
    message = run_ranks(malformed_hf_job, 1, str(bad))[0]
    assert "'model.layers.1.self_attn.k_proj.weight' has shape (16, 64), expected (32, 64)" in message


def test_config_and_directory_errors(tmp_path):
    with pytest.raises(HFCheckpointError, match="no config.json"):
        HFCheckpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match="not valid JSON"):
        HFCheckpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HFCheckpointError, match="no .safetensors"):
        HFCheckpoint(str(tmp_path))
    with pytest.raises(HFCheckpointError, match="missing key 'num_hidden_layers'"):
        model_config_from_hf({})


def test_config_mapping_round_trips(tiny_hf_checkpoint):
    with open(os.path.join(tiny_hf_checkpoint, "config.json")) as f:
        hf = json.load(f)
    m = model_config_from_hf(hf)
    assert (m.num_layers, m.num_experts, m.top_k, m.first_k_dense) == (4, 4, 2, 1)
    assert (m.num_query_groups, m.head_dim, m.ffn_hidden_size, m.moe_ffn_hidden_size) == (2, 16, 96, 32)
    assert m.norm_topk_prob and m.rope_theta == 10000.0
    assert model_config_from_hf(hf_config_from_model(m)) == m


def test_published_qwen3_30b_a3b_config_maps_to_conf_model():
    import yaml

    published = {  # Qwen/Qwen3-30B-A3B config.json (architecture fields)
        "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "head_dim": 128,
        "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False, "vocab_size": 151936}
    ours = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "conf", "model",
                                            "qwen3_30b_a3b.yaml")))
    mapped = model_config_from_hf(published, name="qwen3_30b_a3b")
    for key, value in ours.items():
        if key not in ("params_dtype", "init_method_std"):
            assert getattr(mapped, key) == value, key


def test_sharded_write_and_read(tmp_path):
    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(5)}
    write_hf_checkpoint(tensors, {"model_type": "qwen3_moe"}, str(tmp_path), max_shard_bytes=2048)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    ckpt = HFCheckpoint(str(tmp_path))
    for name, t in tensors.items():
        assert torch.equal(ckpt.get(name, (256,)), t)
