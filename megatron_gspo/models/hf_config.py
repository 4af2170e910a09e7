"""Qwen3-MoE ``config.json`` <-> ``ModelConfig``."""

from __future__ import annotations

from megatron_gspo.config import ModelConfig


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be used; the message names the file or tensor."""


def model_config_from_hf(hf: dict, name: str = "hf") -> ModelConfig:
    """ModelConfig from a Qwen3-MoE ``config.json`` dict."""
    def need(key, *alts):
        for k in (key, *alts):
            if k in hf:
                return hf[k]
        raise HFCheckpointError(f"config.json: missing key {key!r}")

    num_layers = need("num_hidden_layers")
    num_experts = need("num_experts", "num_local_experts")
    mlp_only = sorted(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    pattern = [0 if (i in mlp_only or num_experts == 0 or (i + 1) % step) else 1
               for i in range(num_layers)]
    first_dense = pattern.index(1) if 1 in pattern else num_layers
    if pattern != [0] * first_dense + [1] * (num_layers - first_dense):
        raise HFCheckpointError(f"config.json: MoE layer pattern {pattern} is not 'k dense layers, "
                                "then MoE'; only leading dense layers are supported")
    rope = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    heads = need("num_attention_heads")
    return ModelConfig(
        name=name,
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or need("hidden_size") // heads,
        ffn_hidden_size=need("intermediate_size"),
        moe_ffn_hidden_size=hf.get("moe_intermediate_size", 0),
        num_experts=num_experts,
        top_k=hf.get("num_experts_per_tok", 1),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
        first_k_dense=first_dense if num_experts else 0,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        params_dtype="float32",
    ).validate()


def hf_config_from_model(m: ModelConfig) -> dict:
    """A Qwen3-MoE ``config.json`` dict describing ``m``."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim,
        "intermediate_size": m.ffn_hidden_size,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.norm_topk_prob,
        "router_aux_loss_coef": m.aux_loss_coeff,
        "mlp_only_layers": list(range(m.first_k_dense)),
        "decoder_sparse_step": 1,
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta,
        "max_position_embeddings": m.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": m.params_dtype,
    }
