"""Transformer Engine facade: the only module that imports transformer_engine.

``HAVE_TE`` says whether it is importable; ``require_te`` raises an actionable error where TE is
mandatory; ``ensure_router_gemm_symbol`` covers megatron-core 0.16's router, which references the
name ``te_general_gemm`` even when Transformer Engine failed to import.
"""

from __future__ import annotations

try:  # pragma: no cover - exercised only where TE is installed (GPU images)
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except Exception:  # ImportError, or a CUDA library missing at import time
    HAVE_TE = False

INSTALL_HINT = "install Transformer Engine with `pip install -e .[gpu]` (needs CUDA)"

# What megatron-core warns at import, once per module, when Transformer Engine or apex is missing
# (six warnings, twelve lines of stderr before anything of ours on every start). Without them
# it takes its local layers and torch's optimizer: expected here, said once in the layout line
# (the backend's ``layers``); any other warning still shows.
KNOWN_FALLBACK_WARNINGS = (r"Transformer Engine and Apex are not installed",
                           r"Apex is not installed\. Falling back to Torch Norm")


def quiet_known_fallbacks() -> None:
    """Ignore exactly the known fallback warnings (``KNOWN_FALLBACK_WARNINGS``)."""
    import warnings

    for message in KNOWN_FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def require_te(what: str) -> None:
    if not HAVE_TE:
        raise ImportError(f"{what} needs transformer_engine, which is not installed: {INSTALL_HINT}")


def use_te_spec(device_type: str) -> bool:
    """TE layers only on GPU and only when TE imports; otherwise Megatron's local spec."""
    return HAVE_TE and device_type == "cuda"


def ensure_router_gemm_symbol() -> bool:
    """Define ``moe_utils.te_general_gemm = None`` when TE is absent.

    megatron-core 0.16.1 imports ``te_general_gemm`` inside a try block and then tests
    ``te_general_gemm is not None`` in ``router_gating_linear``; without TE the name was never bound
    and every router forward raises NameError. With the name bound to None it takes its plain
    matmul path. Returns True when the symbol had to be defined; switches off once upstream binds it.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
