"""C++ kernels for the CPU path, built at first use.

Adaptation of ``torch.utils.cpp_extension.load`` (a JIT build with the machine's C++ compiler and
ninja, cached under torch's extensions directory, ``TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``; a later process loads the built library in well under a second,
and a changed source is rebuilt). One kernel so far, ``csrc/experts_swiglu.cpp``: a layer's fp32
SwiGLU experts with whole experts per OpenMP thread (``grouped_experts._ExpertsSwiGLU`` uses it).

Where the build fails (no compiler, no ninja, a read-only cache) the caller gets None and the
process logs one line saying so; the pure-PyTorch path then runs, slower but with the same
results. The first build takes about 30 s on 2 cores; ranks that start together wait on torch's
lock in the build directory instead of building twice.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from typing import Optional

log = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _ninja_on_path(env: dict) -> None:
    """torch's build runs ``ninja`` from PATH; the ``ninja`` wheel puts it next to this
    interpreter, which is not on PATH when the virtual environment was not activated."""
    if shutil.which("ninja", path=env.get("PATH")) is None:
        here = os.path.dirname(sys.executable)
        if shutil.which("ninja", path=here):
            env["PATH"] = here + os.pathsep + env.get("PATH", "")


def build(name: str, source: str, build_directory: Optional[str] = None):
    """The extension ``name`` built from ``csrc/<source>`` (OpenMP on), or None with one logged
    line where it cannot be built or loaded."""
    try:
        from torch.utils import cpp_extension

        _ninja_on_path(os.environ)
        if build_directory is not None:
            os.makedirs(build_directory, exist_ok=True)
        return cpp_extension.load(
            name=name, sources=[os.path.join(CSRC, source)],
            extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"],
            build_directory=build_directory, verbose=False)
    except Exception as exc:  # noqa: BLE001 (any build or load failure means: use the fallback)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("CPU kernel %s (megatron_gspo/csrc/%s) not built, using the PyTorch path "
                    "instead: %s", name, source, first[:300])
        return None


@functools.cache
def experts_swiglu():
    """The whole-experts-per-thread SwiGLU kernel of this process (built once), or None."""
    return build("megatron_gspo_experts_swiglu", "experts_swiglu.cpp")
