#!/usr/bin/env bash
# An SGLang server on this node for the rollouts (R3 routes on), reachable from the trainer.
set -euo pipefail
run() {
  if [[ -n "${MG_DRY_RUN:-}" ]]; then printf '+'; printf ' %q' "$@"; printf '\n'; else exec "$@"; fi
}
run "${MG_SGLANG_PYTHON:-python}" -m sglang.launch_server --model-path "${MG_MODEL_PATH:?set by launch/submit.sh}" \
  --tp-size "${MG_SGLANG_TP:-8}" --ep-size "${MG_SGLANG_EP:-1}" --host 0.0.0.0 --port "${MG_SGLANG_PORT:-30000}" \
  --enable-return-routed-experts --enable-memory-saver --skip-server-warmup
