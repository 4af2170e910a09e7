#!/usr/bin/env bash
# Submit a multi-node training job to SLURM (launch/train.sbatch), or print what would run.
#
#   launch/submit.sh [options] [--] [hydra overrides...]
#
# Options:
#   --nodes N             nodes in total, trainer and SGLang servers (default 1)
#   --gpus-per-node G     GPUs per node (= trainer ranks per training node; default 8)
#   --cpus-per-task C     CPU cores per node's task (default 8 per GPU)
#   --partition P         SLURM partition (required unless --dry-run)
#   --account A           SLURM account
#   --time HH:MM:SS       time limit (default 04:00:00)
#   --signal-s S          SIGUSR2 this many seconds before the limit (default 900; at least two
#                         RL steps: the trainer checkpoints at the next step boundary)
#   --container-image I   run inside a pyxis/enroot container (sqsh file or registry path)
#   --container-mounts M  pyxis mounts (src:dst[,src:dst...])
#   --model-path PATH     the Hugging Face checkpoint to train: the trainer starts from it
#                         (trainer.init_from) with its tokenizer (data.tokenizer), and the SGLang
#                         servers serve it (rollout.sglang_model_path)
#   --sglang MODE         none (default: the trainer's in-process engine) | separate (SGLang
#                         servers on their own nodes, one server per node). colocated (servers
#                         sharing the trainer's GPUs) is not supported: docs/guides/cluster.md
#   --sglang-nodes K      nodes for the SGLang servers with --sglang separate (the last K nodes)
#   --sglang-tp T         tensor parallel size of each server (default: GPUs per node)
#   --sglang-ep E         expert parallel size of each server (default 1; divides T)
#   --gpu-memory-gb M     memory of one GPU, for the plan's fit check (default 80)
#   --run-dir DIR         run directory, fixed across requeues so that the job resumes
#                         (default runs/slurm/<timestamp>)
#   --smoke               instead of training: run docker/smoke.sh in the container on one node
#                         (one GPU; needs --container-image)
#   --dry-run             print the plan, the sbatch command and every command the job would run
#
# Environment: PYTHON, the python that checks the plan here (default: the active environment's,
# else the checkout's .venv).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
NODES=1 GPUS=8 CPUS="" PARTITION="" ACCOUNT="" TIME="04:00:00" SIGNAL_S=900 GPU_MEMORY_GB=80
IMAGE="" MOUNTS="" SGLANG="none" SGLANG_NODES=0 SGLANG_TP="" SGLANG_EP=1 MODEL_PATH="" RUN_DIR="" DRY_RUN=""
SMOKE=""

die() { echo "submit.sh: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) NODES="$2"; shift 2 ;;
    --gpus-per-node) GPUS="$2"; shift 2 ;;
    --cpus-per-task) CPUS="$2"; shift 2 ;;
    --partition) PARTITION="$2"; shift 2 ;;
    --account) ACCOUNT="$2"; shift 2 ;;
    --time) TIME="$2"; shift 2 ;;
    --signal-s) SIGNAL_S="$2"; shift 2 ;;
    --container-image) IMAGE="$2"; shift 2 ;;
    --container-mounts) MOUNTS="$2"; shift 2 ;;
    --sglang) SGLANG="$2"; shift 2 ;;
    --sglang-nodes) SGLANG_NODES="$2"; shift 2 ;;
    --sglang-tp) SGLANG_TP="$2"; shift 2 ;;
    --sglang-ep) SGLANG_EP="$2"; shift 2 ;;
    --model-path) MODEL_PATH="$2"; shift 2 ;;
    --gpu-memory-gb) GPU_MEMORY_GB="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --smoke) SMOKE=1; shift ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see the header of launch/submit.sh)" ;;
    *) break ;;
  esac
done

[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "--nodes $NODES: need a positive integer"
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || die "--gpus-per-node $GPUS: need a positive integer (a GPU job)"
CPUS="${CPUS:-$((8 * GPUS))}"
[[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "--cpus-per-task $CPUS: need a positive integer"
case "$SGLANG" in
  none) SGLANG_NODES=0 ;;
  separate) [[ "$SGLANG_NODES" -ge 1 && "$SGLANG_NODES" -lt "$NODES" ]] \
      || die "--sglang separate needs 1 <= --sglang-nodes < --nodes" ;;
  colocated) die "--sglang colocated is not supported: servers sharing the trainer's GPUs would \
keep their memory during training, and the weight sync would put trainer rank 0 and a server \
rank on one GPU in one NCCL group; use --sglang separate --sglang-nodes K" ;;
  *) die "--sglang $SGLANG: use none or separate" ;;
esac
if [[ "$SGLANG" != none && -z "$MODEL_PATH" ]]; then
  die "--sglang $SGLANG needs --model-path (the checkpoint the servers and the trainer start from)"
fi
if [[ -z "$DRY_RUN" && -z "$PARTITION" ]]; then die "--partition is required"; fi
RUN_DIR="${RUN_DIR:-runs/slurm/$(date +%Y-%m-%d_%H-%M-%S)}"
LOG_DIR="$RUN_DIR/logs"

