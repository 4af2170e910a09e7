"""GSPO / GRPO reinforcement learning for Mixture-of-Experts models on Megatron-core."""

from megatron_gspo.models import te as _te

# megatron-core's import-time warnings about the missing Transformer Engine / apex fallbacks are
# expected where they are missing; the layout line says which layers run instead.
_te.quiet_known_fallbacks()
