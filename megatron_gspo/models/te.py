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
# (``describe``); any other warning still shows.
KNOWN_FALLBACK_WARNINGS = (r"Transformer Engine and Apex are not installed",
                           r"Apex is not installed\. Falling back to Torch Norm")


def quiet_known_fallbacks() -> None:
    """Ignore exactly the known fallback warnings (``KNOWN_FALLBACK_WARNINGS``)."""
    import warnings

    for message in KNOWN_FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
