"""The GPU image's pins fit what the project runs: Transformer Engine inside megatron-core's
declared range and setup.py's gpu extra, the same megatron-core as the tests, the SGLang version
the client targets, setup.py's torch floor the package's; and a planted wrong pin of each kind is
caught; the base image's pip constraints kept for its GPU stack only."""

import importlib.metadata
import os
import re
import subprocess

import pytest

from megatron_gspo import TORCH_MIN
from megatron_gspo.rollout.sglang.facade import SGLANG_VERSION
from tools.check_image_pins import ROOT, check_repository, problems, requirement_pins


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _check(dockerfile=None, requirements=None, setup_text=None):
    return problems(dockerfile or _read("Dockerfile"),
                    requirements or _read("docker", "requirements.txt"),
                    setup_text or _read("setup.py"),
                    megatron_requires=importlib.metadata.requires("megatron-core"),
                    megatron_installed=importlib.metadata.version("megatron-core"),
                    sglang_client=SGLANG_VERSION, torch_min=TORCH_MIN)


def test_the_repository_pins_fit():
    found, args = check_repository()
    assert found == [], found
    assert args["SGLANG_VERSION"] == SGLANG_VERSION


def test_a_planted_old_transformer_engine_pin_is_caught():
    planted = re.sub(r"ARG TE_VERSION=\S+", "ARG TE_VERSION=2.4.0", _read("Dockerfile"))
    found = _check(dockerfile=planted)
    assert len(found) == 2 and all("TE_VERSION=2.4.0 is outside" in line for line in found), found
    assert "megatron-core" in found[0] and "setup.py's gpu extra" in found[1], found


def test_a_requirement_the_image_does_not_pin_is_caught():
    requirements = _read("docker", "requirements.txt")
    planted = re.sub(r"^transformers==\S+\n", "", requirements, flags=re.M)
    assert planted != requirements
    assert _check(requirements=planted) == [
        "docker/requirements.txt: no pin of transformers (setup.py requires transformers>=4.51)"]
    planted = re.sub(r"^pyarrow==\S+", "pyarrow==12.0.0", requirements, flags=re.M)
    assert _check(requirements=planted) == [
        "docker/requirements.txt: pyarrow==12.0.0 is outside setup.py's pyarrow>=14"]


def test_a_planted_torch_floor_below_the_packages_is_caught():
    planted = re.sub(r'"torch>=[^"]*"', '"torch>=2.4"', _read("setup.py"))
    assert planted != _read("setup.py")
    assert _check(setup_text=planted) == [
        f"setup.py: torch>=2.4, but megatron_gspo.TORCH_MIN is {TORCH_MIN}"]


@pytest.mark.parametrize("what", ["megatron", "sglang"])
def test_planted_megatron_and_sglang_mismatches_are_caught(what):
    if what == "megatron":
        planted = re.sub(r"megatron-core==\S+", "megatron-core==0.15.0",
                         _read("docker", "requirements.txt"))
        found = _check(requirements=planted)
        assert any("megatron-core==0.15.0" in line for line in found), found
    else:
        planted = re.sub(r"ARG SGLANG_VERSION=\S+", "ARG SGLANG_VERSION=0.5.6", _read("Dockerfile"))
        found = _check(dockerfile=planted)
        assert found == [f"Dockerfile: SGLANG_VERSION=0.5.6, but the client targets SGLang "
                         f"{SGLANG_VERSION} (megatron_gspo/rollout/sglang/facade.py SGLANG_VERSION)"]


def _gpu_stack(constraints):
    out = subprocess.run(["bash", os.path.join(ROOT, "docker", "constraints.sh"), str(constraints)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _written(tmp_path, lines):
    path = tmp_path / "constraint.txt"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_the_base_images_constraints_hold_for_its_gpu_stack_only(tmp_path):
    stack = ["torch==2.10.0a0+b4e4ee81d3.nv25.11", "numpy==1.26.4", "transformer_engine==2.9.0",
             "nvidia-cudnn-cu13==9.15.0.57", "torchvision==0.25.0a0", "pytorch-triton==3.5.0",
             "Flash_Attn==2.7.4.post1", "apex==0.1", "torch-tensorrt==2.10.0a0"]
    others = ["tensorboard==2.18.0", "tensorboard-data-server==0.7.2", "click==8.1.7",
              "huggingface_hub==0.30.1", "regex==2024.11.6", "# a comment", "numpyro==0.1"]
    assert _gpu_stack(_written(tmp_path, others[:3] + stack + others[3:])) == stack
    # no package the image pins is held at the base image's version
    ours = [f"{name}==0.0.1" for name in requirement_pins(_read("docker", "requirements.txt"))]
    assert len(ours) >= 10 and _gpu_stack(_written(tmp_path, ours)) == []
    assert _gpu_stack(tmp_path / "none.txt") == []  # no constraint file
    dockerfile = _read("Dockerfile")
    assert ("bash docker/constraints.sh > /tmp/gpu-stack.txt" in dockerfile
            and "PIP_CONSTRAINT=/tmp/gpu-stack.txt pip install --no-cache-dir --requirement "
            "docker/requirements.txt" in dockerfile)
