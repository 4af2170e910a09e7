#!/usr/bin/env bash
# An SGLang server on this node for the rollouts (token ids in and out, routed experts on for R3
# and drift), reachable from the trainer's nodes. The trainer waits until it generates.
#   MG_MODEL_PATH       the Hugging Face checkpoint to serve (set by launch/submit.sh --model-path)
#   MG_SGLANG_TP / _EP  the server's --tp-size / --ep-size (submit.sh --sglang-tp / --sglang-ep)
#   MG_SGLANG_PORT      port (default 30000); MG_SGLANG_HOST: address to bind (default 0.0.0.0)
#   MG_SGLANG_ARGS      more server flags, e.g. "--mem-fraction-static 0.85"
#   MG_SGLANG_LAUNCHER  the server command (default: $MG_SGLANG_PYTHON -m sglang.launch_server,
#                       the image's SGLang environment)
set -euo pipefail
run() {
  if [[ -n "${MG_DRY_RUN:-}" ]]; then printf '+'; printf ' %q' "$@"; printf '\n'; else exec "$@"; fi
}
read -r -a LAUNCHER <<< "${MG_SGLANG_LAUNCHER:-${MG_SGLANG_PYTHON:-python} -m sglang.launch_server}"
read -r -a EXTRA <<< "${MG_SGLANG_ARGS:-}"
run "${LAUNCHER[@]}" --model-path "${MG_MODEL_PATH:?set by launch/submit.sh}" \
  --tp-size "${MG_SGLANG_TP:-8}" --ep-size "${MG_SGLANG_EP:-1}" \
  --host "${MG_SGLANG_HOST:-0.0.0.0}" --port "${MG_SGLANG_PORT:-30000}" \
  --skip-tokenizer-init --enable-return-routed-experts "${EXTRA[@]}"
