"""SGLang itself: the only module that imports ``sglang``."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from typing import Sequence

import torch


try:  # pragma: no cover - sglang is a GPU-only dependency
    import sglang  # noqa: F401

    HAVE_SGLANG = True
except Exception:
    HAVE_SGLANG = False


INSTALL_HINT = "install it with `pip install -e .[rollout]` on a CUDA machine"


# The SGLang release this client is written and checked against (its HTTP API: /generate with
# return_routed_experts, the weight-update endpoints, pause / continue); the GPU image pins it
# (tests/test_image_pins.py).
SGLANG_VERSION = "0.5.15.post1"


def require_sglang(what: str) -> None:
    if not HAVE_SGLANG:
        raise ImportError(f"{what} needs sglang, which is not installed: {INSTALL_HINT}")


def serialize_named_tensors(named_tensors: Sequence[tuple]) -> str:
    """One ``serialized_named_tensors`` entry: CUDA tensors as SGLang's
    ``MultiprocessingSerializer`` makes them (CUDA IPC handles; keep the tensors alive until the
    call returns); host tensors, which only the test stand-in receives since SGLang serves on
    GPUs, as a ``torch.save`` of the same (name, tensor) list. Base64 text either way."""
    named = list(named_tensors)
    if any(t.is_cuda for _, t in named):
        require_sglang("update_weights_from_tensor")
        from sglang.srt.utils import MultiprocessingSerializer  # pragma: no cover

        return base64.b64encode(MultiprocessingSerializer.serialize(named)).decode()
    buf = io.BytesIO()
    torch.save(named, buf)
    return base64.b64encode(buf.getvalue()).decode()


def launch_server(model_path: str, *, port: int, host: str = "127.0.0.1", tp: int = 1,
                  ep: int = 1, routed_experts: bool = True, memory_saver: bool = False,
                  extra: Sequence[str] = ()) -> subprocess.Popen:
    """Start ``python -m sglang.launch_server`` (token ids in and out, no tokenizer)."""
    require_sglang("launching an SGLang server")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host",
           host, "--port", str(port), "--tp-size", str(tp), "--ep-size", str(ep),
           "--skip-tokenizer-init", "--disable-radix-cache"]
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    if memory_saver:
        cmd += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    return subprocess.Popen(cmd + list(extra))
