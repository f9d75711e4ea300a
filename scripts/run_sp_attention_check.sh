#!/usr/bin/env bash
# The correctness command: the SP attention block forward + backward against its single-device reference, on
# both all-to-all routes (examples/sp_recipes/sp_attention_demo.py). 2+ GPUs: one rank per GPU over NCCL
# (bf16). Otherwise: 2 ranks over gloo on CPU (float32).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export PYTHONPATH="$ROOT/examples:$PYTHONPATH"  # the recipes (sp_recipes); setup_env.sh put the package there
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)' 2>/dev/null; then
  NPROC=$("$PY" -c 'import torch; print(min(torch.cuda.device_count(), 8))')
else
  NPROC=2
fi
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m sp_recipes.sp_attention_demo "$@"
