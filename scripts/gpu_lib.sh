# Sourced by the GPU scripts (scripts/gpu_*.sh): their set-up, one way to run a step, and what they leave in $OUT.
# Not a program of its own.
#
# Every step's output goes to a log in $WORK (default /tmp/fastvideo-NAME); at the end gpu_finish puts a fixed,
# small set of files in $OUT (default $WORK/out): summary.txt, commit.txt, logs.tar.gz (everything in $WORK) and up
# to 5 named results, so $OUT never holds more than 8 files and nothing deeper than its top level.

# tree_commit DIR: the commit DIR's files are, on stdout; where a COMMIT stamp (what an exported tree carries
# instead of .git) and the checkout's HEAD disagree, a note on stderr saying which was recorded and why
# (benchmarks/harness/commit.py, the one rule every record follows; any python3 runs it, before any set-up).
tree_commit() {
  python3 "$(dirname "${BASH_SOURCE[0]}")/../benchmarks/harness/commit.py" "$1"
}

# gpu_init NAME: the working and output folders, the environment every process below must see, the repository
# root as the working directory, the commit (tree_commit) in commit.txt with its note, if any, failed=0. BUDGET_S,
# when set, bounds the whole script (see step).
gpu_init() {
  ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  WORK="${WORK:-/tmp/fastvideo-$1}"
  OUT="${OUT:-$WORK/out}"
  rm -rf "$WORK/logs"
  mkdir -p "$WORK/logs" "$OUT"
  # NVLink multicast (NVLS) off, as on the project's H200 hosts: NCCL's own algorithm choice, and so the NCCL
  # route's numbers, must not depend on whether a host has it.
  export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONUNBUFFERED=1 WORK OUT ROOT
  python="${PYTHON:-python3}"
  export python
  cd "$ROOT" || exit 2
  local commit
  commit=$(tree_commit "$ROOT" 2>"$WORK/logs/commit_note.txt")
  echo "commit $commit" | tee "$WORK/logs/commit.txt"
  # A stamp that disagrees with HEAD: said on stderr and kept beside the commit, so the record shows it too.
  if [[ -s $WORK/logs/commit_note.txt ]]; then
    sed 's/^/note: /' "$WORK/logs/commit_note.txt" | tee -a "$WORK/logs/commit.txt" >&2
  fi
  rm -f "$WORK/logs/commit_note.txt"
  : >"$WORK/logs/summary.txt"
  failed=0
  t_start=$SECONDS
}

# step NAME LIMIT_S LOG COMMAND...: COMMAND under a time limit (the smaller of LIMIT_S and what BUDGET_S leaves,
# minus RESERVE_S for the steps after it), its output appended to $WORK/logs/LOG and shown, one line (name, exit
# status, seconds) in summary.txt. A failure sets failed=1 and the script goes on.
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  if [[ -n "${BUDGET_S:-}" ]]; then
    local left=$((BUDGET_S - (SECONDS - t_start) - ${RESERVE_S:-0}))
    if ((left < 10)); then
      printf '%-34s SKIPPED (%ss left of the %ss budget)\n' "$name" "$left" "$BUDGET_S" | tee -a "$WORK/logs/summary.txt"
      failed=1
      return 1
    fi
    ((left < limit)) && limit=$left
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$WORK/logs/$log"
  local start=$SECONDS
  # SIGINT at the limit, not SIGTERM: pytest (and any Python step) then prints what it has, the failures' text
  # included, before it stops; SIGKILL 15 s later for whatever does not.
  timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$WORK/logs/$log"
  local rc=${PIPESTATUS[0]}
  printf '%-34s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$WORK/logs/summary.txt"
  [[ $rc == 0 ]] || failed=1
  return "$rc"
}

# gpu_versions: the GPUs, their topology, the driver, torch, CUDA and NCCL.
# gpu_python PATTERN: the python's path, its version, torch and visible GPUs, then the installed packages whose
# `pip list` lines match the extended regex PATTERN (case-insensitive).
gpu_python() {
  command -v "$python"
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, "gpus", torch.cuda.device_count())'
  "$python" -m pip list 2>/dev/null | grep -iE "$1" || true
}

gpu_versions() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m || true
  nproc
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "built against nccl",
".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count())'
}