if [[ -n "$SMOKE" ]]; then  # the image's smoke test as a one-node, one-GPU job
  [[ -n "$IMAGE" ]] || die "--smoke needs --container-image (the image to check)"
  STEP=(srun --ntasks=1 --container-image="$IMAGE" --container-workdir=/workspace/megatron-gspo)
  [[ -n "$MOUNTS" ]] && STEP+=(--container-mounts="$MOUNTS")
  STEP+=(bash docker/smoke.sh)
  SMOKE_JOB=(sbatch --nodes=1 --ntasks-per-node=1 --gpus-per-node=1 --cpus-per-task=8
             --mem=64G --time=00:20:00 --job-name=megatron-gspo-smoke
             --output="$LOG_DIR/smoke_%j.out")
  [[ -n "$PARTITION" ]] && SMOKE_JOB+=(--partition="$PARTITION")
  [[ -n "$ACCOUNT" ]] && SMOKE_JOB+=(--account="$ACCOUNT")
  SMOKE_JOB+=(--wrap "$(printf '%q ' "${STEP[@]}")")
  if [[ -n "$DRY_RUN" ]]; then printf '+'; printf ' %q' "${SMOKE_JOB[@]}"; printf '\n'; exit 0; fi
  mkdir -p "$LOG_DIR"
  exec "${SMOKE_JOB[@]}"
fi

TRAIN_NODES=$((NODES - SGLANG_NODES))
export MG_GPUS_PER_NODE="$GPUS" MG_CPUS_PER_TASK="$CPUS" MG_TRAIN_NODES="$TRAIN_NODES"
export MG_SGLANG="$SGLANG" MG_SGLANG_NODES="$SGLANG_NODES" MG_SGLANG_TP="${SGLANG_TP:-$GPUS}"
export MG_SGLANG_EP="$SGLANG_EP" MG_MODEL_PATH="$MODEL_PATH"
export MG_CONTAINER_IMAGE="$IMAGE" MG_CONTAINER_MOUNTS="$MOUNTS" MG_RUN_DIR="$RUN_DIR"
export MG_LOG_DIR="$LOG_DIR" MG_DRY_RUN="$DRY_RUN"

# A GPU job asks for the GPUs, the cores and the memory of its nodes: without them SLURM hands
# the ranks no GPU where it enforces GPU allocation, and torchrun's ranks share one core.
SBATCH=(sbatch --nodes="$NODES" --ntasks-per-node=1 --gpus-per-node="$GPUS"
        --cpus-per-task="$CPUS" --exclusive --mem=0 --time="$TIME"
        --signal="B:USR2@$SIGNAL_S" --requeue
        --job-name=megatron-gspo --output="$LOG_DIR/sbatch_%j.out" --export=ALL)
[[ -n "$PARTITION" ]] && SBATCH+=(--partition="$PARTITION")
[[ -n "$ACCOUNT" ]] && SBATCH+=(--account="$ACCOUNT")
SBATCH+=("$HERE/train.sbatch" "$@")

# What the job will do, checked before anything is queued: the layout for the world size, the
# memory per GPU, the timeouts (server URLs are only known inside the job: a placeholder
# stands for them here).
PLAN=(--nodes "$NODES" --gpus-per-node "$GPUS" --sglang-nodes "$SGLANG_NODES"
      --gpu-memory-gb "$GPU_MEMORY_GB")
[[ -n "$MODEL_PATH" ]] && PLAN+=(--model-path "$MODEL_PATH")
[[ "$SGLANG" == none ]] || PLAN+=(--sglang-tp "${SGLANG_TP:-$GPUS}" --sglang-ep "$SGLANG_EP")
# The plan runs here, on the login node: $PYTHON, else the active environment's python, else
# the checkout's .venv (make install), whichever has the project's packages.
usable() {  # (found, not imported: importing torch takes seconds)
  "$1" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('torch', 'hydra', 'megatron.core')))" >/dev/null 2>&1
}
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
  if [[ "$PY" == */* && "$PY" != /* ]]; then PY="$PWD/$PY"; fi  # (the plan runs from the checkout)
  usable "$PY" || die "PYTHON=$PYTHON cannot import the project's packages (torch, hydra," \
    "megatron-core); fix: name the python of their environment"
else
  PY=""
  for candidate in python "$HERE/../.venv/bin/python"; do
    if usable "$candidate"; then PY="$candidate"; break; fi
  done
  [[ -n "$PY" ]] || die "no python with the project's packages (torch, hydra, megatron-core) to" \
    "check the plan: activate their environment (make install makes .venv) or set PYTHON=..."
fi
(cd "$HERE/.." && "$PY" -m tools.plan_layout "${PLAN[@]}" -- "$@") \
  || die "the job does not fit or does not validate (the line above says why)"

if [[ -n "$DRY_RUN" ]]; then
  printf '+'; printf ' %q' "${SBATCH[@]}"; printf '\n'
  # What the batch script would run on the head node of a job on nodes node001..nodeN.
  SLURM_JOB_ID="${SLURM_JOB_ID:-12345}" SLURM_JOB_NODELIST="${SLURM_JOB_NODELIST:-node[001-$(printf '%03d' "$NODES")]}" \
    SLURM_NNODES="$NODES" bash "$HERE/train.sbatch" "$@"
  exit 0
fi
mkdir -p "$LOG_DIR"
"${SBATCH[@]}"
