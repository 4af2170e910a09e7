#!/usr/bin/env bash
# One-GPU proof of the cluster path (NCCL, bf16, every collective of an RL step on a one-rank
# world) and one GPU's figures against transformers, on one NVIDIA GPU with Python 3.12 and
# torch preinstalled, offline:
#
#   bash scripts/device_check.sh [WHEEL_DIR]      (default: ./wheels)
#   DEVICE_CHECK_STEPS="main job,recipe path" bash scripts/device_check.sh WHEEL_DIR   (a subset)
#
# The steps' own limits add up to about 27 minutes. Where one command may run 10 minutes at
# most, run named steps with DEVICE_CHECK_STEPS (the names of the "== NAME" lines, comma
# separated), most telling first. With 15 minutes of a lent GPU, its start included:
#   1. "perf probe,gpu tests" (570 s of limits): the one-GPU figures against transformers and
#      the GPU-only paths (no host syncs, CUDA graphs, compiled experts);
#   2. at once, on the machine still warm: "main job,grouped experts" (330 s);
#   3. in a later lease: "recipe path,variants" (440 s), then "rl step 1b,gpu check" (270 s).
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
# Steps, in this order:
# - "perf probe": scripts/perf_probe.py, the 1B MoE's update MFU and rollout tokens/s against
#   transformers on the same weights, the compiled experts too (within a budget of 320 s: a path
#   running then is stopped and the later ones skipped, every section and the summary printed);
# - "main job": 20 RL steps of the tiny model in bf16, world size 1 under NCCL;
# - "recipe path": the cluster recipe's trainer path (torchrun, parallel.device=cuda, a HF
#   checkpoint, full activation recompute, dp_reshardable checkpoints and a resume);
# - "grouped experts": the grouped-GEMM experts against Megatron's SequentialMLP in bf16;
# - "variants": 3 RL steps each of GRPO+R2, GRPO+R3 with token TIS, GSPO-token with dynamic
#   sampling and masked overlong responses, GSPO with seq MIS and the HF export at the end;
# - "rl step 1b": one RL step of a ~1B-parameter MoE with 512-token responses (tokens/s and
#   model TFLOP/s of the update phase);
# - "gpu check": scripts/gpu_check.py (forward+backward throughput of the same model);
# - "gpu tests": the tests marked gpu.
# Each step's output also goes to DEVICE_CHECK_LOG_DIR/STEP.log when it is set.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
wheels=${1:-wheels}
log_dir=${DEVICE_CHECK_LOG_DIR:-}   # optional: each step's output is also written there
site=${TMPDIR:-/tmp}/megatron-gspo-site
if [ -d "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --upgrade --target "$site" "$wheels"/* || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__)" || exit 1
python3 -W ignore -c "import megatron.core, hydra, omegaconf, math_verify" \
  || { echo "device check: a package is missing: put the wheels of this script's header in $wheels"; exit 1; }
python3 -c "import importlib.metadata as m, importlib.util as u; print('megatron-core', m.version('megatron-core'), '| transformers', m.version('transformers') if u.find_spec('transformers') else 'none (the probe measures ours only)')"

# Every step runs (a failure does not hide what the later steps would show), each under its own
# time limit; the script fails at the end if any step did. A limit kills the step's every
# process at once (SIGKILL to its process group): the trainer takes SIGTERM as "stop after this
# step, save" and would run on past it, beside the next step on the same GPU.
failed=()
ran=0
only=${DEVICE_CHECK_STEPS:-}   # optional: the names of the steps to run, comma separated
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then return; fi
  ran=$((ran + 1))
  echo; echo "== $name ($(date +%T), limit ${limit}s)"
  local t0=$SECONDS rc
  if [ -n "$log_dir" ]; then
    timeout -s KILL "$limit" bash -c '"$@"' step "$@" 2>&1 | tee "$log_dir/${name// /_}.log"
    rc=${PIPESTATUS[0]}
  else
    timeout -s KILL "$limit" bash -c '"$@"' step "$@"; rc=$?
  fi
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

main_job() {
  local run_dir; run_dir=$(mktemp -d)
  python3 -m megatron_gspo parallel.device=cuda parallel.backend=nccl model.params_dtype=bfloat16 \
    trainer.steps=20 trainer.sft_steps=100 trainer.save_interval=10 logging.progress=false \
    hydra.run.dir="$run_dir" || return
  python3 - "$run_dir" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
steps = [r for r in rows if "train/loss" in r]
assert len(steps) == 20, f"{len(steps)} RL steps logged"
last = steps[-1]
print(f"20 RL steps: reward {steps[0]['rollout/reward_mean']:.3f} -> {last['rollout/reward_mean']:.3f}, "
      f"{last['perf/step_time_s']:.2f} s/step, {last['perf/tokens_per_s']:.0f} trained tokens/s")
PY
}
export -f main_job

variants() {  # 3 RL steps of each algorithm / replay / batch option on the GPU, then the HF export
  local v run_dir
  for v in "+arm=grpo_r2" "+arm=grpo_r3 algo.rollout_correction=token_tis" \
           "algo=gspo_token rollout.dynamic_sampling=true rollout.overlong=mask" \
           "algo=gspo algo.rollout_correction=seq_mis trainer.export_hf_at_end=true"; do
    run_dir=$(mktemp -d)
    echo "-- $v"
    # shellcheck disable=SC2086  # $v holds several overrides
    python3 -m megatron_gspo parallel.device=cuda parallel.backend=nccl \
      model.params_dtype=bfloat16 trainer.steps=3 trainer.sft_steps=20 data.eval_size=32 \
      logging.progress=false hydra.run.dir="$run_dir" $v 2>&1 | grep -v -i warn | tail -4 || return
    [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  done
  [ -f "$run_dir/hf/config.json" ] && [ -f "$run_dir/hf/model.safetensors.index.json" ] \
    && echo "HF export written to $run_dir/hf"
}
export -f variants

recipe_path() {  # the cluster recipe's trainer path on one GPU: torchrun, parallel.device=cuda,
  # a HF checkpoint to start from, full activation recompute, dp_reshardable checkpoints, resume
  local src run_dir; src=$(mktemp -d); run_dir=$(mktemp -d)
  python3 -m megatron_gspo parallel.device=cuda model.params_dtype=bfloat16 trainer.steps=1 \
    trainer.sft_steps=20 trainer.export_hf_at_end=true logging.progress=false \
    hydra.run.dir="$src" > /dev/null || return
  local job=(parallel.device=cuda model.params_dtype=bfloat16 model.activation_recompute=full
             trainer.init_from="$src/hf" trainer.sft_steps=0 trainer.save_interval=2
             logging.progress=false hydra.run.dir="$run_dir")
  # (torchrun as the module of the python3 that holds torch: its script need not be on PATH)
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m megatron_gspo "${job[@]}" \
    trainer.steps=2 || return
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m megatron_gspo "${job[@]}" \
    trainer.steps=4 \
    > "$run_dir/resume.log" 2>&1 || { tail -20 "$run_dir/resume.log"; return 1; }
  grep "resumed from" "$run_dir/resume.log" | grep -q "step_000002" || return
  python3 - "$run_dir" <<'PY'
import json, sys
state = json.load(open(sys.argv[1] + "/checkpoints/step_000004/trainer_state.json"))
assert state["optimizer_format"] == "dp_reshardable", state["optimizer_format"]
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
print("recipe path: steps", [r["step"] for r in rows if "train/loss" in r],
      "from a HF checkpoint, recompute full, dp_reshardable checkpoints, resumed at step 2")
PY
}
export -f recipe_path

# (the probe stops itself at its budget, its sections and summary printed, before the limit)
step "perf probe" 360 python3 scripts/perf_probe.py --compile-experts --budget-s 320
step "main job" 240 main_job   # tiny MoE, bf16, 20 RL steps, NCCL world of one
step "recipe path" 240 recipe_path   # the cluster recipe's trainer settings, resumed once
step "grouped experts" 90 python3 -c "
from tests.distributed import run_ranks
from tests.grouped_workers import experts_equal_job
r = run_ranks(experts_equal_job, 1, 1, 1, 0, 'bfloat16')[0]
print('grouped vs sequential experts, bf16 on the GPU (max diff / max value):', r)
assert r['paths'] == ['grouped'] and max(r['out'], r['dx'], r['dw']) < 2e-2, r"
step "variants" 200 variants
step "rl step 1b" 150 python3 scripts/rl_step_1b.py --response 512   # ~1B MoE, 512-token responses
step "gpu check" 120 python3 scripts/gpu_check.py --steps 5 --warmup 2 --batch 4 --seq 2048
step "gpu tests" 210 python3 -m pytest -q -m gpu tests/gpu

echo
if [ -n "$only" ] && [ "$ran" -eq 0 ]; then echo "device check: no step named in DEVICE_CHECK_STEPS=$only"; exit 2; fi
if [ ${#failed[@]} -eq 0 ]; then echo "device check passed ($(date +%T))"; else
  echo "device check FAILED: ${failed[*]} ($(date +%T))"; exit 1; fi
