"""A fake SLURM on PATH for the launch tests: ``sbatch``, ``srun`` and ``scontrol`` as small
scripts that record their calls (in ``$FAKE_LOG``) and act as SLURM would where the launch
scripts depend on it.

- ``sbatch`` refuses a job that asks for no GPUs (``--gpus-per-node`` / ``--gres=gpu``), no cores
  per task (``--cpus-per-task``) or neither whole nodes nor memory (``--exclusive`` / ``--mem``),
  as a GPU partition that enforces them would; with ``FAKE_SBATCH_RUN`` set it runs the batch
  script in the foreground as the job (SLURM's job variables set), else it only submits.
- ``srun`` runs its command once per node of ``--nodelist`` (once, as node 0, without one), each
  with SLURM's task variables (``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURMD_NODENAME``) and, so
  that emulated nodes on one machine have addresses of their own, ``MG_SGLANG_HOST`` = the node's
  name (the test names nodes by loopback addresses: 127.0.0.1, 127.0.0.2, ...); it honours
  ``--output`` (``%n``: the node's index) and ``--kill-on-bad-exit``, passes SIGUSR2 / SIGTERM on
  to every task and exits with the first non-zero exit code.
- ``scontrol show hostnames`` prints ``$FAKE_HOSTS`` (space separated) or gpu-1 .. gpu-N
  (``$FAKE_NODES``, default 2); other calls are recorded.
"""

from __future__ import annotations

import os

FAKE_SBATCH = r"""#!/usr/bin/env bash
echo "sbatch $*" >> "$FAKE_LOG"
args=" $* "
missing=""
[[ "$args" == *" --gpus-per-node="* || "$args" == *" --gres=gpu"* ]] \
  || missing+=" GPUs (--gpus-per-node or --gres=gpu)"
[[ "$args" == *" --cpus-per-task="* ]] || missing+=" cores (--cpus-per-task)"
[[ "$args" == *" --exclusive "* || "$args" == *" --mem="* ]] || missing+=" memory (--exclusive or --mem)"
if [[ -n "$missing" ]]; then
  echo "sbatch: error: the job asks for no$missing" >&2
  exit 1
fi
echo "Submitted batch job ${FAKE_JOB_ID:-4242}"
[[ -n "${FAKE_SBATCH_RUN:-}" ]] || exit 0
nodes=1
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; esac
  shift
done
SLURM_JOB_ID="${FAKE_JOB_ID:-4242}" SLURM_NNODES="$nodes" SLURM_JOB_NODELIST="fake[1-$nodes]" \
  bash "$@"
"""

FAKE_SRUN = r"""#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_LOG"
out=/dev/stdout
nodelist=""
kill_bad=""
while [[ "$1" == --* ]]; do
  case "$1" in
    --output=*) out="${1#--output=}" ;;
    --nodelist=*) nodelist="${1#--nodelist=}" ;;
    --kill-on-bad-exit=1) kill_bad=1 ;;
  esac
  shift
done
IFS=, read -r -a nodes <<< "${nodelist:-localhost}"
pids=()
for i in "${!nodes[@]}"; do
  SLURM_NODEID=$i SLURM_NNODES=${#nodes[@]} SLURMD_NODENAME="${nodes[$i]}" \
    MG_SGLANG_HOST="${nodes[$i]}" "$@" >> "${out//%n/$i}" 2>&1 &
  pids+=($!)
done
trap 'kill -USR2 "${pids[@]}" 2>/dev/null' USR2
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
code=0
for pid in "${pids[@]}"; do
  while true; do
    wait "$pid"; c=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  if [[ $c -ne 0 && $code -eq 0 ]]; then
    code=$c
    [[ -n "$kill_bad" ]] && kill -KILL "${pids[@]}" 2>/dev/null
  fi
done
exit $code
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
if [[ "$1 $2" == "show hostnames" ]]; then
  if [[ -n "${FAKE_HOSTS:-}" ]]; then
    for h in $FAKE_HOSTS; do echo "$h"; done
  else
    for i in $(seq 1 "${FAKE_NODES:-2}"); do echo "gpu-$i"; done
  fi
else
  echo "scontrol $*" >> "$FAKE_LOG"
fi
"""


def install(bin_dir, **extra: str) -> None:
    """Write the fake ``sbatch``, ``srun`` and ``scontrol`` (and ``extra`` scripts by name) into
    ``bin_dir``, executable."""
    scripts = {"sbatch": FAKE_SBATCH, "srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, **extra}
    for name, text in scripts.items():
        path = os.path.join(str(bin_dir), name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
