#!/usr/bin/env bash
# Smoke test of the built GPU image on one GPU, in a few minutes: one line per check, and it stops
# at the first failing check with one line saying what is missing.
#
#   docker run --gpus 1 --rm megatron-gspo:0.1 bash docker/smoke.sh
#   launch/submit.sh --smoke --partition P --container-image megatron-gspo.sqsh   (a one-node job)
#
# Checks: a CUDA GPU; imports (megatron-core, Transformer Engine, apex's fused kernels, this project,
# transformers for the recipes' Hugging Face tokenizers;
# SGLang from its own environment, at the version the client targets); the tiny model with the
# Transformer Engine layer spec, one bf16 forward+backward; an SGLang server on a tiny HF Qwen3-MoE
# checkpoint written here; one /generate with log-probs and routed experts; a weight update from disk.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
SGLANG_PY=${MG_SGLANG_PYTHON:-/opt/sglang/bin/python}
PORT=${SMOKE_PORT:-30571}
WORK=$(mktemp -d)
SERVER_PID=""
cleanup() { [[ -n "$SERVER_PID" ]] && kill "$SERVER_PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT

check() {  # check NAME COMMAND...: prints "ok NAME: <last line>" or "FAIL NAME: <last line>" and stops
  local name=$1 out
  shift
  if out=$("$@" 2>&1); then
    echo "ok   $name: $(tail -n 1 <<<"$out")"
  else
    echo "FAIL $name: $(grep -v '^\s*$' <<<"$out" | tail -n 1)"
    exit 1
  fi
}

check "gpu" "$PY" -c "
import torch
assert torch.cuda.is_available(), 'no CUDA GPU visible to torch ' + torch.__version__
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'cuda', torch.version.cuda)"

check "imports" "$PY" -c "
import importlib.metadata as m
import megatron.core, transformer_engine, megatron_gspo
import amp_C, fused_layer_norm_cuda  # apex's CUDA extensions
from transformers import AutoTokenizer  # the recipes' Hugging Face tokenizers
print('megatron-core', m.version('megatron-core'), 'transformer-engine', m.version('transformer-engine'),
      'apex', m.version('apex'), 'transformers', m.version('transformers'))"

check "sglang" "$SGLANG_PY" -c "
import sglang
from importlib.metadata import version
import re, sys
client = re.search(r'SGLANG_VERSION = \"([^\"]+)\"', open('megatron_gspo/rollout/sglang/facade.py').read()).group(1)
assert version('sglang') == client, f'sglang {version(\"sglang\")} in $SGLANG_PY, the client targets {client}'
print('sglang', version('sglang'))"

check "te forward+backward" "$PY" - <<'PYEOF'
import torch
from megatron_gspo.algorithms.logprobs import token_logprobs
from megatron_gspo.batch.micro_batch import MicroBatch
from megatron_gspo.config import ModelConfig, ParallelConfig
from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel
from megatron_gspo.models import te
from megatron_gspo.models.forward import forward_backward
from megatron_gspo.models.model import build_model

assert te.use_te_spec("cuda"), "Transformer Engine does not import: no TE layer spec"
m = ModelConfig(params_dtype="bfloat16")
ctx = init_parallel(ParallelConfig(device="cuda"), m, seed=0)
gpt = build_model(m, ctx)
tokens = torch.randint(0, m.vocab_size, (2, 65), device="cuda")

def loss_fn(mb, logits):
    logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group)
    return -logp.mean(), {"loss": -logp.mean().detach()}

out = forward_backward(gpt, [MicroBatch(tokens[:, :-1], tokens[:, 1:])], ctx, loss_fn)
grads = [p.grad for p in gpt.parameters() if p.grad is not None]
assert grads and all(torch.isfinite(g).all() for g in grads), "non-finite gradients"
print(f"TE layers, bf16: loss {float(out[0]['loss']):.3f}, {len(grads)} gradients finite")
destroy_parallel()
PYEOF

check "tiny HF checkpoint" "$SGLANG_PY" - "$WORK/hf" <<'PYEOF'
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                     tie_word_embeddings=False)
torch.manual_seed(0)
Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
print("written", sys.argv[1])
PYEOF

"$SGLANG_PY" -m sglang.launch_server --model-path "$WORK/hf" --port "$PORT" --skip-tokenizer-init \
  --enable-return-routed-experts --mem-fraction-static 0.2 --disable-cuda-graph \
  >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
check "sglang server" "$SGLANG_PY" - "$PORT" "$SERVER_PID" "$WORK/server.log" <<'PYEOF'
import os, sys, time, urllib.request
port, pid, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=5)
        print("healthy on port", port); break
    except Exception:
        if not os.path.exists(f"/proc/{pid}"):
            sys.exit("server exited: " + open(log).read().strip().splitlines()[-1])
        time.sleep(1)
else:
    sys.exit("server not healthy after 300 s")
PYEOF

check "generate" "$SGLANG_PY" - "$PORT" <<'PYEOF'
import base64, json, sys, urllib.request
import numpy as np
body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
        "return_logprob": True, "return_routed_experts": True}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/generate", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=120))
meta = out["meta_info"]
logps = meta["output_token_logprobs"]
routes = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, 2, 2)
assert len(logps) == len(out["output_ids"]) and routes.shape[0] == 4 + len(out["output_ids"]) - 1
print(f"{len(out['output_ids'])} tokens, log-probs {[round(x[0], 3) for x in logps[:3]]}..., "
      f"routes {routes.shape}")
PYEOF

check "weight update from disk" "$SGLANG_PY" - "$PORT" "$WORK/hf" <<'PYEOF'
import json, sys, urllib.request
body = {"model_path": sys.argv[2], "weight_version": "smoke"}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/update_weights_from_disk",
                             json.dumps(body).encode(), {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=300))
assert out.get("success"), out
print("success:", out.get("message", ""))
PYEOF
echo "smoke passed"
