"""The device's backend: what the project adapts to the hardware it runs on, chosen in one place
(``backend_for``) by the device type. The model is built from the backend's layer classes, the
process adapts megatron-core once (``activate``), Megatron's RNG streams are seeded its way, and
the in-process engine decodes through its direct decoding step when it has one.

- ``cpu``: megatron-core's CUDA assumptions adapted (``backends.cpu.megatron``), torch's OpenMP
  threads pinned, RMSNorm / attention / experts with their CPU paths written out, the C++ experts
  kernel, a direct decoding step, the all-gather token dispatcher (gloo);
- ``gpu``: megatron-core as it is, the project's generic layers (Transformer Engine's when it
  imports: ``models.te``), the all-to-all dispatcher.
"""

from __future__ import annotations

import torch

from megatron_gspo.backends.backend import Backend


def backend_for(device) -> Backend:
    """The backend of ``device`` (a ``torch.device`` or its type name)."""
    # Imported for the device the run uses: each backend imports the layers it subclasses, and
    # the CPU backend megatron-core's modules it adapts.
    if torch.device(device).type == "cpu":
        from megatron_gspo.backends.cpu import CPU

        return CPU
    from megatron_gspo.backends.gpu import GPU

    return GPU
