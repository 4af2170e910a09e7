"""GSPO / GRPO reinforcement learning for Mixture-of-Experts models on Megatron-core."""

from megatron_gspo.models import te as _te

# The oldest torch the project runs on (setup.py requires it; ``python -m megatron_gspo`` says so
# in one line otherwise): 2.10 is the first release with ``torch.nn.functional.grouped_mm``, which
# the experts call, and the oldest on which the tests have passed.
TORCH_MIN = "2.10"

# megatron-core's import-time warnings about the missing Transformer Engine / apex fallbacks are
# expected where they are missing; the layout line says which layers run instead.
_te.quiet_known_fallbacks()
