#!/usr/bin/env bash
# One node of a training job (an srun task of launch/train.sbatch): torchrun with the rendezvous
# at the head node. Exits 0 when the trainer stopped for a requeue (its REQUEUE marker is newer
# than this start: train.sbatch reads the marker and requeues; a non-zero exit would have srun
# kill the other nodes), otherwise with torchrun's code.
#   node.sh HEAD_NODE [hydra overrides...]
set -uo pipefail

RDZV_PORT="${MG_RDZV_PORT:-29500}"
RUN_DIR="${MG_RUN_DIR:?set by launch/submit.sh}"

run() {
  if [[ -n "${MG_DRY_RUN:-}" ]]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

HEAD="$1"; shift
STAMP="$RUN_DIR/.node_start_${SLURM_NODEID:-0}"
if [[ -z "${MG_DRY_RUN:-}" ]]; then mkdir -p "$RUN_DIR" && touch "$STAMP"; fi
# torchrun must outlive the signal: SIGUSR2 is ignored by it (and inherited as ignored by the
# ranks, which install their own handler); node.sh hands it to the ranks below.
trap '' USR2
TRAIN_CMD=(torchrun --nnodes="${SLURM_NNODES:-1}" --node-rank="${SLURM_NODEID:-0}"
  --nproc-per-node="${MG_GPUS_PER_NODE:-8}" --rdzv-backend=c10d
  --rdzv-endpoint="$HEAD:$RDZV_PORT" --rdzv-id="${SLURM_JOB_ID:-local}"
  -m megatron_gspo "hydra.run.dir=$RUN_DIR" "$@")
if [[ -n "${MG_DRY_RUN:-}" ]]; then run "${TRAIN_CMD[@]}"; exit 0; fi
"${TRAIN_CMD[@]}" &
TRAINER=$!
# The trainer ranks are torchrun's children: they checkpoint at the next step boundary and exit.
trap 'pkill -USR2 -P "$TRAINER" 2>/dev/null' USR2
trap 'pkill -TERM -P "$TRAINER" 2>/dev/null' TERM
code=0
while true; do
  wait "$TRAINER"; code=$?
  kill -0 "$TRAINER" 2>/dev/null || break
done
if [[ -f "$RUN_DIR/REQUEUE" && "$RUN_DIR/REQUEUE" -nt "$STAMP" ]]; then
  exit 0
fi
exit "$code"
