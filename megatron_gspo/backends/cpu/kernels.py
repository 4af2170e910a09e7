"""C++ kernels for the CPU path, built at first use.

Adaptation of ``torch.utils.cpp_extension.load`` (a JIT build with the machine's C++ compiler and
ninja, cached under ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, in
``megatron_gspo-py<version>/<name>-<hash of the source and torch's path>``, shared by every copy
of the package; a later process loads the built library in well under a second, and a changed
source builds in a folder of its own). One kernel so far, ``csrc/experts_swiglu.cpp``: a
layer's fp32 SwiGLU experts with whole experts per OpenMP thread (``grouped_experts`` uses it).

Builds of one kernel are serialised by an ``flock`` on a file in its build directory, which the
kernel releases when a process dies: ranks that start together wait for one build, and a build
killed half-way (torch's own lock file left behind, which would make every later load wait for
ever) is cleaned up by the next process. Where the build fails (no compiler, no ninja, a
read-only cache) the caller gets None and the process logs one line saying so; the PyTorch
paths then run, slower, with the same results. The first build takes about 25 s on 2 cores.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
from typing import Optional

from megatron_gspo.config.errors import first_line


log = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _ninja_on_path(env) -> None:
    """torch's build runs ``ninja`` from PATH; the ``ninja`` wheel puts it next to this
    interpreter, which is not on PATH when the virtual environment was not activated."""
    if shutil.which("ninja", path=env.get("PATH")) is None:
        here = os.path.dirname(sys.executable)
        if shutil.which("ninja", path=here):
            env["PATH"] = here + os.pathsep + env.get("PATH", "")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def build_directory(name: str, source: str) -> str:
    """Where ``name`` is built from ``csrc/<source>``: a folder under torch's extensions root
    named by the source's content and torch's installation. torch's build file names the source
    and torch's headers by absolute path, so the build compiles a copy of the source kept in
    that folder: every copy of the package with the same source (checkouts, installed copies)
    shares one build, and none makes another rebuild (25 s) by having run."""
    import torch
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = hashlib.sha1(_read(os.path.join(CSRC, source)))
    key.update(os.path.realpath(os.path.dirname(torch.__file__)).encode())
    return os.path.join(root, f"megatron_gspo-{version}", f"{name}-{key.hexdigest()[:10]}")


def build(name: str, source: str, directory: Optional[str] = None):
    """The extension ``name`` built from ``csrc/<source>`` (OpenMP on) in ``directory`` (default
    ``build_directory(name, source)``), or None with one logged line where it cannot be built or
    loaded."""
    try:
        from torch.utils import cpp_extension

        _ninja_on_path(os.environ)
        directory = directory or build_directory(name, source)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "megatron_gspo.flock"), "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
            stale = os.path.join(directory, "lock")  # torch's, left by a killed build
            if os.path.exists(stale):
                os.remove(stale)
            copy = os.path.join(directory, source)  # the path torch's build file names
            text = _read(os.path.join(CSRC, source))
            if not os.path.exists(copy) or _read(copy) != text:  # (under the lock; rebuilt)
                with open(copy, "wb") as f:
                    f.write(text)
            return cpp_extension.load(
                name=name, sources=[copy],
                extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=directory, verbose=False)
    except Exception as exc:  # noqa: BLE001 (any build or load failure means: use the fallback)
        log.warning("CPU kernel %s (megatron_gspo/csrc/%s) not built, using the PyTorch path "
                    "instead: %s", name, source, first_line(exc)[:300])
        return None


@functools.cache
def experts_swiglu():
    """The whole-experts-per-thread SwiGLU kernel of this process (built once), or None."""
    return build("megatron_gspo_experts_swiglu", "experts_swiglu.cpp")
