#!/usr/bin/env bash
# Everything the 2-GPU kind (nvidia-h200-x2) must run, in stages that each fit one device call
# (<= 10 minutes); logs and JSON under $OUT. The commit travels in COMMIT (git-ignored: pass it with
# the device tool's carry=["COMMIT"]).
#
#   OUT=$OUT bash scripts/device_sp2.sh gate        # issue 11: the native gate with the plan sweep and the
#                                                   #   epoch checker, and the watchdog SIGKILL check (issue 13)
#   OUT=$OUT bash scripts/device_sp2.sh speed       # issue 12: tuner sweep, then the transport benchmark
#   OUT=$OUT bash scripts/device_sp2.sh dit         # issue 14: scripts/device_issue14.sh (when present)
#   OUT=$OUT bash scripts/device_sp2.sh ce          # issue 12: the full gate (copy-engine parity and sweep
#                                                   #   included), the tuner over both engines, then the
#                                                   #   transport benchmark on the tuner's rows (--tuned-from)
#   OUT=$OUT bash scripts/device_sp2.sh graphs      # issue 16: tests/distributed/check_ulysses_graphs.py
#   OUT=$OUT bash scripts/device_sp2.sh compare     # issue 12: --compare-revs of an exported older tree (carry
#                                                   #   .revs/base, e.g. `git archive 8912e8a | tar -x -C
#                                                   #   .revs/base`) against this one, each tree on its own
#                                                   #   loader and library build (--tree-libraries)
#   OUT=$OUT bash scripts/device_sp2.sh graphs-ce   # the same with --capture-engines ce,sm: the captured
#                                                   #   copy-engine kind across 2 GPUs (its pushes in a graph),
#                                                   #   before policy.CAPTURE_ENGINES may include it
#
# Each stage installs the kernel wheel first (the machine starts bare) and keeps going after a failed
# step; the exit status is non-zero if any step failed.
set -uo pipefail
stage="${1:-gate}"
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
device_init /tmp/fastvideo-sp2
echo "stage $stage" | tee -a "$OUT/commit.txt"
nvidia-smi topo -m | tee "$OUT/topo.txt"
step "install kernel wheel" 200 "$stage.log" python3 -m pip install --no-build-isolation --no-deps -q ./fastvideo-kernel
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc_per_node=2)
case "$stage" in
  gate)
    step "native gate" 420 "$stage.log" "${TORCHRUN[@]}" tests/distributed/check_ulysses_h3_native.py --epoch-check \
      --json "$OUT/gate.json"
    step "watchdog SIGKILL" 90 "$stage.log" python3 tests/distributed/check_ulysses_watchdog_sigkill.py --timeout 20
    ;;
  speed)
    step "tuner" 300 "$stage.log" "${TORCHRUN[@]}" benchmarks/tune_ulysses_a2a.py --json "$OUT/tune.json"
    step "benchmark" 240 "$stage.log" "${TORCHRUN[@]}" benchmarks/benchmark_ulysses_a2a.py --overlap --require-fused \
      --json "$OUT/a2a.json"
    ;;
  ce)
    step "native gate" 170 "$stage.log" "${TORCHRUN[@]}" tests/distributed/check_ulysses_h3_native.py --epoch-check \
      --json "$OUT/gate.json"
    step "tuner (sm, ce)" 120 "$stage.log" "${TORCHRUN[@]}" benchmarks/tune_ulysses_a2a.py --geometry wan720p \
      --geometry h3-32k --ctas 144 --ce-ctas 66,132 --row-splits 2,4,8 --engines sm,ce --json "$OUT/tune.json"
    tuned=()
    [[ -s $OUT/tune.json ]] && tuned=(--tuned-from "$OUT/tune.json")
    step "benchmark" 230 "$stage.log" "${TORCHRUN[@]}" benchmarks/benchmark_ulysses_a2a.py --overlap --require-fused \
      "${tuned[@]}" --json "$OUT/a2a.json"
    ;;
  graphs)
    step "graphs (issue 16)" 280 "$stage.log" "${TORCHRUN[@]}" tests/distributed/check_ulysses_graphs.py \
      --json "$OUT/graphs.json"
    ;;
  compare)
    if [[ ! -d .revs/base/fastvideo ]]; then
      echo "compare: no exported tree at .revs/base (carry it)"; failed=1
    else
      step "build base library" 200 "$stage.log" bash -c 'cd .revs/base && python3 fastvideo-kernel/build_lib.py --out build/kernel'
      step "build head library" 200 "$stage.log" python3 fastvideo-kernel/build_lib.py --out build/kernel
      step "compare-revs" 420 "$stage.log" python3 benchmarks/benchmark_ulysses_a2a.py --compare-revs .revs/base . \
        --tree-libraries --rounds 2 --nproc 2 --json "$OUT/compare.json" -- --geometry wan720p --geometry h3-32k
    fi
    ;;
  graphs-ce)
    step "graphs, copy-engine captures" 280 "$stage.log" "${TORCHRUN[@]}" tests/distributed/check_ulysses_graphs.py \
      --capture-engines ce,sm --json "$OUT/graphs_ce.json"
    ;;
  dit)
    if [[ -f scripts/device_issue14.sh ]]; then
      step "DiT step" 560 "$stage.log" env BUDGET_S=530 bash scripts/device_issue14.sh
    else
      echo "scripts/device_issue14.sh not found"; failed=1
    fi
    ;;
  *) echo "unknown stage $stage (gate|speed|dit|ce|graphs|graphs-ce|compare)" >&2; exit 2 ;;
esac
echo "=== summary"; cat "$OUT/summary.txt"
exit "$failed"