# gpu_kernel_wheel: the kernel wheel built from this tree (into $WORK/wheel) and installed over whatever is there
# (--force-reinstall: an installed build of the same version, from another tree, would otherwise stay and be what the
# run tests), then checked (scripts/check_kernel_wheel.py): the package Python imports must hold the wheel's files,
# byte for byte, and load its library. Where the build, the install or the check fails (its log names each file that
# differs), a development build in $WORK/kernel, used through FASTVIDEO_KERNEL_LIBRARY with the loader from the tree.
gpu_kernel_wheel() {
  local wheel=""
  rm -rf "$WORK/wheel"
  if step "build kernel wheel" 300 build.log \
      "$python" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$WORK/wheel" ./fastvideo-kernel; then
    wheel=$(ls "$WORK"/wheel/fastvideo_kernel-*.whl 2>/dev/null | head -n1)
    [[ -n $wheel ]] || { echo "no fastvideo_kernel wheel in $WORK/wheel" | tee -a "$WORK/logs/build.log"; failed=1; }
  fi
  if [[ -n $wheel ]] &&
      step "install kernel wheel (this tree's)" 120 build.log \
        "$python" -m pip install --force-reinstall --no-deps "$wheel" &&
      step "installed kernel is this tree's" 120 build.log "$python" scripts/check_kernel_wheel.py "$wheel"; then
    return 0
  fi
  step "fallback dev build" 200 build.log "$python" fastvideo-kernel/build_lib.py --out "$WORK/kernel"
  export FASTVIDEO_KERNEL_LIBRARY="$WORK/kernel/libfastvideo_ulysses_a2a.so"
  export PYTHONPATH="$ROOT/fastvideo-kernel${PYTHONPATH:+:$PYTHONPATH}"
}

# gpu_fast_ulysses: where PEER_SDIST names the fast-ulysses 0.2.1 sdist (never part of this repository), that peer
# built for sm_90 into $WORK/peer with this host's torch and put first on PYTHONPATH, so the transport benchmark
# times it beside the other routes; without PEER_SDIST its rows are skipped with the reason.
gpu_fast_ulysses() {
  [[ -n "${PEER_SDIST:-}" ]] || return 0
  step "build fast-ulysses (sm_90)" 420 peer.log env FAST_ULYSSES_CUDA_ARCH=90 "$python" -m pip install -q \
    --no-build-isolation --no-deps --target "$WORK/peer" "$PEER_SDIST" &&
    export PYTHONPATH="$WORK/peer${PYTHONPATH:+:$PYTHONPATH}"
}

# gpu_testing_library: the test library (the product sources plus csrc/ulysses_a2a/testing/: the epoch-checked
# launch, the simulated ranks, the fabric copy) built into $WORK/kernel-testing; FASTVIDEO_KERNEL_TESTING_LIBRARY
# names it, and FASTVIDEO_KERNEL_TEST_BUILD the product library built beside it (tests/kernel's CPU tests).
gpu_testing_library() {
  step "build test library" 300 build.log "$python" fastvideo-kernel/build_lib.py --out "$WORK/kernel-testing" --testing
  export FASTVIDEO_KERNEL_TESTING_LIBRARY="$WORK/kernel-testing/libfastvideo_ulysses_a2a_testing.so"
  export FASTVIDEO_KERNEL_TEST_BUILD="$WORK/kernel-testing/libfastvideo_ulysses_a2a.so"
}

# gpu_finish FILE...: summary.txt, commit.txt, logs.tar.gz and up to 5 of the named files (paths under $WORK) into
# $OUT; prints the summary; exits with the script's status.
gpu_finish() {
  local kept=0 f
  echo "=== summary ($((SECONDS - t_start)) s)"
  cat "$WORK/logs/summary.txt"
  cp "$WORK/logs/summary.txt" "$WORK/logs/commit.txt" "$OUT/"
  tar czf "$OUT/logs.tar.gz" -C "$WORK" logs
  for f in "$@"; do
    [[ -f "$WORK/$f" ]] || continue
    if ((kept == 5)); then
      echo "not copied to $OUT (5 results at most; it is in logs.tar.gz): $f"
      continue
    fi
    cp "$WORK/$f" "$OUT/"
    kept=$((kept + 1))
  done
  exit "$failed"
}
