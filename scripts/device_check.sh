#!/usr/bin/env bash
# One-GPU proof of the cluster path (NCCL, bf16, every collective of an RL step on a one-rank
# world), in about 8 minutes on one NVIDIA GPU with Python 3.12 and torch preinstalled, offline:
#
#   bash scripts/device_check.sh [WHEEL_DIR]      (default: ./wheels)
#
# WHEEL_DIR holds what the GPU image lacks (the versions of docker/requirements.txt), made beforehand
# on a connected machine with ONE command (3.2 MB; no Transformer Engine: the local layer spec runs
# with SDPA attention):
#
#   python3 -m pip download --no-deps --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d wheels \
#     megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
#     math-verify==0.9.0 latex2sympy2_extended==1.11.0 hydra-submitit-launcher==1.2.0 submitit==1.5.4
#
# Steps: the tests marked gpu; the main job on the GPU in bf16 (20 RL steps of the tiny model,
# world size 1 under NCCL); one RL step of a ~1B-parameter MoE with 512-token responses
# (tokens/s and model TFLOP/s of the update phase); scripts/gpu_check.py (forward+backward
# throughput of the same model).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-wheels}
site=${TMPDIR:-/tmp}/megatron-gspo-site
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --upgrade --target "$site" "$wheels"/*
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPU:', torch.cuda.get_device_name())"

step() { echo; echo "== $1 ($(date +%T))"; }

step "tests marked gpu"
python3 -m pytest -q -m gpu tests/gpu

step "main job: tiny MoE, bf16, 20 RL steps, NCCL world of one"
run_dir=$(mktemp -d)
python3 -m megatron_gspo parallel.device=cuda parallel.backend=nccl model.params_dtype=bfloat16 \
  trainer.steps=20 trainer.sft_steps=100 trainer.save_interval=10 logging.progress=false \
  hydra.run.dir="$run_dir"
python3 - "$run_dir" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
steps = [r for r in rows if "train/loss" in r]
assert len(steps) == 20, f"{len(steps)} RL steps logged"
last = steps[-1]
print(f"20 RL steps: reward {steps[0]['rollout/reward_mean']:.3f} -> {last['rollout/reward_mean']:.3f}, "
      f"{last['perf/step_time_s']:.2f} s/step, {last['perf/tokens_per_s']:.0f} trained tokens/s")
PY

step "one RL step of a ~1B MoE, 512-token responses"
python3 scripts/rl_step_1b.py --response 512

step "gpu_check: forward+backward throughput"
python3 scripts/gpu_check.py --steps 5 --warmup 2 --batch 4 --seq 2048
echo; echo "device check passed ($(date +%T))"
