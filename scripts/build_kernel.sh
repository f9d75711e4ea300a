#!/usr/bin/env bash
# Build the fastvideo-kernel library standalone against a pinned NCCL release and check its exports.
#
#   scripts/build_kernel.sh 2.28.9            # -> build/kernel/libfastvideo_ulysses_a2a.so
#   scripts/build_kernel.sh 2.30.7 build/k230 # another output dir
#   NCCL_HOME=/path/to/nccl scripts/build_kernel.sh   # an NCCL tree (include/, lib/) instead of a wheel
#
# The NCCL wheel (nvidia-nccl-cu13==VERSION) is fetched once with `pip download --no-deps` into
# ${FASTVIDEO_KERNEL_CACHE:-$HOME/.cache/fastvideo-kernel} and unzipped there. The compile command
# itself lives in fastvideo-kernel/build_lib.py (shared with the wheel build). CPU-only: no GPU needed.
set -euo pipefail

version="${1:-}"
out_dir="${2:-build/kernel}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${FASTVIDEO_KERNEL_CACHE:-$HOME/.cache/fastvideo-kernel}"
python="${PYTHON:-python3}"

if [[ -z "${NCCL_HOME:-}" ]]; then
  if [[ -z "$version" ]]; then
    echo "usage: $0 NCCL_VERSION [OUT_DIR]   (or set NCCL_HOME)" >&2
    exit 2
  fi
  root="$cache/nccl-$version"
  if [[ ! -f "$root/nvidia/nccl/include/nccl_device.h" ]]; then
    mkdir -p "$cache/wheels"
    wheel="$(ls "$cache"/wheels/nvidia_nccl_cu13-"$version"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$wheel" ]]; then
      echo "fetching nvidia-nccl-cu13==$version"
      "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$cache/wheels" "nvidia-nccl-cu13==$version"
      wheel="$(ls "$cache"/wheels/nvidia_nccl_cu13-"$version"-*.whl | head -n1)"
    fi
    rm -rf "$root.tmp" && mkdir -p "$root.tmp"
    "$python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith("nvidia/nccl/")]' "$wheel" "$root.tmp"
    rm -rf "$root" && mv "$root.tmp" "$root"
  fi
  export NCCL_HOME="$root/nvidia/nccl"
fi

start=$(date +%s)
"$python" "$repo/fastvideo-kernel/build_lib.py" --out "$out_dir" --nccl-home "$NCCL_HOME"
lib="$out_dir/libfastvideo_ulysses_a2a.so"

# CPU-side check: the C ABI is exported, and nothing else (built with -fvisibility=hidden).
expected=(fvk_abi_version fvk_nccl_build_version fvk_nccl_runtime_version fvk_last_error fvk_max_ctas
  fvk_coresident_ctas fvk_relax_capture_mode fvk_pci_bus_id fvk_nvlink_p2p fvk_unique_id_bytes fvk_get_unique_id fvk_create
  fvk_comm_init fvk_window_alloc fvk_window_register fvk_devcomm_create fvk_lsa_info fvk_a2a_original
  fvk_a2a_tuned fvk_a2a_ce fvk_fabric_copy fvk_a2a_captured fvk_a2a_ce_captured fvk_a2a_debug fvk_sim_a2a fvk_check_window_sync
  fvk_check_ce_sync fvk_check_ce_addressing fvk_destroy fvk_abort fvk_vote_open fvk_vote_exchange fvk_vote_unlink fvk_vote_close
  fvk_vote_would_run fvk_voted_launch)
exported="$(nm -D --defined-only "$lib" | awk '$2 == "T" {print $3}')"
missing=0
for sym in "${expected[@]}"; do
  grep -qx "$sym" <<<"$exported" || { echo "MISSING export: $sym" >&2; missing=1; }
done
extra="$(grep -v '^fvk_' <<<"$exported" || true)"
[[ -z "$extra" ]] || { echo "unexpected exports: $extra" >&2; missing=1; }
needed="$(readelf -d "$lib" | grep -E 'NEEDED|RUNPATH|RPATH' || true)"
echo "$needed"
[[ $missing == 0 ]] || exit 1
echo "build_kernel: OK $lib (${#expected[@]} symbols, NCCL ${version:-from $NCCL_HOME}) in $(( $(date +%s) - start )) s"
