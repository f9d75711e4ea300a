#!/usr/bin/env bash
# The test command (README, .ci/run): set-up, ruff, then pytest — the whole suite once, and the
# policy/agreement tests again under every combination of the two transport env vars, since no test
# may depend on the caller's environment. Exit code 5 (no tests collected) is a failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
echo "== ruff"
"$PY" -m ruff check .
echo "== clang-format (csrc/)"
"$(dirname "$PY")/clang-format" --dry-run --Werror csrc/ulysses_a2a/*.cu csrc/ulysses_a2a/*.cuh csrc/ulysses_a2a/*.cpp \
  csrc/ulysses_a2a/*.h
run_pytest() {
  local rc=0
  "$PY" -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
  if [ "$rc" -ne 0 ]; then exit "$rc"; fi
}
if command -v nvcc >/dev/null 2>&1; then
  # The kernel must compile against both pinned NCCL releases (the GPU hosts' and a newer one); the
  # 2.28.9 build stays in build/kernel for the host-side tests in tests/kernel.
  echo "== kernel build against NCCL 2.30.7 and 2.28.9"
  PYTHON="$PY" bash scripts/build_kernel.sh 2.30.7 build/kernel-2.30.7
  PYTHON="$PY" bash scripts/build_kernel.sh 2.28.9 build/kernel
else
  echo "== nvcc not found: skipping the kernel build (CI machines have it)"
fi
echo "== pytest (ambient environment)"
run_pytest -q --timeout=300 tests
for a2a in off auto; do
  for long in auto chunked; do
    echo "== pytest policy/agreement under FASTVIDEO_ULYSSES_A2A=$a2a FASTVIDEO_ULYSSES_A2A_LONG_TRAINING=$long"
    FASTVIDEO_ULYSSES_A2A=$a2a FASTVIDEO_ULYSSES_A2A_LONG_TRAINING=$long \
      run_pytest -q --timeout=300 tests/distributed -k "ulysses"
  done
done
