"""The MoE routers' auxiliary losses during training: their coefficients and their logged values.

Megatron's ``TopKRouter`` adds its load-balancing loss (``moe_aux_loss_coeff``) and z-loss
(``moe_z_loss_coeff``) to the gradient through ``MoEAuxLossAutoScaler`` and writes each layer's
unscaled value into a process-wide tracker (``moe_utils.get_moe_layer_wise_logging_tracker``).
This module is the one place that reads and clears that tracker and sets the coefficients, which
the routers read at every forward: the warm-up uses the model's pretraining coefficients, RL the
``algo`` ones (0 switches a loss off).

Reduction (what the tracker holds per rank, and what is logged):
- load balancing: each rank's value is its tokens' part of the micro-batch loss (Megatron sums
  expert counts over the tensor x context-parallel group), so the sum over every rank, divided by
  data-parallel replicas and micro-batches, is the mean per-micro-batch loss of the whole model;
- z-loss: each rank's value is the mean over its own tokens, so the sum is also divided by the
  tensor x context-parallel size.
The logged ``aux_loss`` is the coefficient-weighted sum of both, as it enters the objective.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from megatron_gspo.distributed import comm


_LOAD_BALANCING = "load_balancing_loss"
_Z_LOSS = "z_loss"


def set_coefficients(config, *, aux_loss_coeff: float, z_loss_coeff: float) -> None:
    """Coefficients the routers of the model with TransformerConfig ``config`` use from now on
    (0 switches a loss off; the model must have been built with the aux-loss router type)."""
    config.moe_aux_loss_coeff = float(aux_loss_coeff)
    config.moe_z_loss_coeff = float(z_loss_coeff) if z_loss_coeff > 0 else None


def reset() -> None:
    """Forget the values of earlier forwards (call before a forward-backward that is logged).
    The tracker's entries go, not only their values (megatron's ``clear_aux_losses_tracker``
    zeroes them): an entry is made at the depth of the model that first logs it, and a deeper
    model later in the same process (a sweep's next job) would index past its end."""
    moe_utils.get_moe_layer_wise_logging_tracker().clear()


def collect(config, ctx, num_microbatches: int) -> dict:
    """``aux_loss``, ``load_balancing_loss`` and ``z_loss`` of the forwards since ``reset``, the
    same on every rank (one all-reduce over the world on the run's device), then reset."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()

    def local(name: str) -> torch.Tensor:
        entry = tracker.get(name)
        if entry is None:
            return torch.zeros((), dtype=torch.float64, device=ctx.device)
        return entry["values"].detach().double().sum().to(ctx.device)

    lb, z = comm.reduce_values([local(_LOAD_BALANCING), local(_Z_LOSS)], device=ctx.device)
    lb /= ctx.dp * num_microbatches
    z /= ctx.tp * ctx.cp * ctx.dp * num_microbatches
    reset()
    aux_coeff = float(config.moe_aux_loss_coeff or 0.0)
    z_coeff = float(config.moe_z_loss_coeff or 0.0)
    return {"aux_loss": aux_coeff * lb + z_coeff * z, "load_balancing_loss": lb, "z_loss": z}


def _expert_bias_fix_needed() -> bool:
    return "routing_map & (~padding_mask)" in inspect.getsource(TopKRouter._apply_expert_bias)


def fix_expert_bias_padding() -> bool:
    """megatron-core 0.16.1's ``TopKRouter._apply_expert_bias`` masks the [N, E] routing map with
    the [N] padding mask, which does not broadcast: every forward with aux-loss-free balancing and
    a padding mask raises. The replacement counts the routed experts of the non-padding tokens
    (the documented intent). Idempotent; returns True while the fix is in force, and switches
    itself off once upstream changes that line."""
    if getattr(TopKRouter._apply_expert_bias, "_padding_fixed", False):
        return True
    if not _expert_bias_fix_needed():
        return False

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias._padding_fixed = True
    TopKRouter._apply_expert_bias = _apply_expert_bias
    return True


def _empty_batch_loss_is_nan() -> bool:
    probs = torch.zeros(2, 4)
    loss = moe_utils.switch_load_balancing_loss_func(
        probs=probs, tokens_per_expert=torch.zeros(4), total_num_tokens=torch.zeros(()), topk=2,
        num_experts=4, moe_aux_loss_coeff=1.0, padding_mask=torch.zeros(2, dtype=torch.bool))
    return bool(torch.isnan(loss))


def fix_empty_batch_aux_loss() -> bool:
    """megatron-core 0.16.1's load-balancing loss divides by the number of unmasked tokens: a
    micro-batch whose tokens are all masked out (no response token in it, e.g. every response
    cut and masked by ``rollout.overlong=mask``) gives 0 / 0 = NaN, and the update is skipped as
    non-finite. The loss of no tokens is 0 (no term, no gradient); the replacement divides by at
    least one token. Idempotent; True while in force, off once upstream no longer needs it."""
    from megatron.core.transformer.moe import router

    if getattr(router.switch_load_balancing_loss_func, "_empty_fixed", False):
        return True
    if not _empty_batch_loss_is_nan():
        return False
    original = moe_utils.switch_load_balancing_loss_func

    def switch_load_balancing_loss_func(*args, total_num_tokens, **kwargs):
        if torch.is_tensor(total_num_tokens):
            total_num_tokens = total_num_tokens.clamp_min(1)
        else:
            total_num_tokens = max(total_num_tokens, 1)
        return original(*args, total_num_tokens=total_num_tokens, **kwargs)

    switch_load_balancing_loss_func._empty_fixed = True
    router.switch_load_balancing_loss_func = switch_load_balancing_loss_func
    return True
