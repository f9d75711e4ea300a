# Sourced by the device scripts (scripts/device_*.sh): what every device call needs, and one way to run
# a step. Not a program of its own.

# device_init DEFAULT_OUT: $OUT (created), the environment every process below must see (NVLink
# multicast off on the shared hosts: KINDS.md), the repo root as the working directory, the commit
# stamp in $OUT/commit.txt (COMMIT is git-ignored: pass it with the device tool's carry), failed=0.
device_init() {
  OUT="${OUT:-$1}"
  mkdir -p "$OUT"
  export OUT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cd "$ROOT" || exit 2
  echo "commit $(cat COMMIT 2>/dev/null || echo unknown)" | tee "$OUT/commit.txt"
  failed=0
}

# step NAME LIMIT_S LOG COMMAND...: COMMAND under a time limit, its output teed to $OUT/LOG, one line
# (name, exit status, seconds) appended to $OUT/summary.txt; a failure sets failed=1 and the script goes on.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  echo "=== $name: $*" | tee -a "$OUT/$log"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$OUT/summary.txt"
  [[ $rc == 0 ]] || failed=1
  return "$rc"
}
