"""GPU tier: the same model code on CUDA (skipped on machines without a GPU)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_script_runs():
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--steps", "2", "--warmup", "1",
                          "--batch", "2", "--seq", "512"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tokens/s" in out.stdout
