"""The MoE routers' auxiliary losses during RL: the load-balancing loss on response tokens only
(checked against the Switch formula written out here), z-loss, aux-loss-free expert bias, and the
settings' validation."""

import pytest
import torch

from megatron_gspo.config import AlgoConfig, ConfigError, ModelConfig
from tests.distributed import run_ranks
from tests.router_workers import aux_loss_job


def _batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (3, 13), generator=g)
    mask = torch.zeros(3, 12)
    mask[0, 4:] = 1.0
    mask[1, 6:10] = 1.0  # padding after the response
    mask[2, 2:5] = 1.0
    return tokens, mask


def switch_loss(logits_NE, valid_N, top_k):
    """E / (k T^2) * sum_e (sum_t p_te) * (tokens routed to e), over the valid tokens only."""
    x = logits_NE[valid_N].double()
    probs = torch.softmax(x, -1)
    counts = torch.zeros(x.shape[1], dtype=torch.float64)
    counts.index_add_(0, x.topk(top_k, -1).indices.reshape(-1),
                      torch.ones(x.shape[0] * top_k, dtype=torch.float64))
    t = x.shape[0]
    return float(x.shape[1] / (top_k * t * t) * (probs.sum(0) * counts).sum())


CASES = {"aux": (0.01, 0.0, None), "off": (0.0, 0.0, None),
         "z_bias": (0.0, 1e-3, {"router_score_function": "sigmoid", "router_expert_bias": True})}


@pytest.fixture(scope="module")
def losses(tiny_hf_checkpoint):
    tokens, mask = _batch()
    out = run_ranks(aux_loss_job, 1, tiny_hf_checkpoint, tokens, mask, list(CASES.values()))[0]
    return dict(zip(CASES, out))


def test_load_balancing_loss_sees_response_tokens_only(losses):
    out = losses["aux"]
    valid = ~out["padding"]
    assert 0 < int(valid.sum()) < valid.numel()
    expected = sum(switch_loss(lg, valid, top_k=2) for lg in out["logits"])
    assert out["load_balancing_loss"] == pytest.approx(expected, rel=1e-5)
    assert out["aux_loss"] == pytest.approx(0.01 * expected, rel=1e-5)
    everything = sum(switch_loss(lg, torch.ones_like(valid), top_k=2) for lg in out["logits"])
    assert abs(everything - expected) > 1e-4  # the mask matters for this batch


def test_zero_coefficients_add_nothing(losses):
    out = losses["off"]
    assert out["aux_loss"] == 0.0 and out["load_balancing_loss"] == 0.0 and out["z_loss"] == 0.0


def test_z_loss_and_expert_bias(losses):
    out = losses["z_bias"]
    valid = ~out["padding"]
    z = sum(float((torch.logsumexp(lg[valid].double(), -1) ** 2).mean()) for lg in out["logits"])
    assert out["z_loss"] == pytest.approx(z, rel=1e-5)
    assert out["aux_loss"] == pytest.approx(1e-3 * z, rel=1e-5)
    assert out["expert_bias"] and all(b.abs().sum() > 0 for b in out["expert_bias"])


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="model.router_expert_bias=True.*sigmoid"):
        ModelConfig(router_expert_bias=True).validate()
    with pytest.raises(ConfigError, match="algo.aux_loss_coeff=-1"):
        AlgoConfig(aux_loss_coeff=-1).validate()
    with pytest.raises(ConfigError, match="model.router_score_function='relu'"):
        ModelConfig(router_score_function="relu").validate()
    assert AlgoConfig().aux_loss_coeff == 0.0 and AlgoConfig().z_loss_coeff == 0.0


def test_load_balancing_loss_of_no_tokens_is_zero_not_nan():
    """megatron-core 0.16.1 divides by the unmasked tokens (0 / 0 on a micro-batch without a
    response token); the adaptation makes it 0, and switches off where upstream is fine."""
    import torch
    from megatron.core.transformer.moe import router

    from megatron_gspo.models import router_losses

    assert router_losses._empty_batch_loss_is_nan()  # the installed megatron-core needs it
    assert router_losses.fix_empty_batch_aux_loss()
    probs = torch.rand(3, 4, requires_grad=True)
    loss = router.switch_load_balancing_loss_func(
        probs=probs, tokens_per_expert=torch.zeros(4), total_num_tokens=torch.zeros(()),
        topk=2, num_experts=4, moe_aux_loss_coeff=1.0)
    loss.backward()
    assert loss.item() == 0.0 and probs.grad.abs().sum().item() == 0.0
    # with tokens, the value is megatron's own
    tokens = torch.tensor([2.0, 1.0, 2.0, 1.0])
    args = dict(probs=probs.detach(), tokens_per_expert=tokens, total_num_tokens=torch.tensor(3.0),
                topk=2, num_experts=4, moe_aux_loss_coeff=1.0)
    from megatron.core.transformer.moe import moe_utils
    assert router.switch_load_balancing_loss_func(**args) == moe_utils.switch_load_balancing_loss_func(**args)


def test_a_deeper_model_later_in_the_same_process_logs_its_router_losses():
    """A sweep's jobs run one after another in one process (Hydra's basic launcher). megatron
    keeps the routers' losses in a process-wide tracker made at the first model's depth; a
    deeper model trained after it logs every layer's loss, as it does alone."""
    from megatron_gspo.models import router_losses
    from tests.test_host_syncs import tiny_moe_model

    def logged(layers: int) -> float:
        with tiny_moe_model(1, config=dict(num_layers=layers)) as (_, ctx, gpt):
            gpt.train()
            router_losses.set_coefficients(gpt.config, aux_loss_coeff=0.01, z_loss_coeff=0.0)
            tokens = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
            router_losses.reset()
            logits = gpt(tokens, torch.arange(9).expand_as(tokens), attention_mask=None)
            logits.float().logsumexp(-1).mean().backward()
            return router_losses.collect(gpt.config, ctx, 1)["load_balancing_loss"]

    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()  # as in a fresh process
    deeper_alone = logged(4)
    tracker.clear()
    assert logged(2) > 0
    assert logged(4) == pytest.approx(deeper_alone, rel=1e-6)
