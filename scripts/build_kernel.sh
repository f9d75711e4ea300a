#!/usr/bin/env bash
# Build the fastvideo-kernel libraries standalone against a pinned NCCL release and check their exports: the
# product library (what the wheel ships) and the test library beside it (the product plus csrc/ulysses_a2a/
# testing/: the simulated ranks, the host property checks, the epoch-checked launch, the fabric copy).
#
#   scripts/build_kernel.sh 2.28.9            # -> build/kernel/libfastvideo_ulysses_a2a{,_testing}.so
#   scripts/build_kernel.sh 2.30.7 build/k230 # another output dir
#   NCCL_HOME=/path/to/nccl scripts/build_kernel.sh   # an NCCL tree (include/, lib/) instead of a wheel
#
# NCCL VERSION's headers and library come from the first of: the cache
# (${FASTVIDEO_KERNEL_CACHE:-$HOME/.cache/fastvideo-kernel}), a carried wheel directory (${FASTVIDEO_WHEEL_DIR:-.whl/}
# at the repository root, git-ignored: nvidia_nccl_cu13-VERSION-*.whl), the nvidia-nccl-cu13 package installed in
# $PYTHON when it is that version (a GPU host's torch brings one), a carried NCCL tree packed by
# scripts/build_nccl.sh (that directory's upstream/nccl-VERSION-sm*.tar.xz, 30 MB where the wheel is 216 MB), or
# `pip download --no-deps` into the cache. A wheel or a packed tree is unpacked into the cache. When none has it (a host without a package registry), the script exits 3 with a note
# naming what is missing, and the test command skips that build saying so; under CI=true, where the download is
# possible, it exits 1. `--print-nccl-home` prints where the headers were found and builds nothing. The compile
# command itself lives in fastvideo-kernel/build_lib.py (shared with the wheel build). CPU-only: no GPU needed.
set -euo pipefail

print_only=0
if [[ "${1:-}" == --print-nccl-home ]]; then
  print_only=1
  shift
fi
version="${1:-}"
out_dir="${2:-build/kernel}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/ci.sh"  # _fv_ci
cache="${FASTVIDEO_KERNEL_CACHE:-$HOME/.cache/fastvideo-kernel}"
wheel_dir="${FASTVIDEO_WHEEL_DIR:-$repo/.whl}"
python="${PYTHON:-python3}"

# nccl_tree [ROOT]: "ROOT VERSION" for a complete NCCL tree (include/nccl.h, include/nccl_device.h,
# lib/libnccl.so.2): ROOT, or without it the installed nvidia-nccl package's; nothing where it is absent or incomplete.
nccl_tree() {
  "$python" - "$@" <<'PY' 2>/dev/null || true
import importlib.util, pathlib, re, sys
if len(sys.argv) > 1:
    root = pathlib.Path(sys.argv[1])
else:
    spec = importlib.util.find_spec("nvidia.nccl")
    if not (spec and spec.submodule_search_locations):
        sys.exit(0)
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
text = (root / "include" / "nccl.h").read_text()
if (root / "include" / "nccl_device.h").is_file() and (root / "lib" / "libnccl.so.2").exists():
    print(root, ".".join(re.search(rf"#define NCCL_{k}\s+(\d+)", text).group(1) for k in ("MAJOR", "MINOR", "PATCH")))
PY
}

if [[ -z "${NCCL_HOME:-}" ]]; then
  if [[ -z "$version" ]]; then
    echo "usage: $0 [--print-nccl-home] NCCL_VERSION [OUT_DIR]   (or set NCCL_HOME)" >&2
    exit 2
  fi
  root="$cache/nccl-$version"
  if [[ -f "$root/nvidia/nccl/include/nccl_device.h" ]]; then
    export NCCL_HOME="$root/nvidia/nccl"
  else
    wheel="$(ls "$cache"/wheels/nvidia_nccl_cu13-"$version"-*.whl "$wheel_dir"/nvidia_nccl_cu13-"$version"-*.whl \
      2>/dev/null | head -n1 || true)"
    installed="$(nccl_tree)"
    if [[ ${installed##* } == "$version" ]]; then installed="${installed% *}"; else installed=""; fi
    packed="$(ls "$wheel_dir"/upstream/nccl-"$version"-sm*.tar.xz 2>/dev/null | head -n1 || true)"
    if [[ -z "$wheel" && -n "$installed" ]]; then
      echo "build_kernel: NCCL $version headers from the installed nvidia-nccl-cu13 ($installed)"
      export NCCL_HOME="$installed"
    elif [[ -z "$wheel" && -f "$root-packed/include/nccl_device.h" ]]; then
      echo "build_kernel: NCCL $version from the packed tree unpacked in $root-packed"
      export NCCL_HOME="$root-packed"
    elif [[ -z "$wheel" && -n "$packed" ]]; then
      # Python's tarfile, not tar: a machine may lack xz.
      rm -rf "$root-packed.tmp" && mkdir -p "$root-packed.tmp"
      "$python" -c 'import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' "$packed" "$root-packed.tmp"
      found="$(nccl_tree "$root-packed.tmp")"
      found="${found##* }"
      incomplete="of no readable version (a tree as scripts/build_nccl.sh packs it: include/nccl.h, nccl_device.h, lib/)"
      [[ "$found" == "$version" ]] || {
        echo "build_kernel: $packed is NCCL ${found:-$incomplete}, not $version" >&2
        exit 1
      }
      rm -rf "$root-packed" && mv "$root-packed.tmp" "$root-packed"
      echo "build_kernel: NCCL $version from the packed tree $packed"
      export NCCL_HOME="$root-packed"
    else
      if [[ -z "$wheel" ]]; then
        echo "fetching nvidia-nccl-cu13==$version"
        mkdir -p "$cache/wheels"
        if ! "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$cache/wheels" \
            "nvidia-nccl-cu13==$version"; then
          have="$("$python" -c 'import importlib.metadata as m; print(m.version("nvidia-nccl-cu13"))' 2>/dev/null \
            || echo none)"
          missing="nvidia-nccl-cu13==$version: not in $cache, no wheel in $wheel_dir, the installed nvidia-nccl-cu13 is $have, and pip could not download it (no package registry?)"
          if _fv_ci; then
            echo "build_kernel: FAILED under CI, which must download it: $missing" >&2
            exit 1
          fi
          echo "build_kernel: UNAVAILABLE offline: $missing. Put the wheel in $wheel_dir, or a tree packed by scripts/build_nccl.sh in $wheel_dir/upstream, to build against it." >&2
          exit 3
        fi
        wheel="$(ls "$cache"/wheels/nvidia_nccl_cu13-"$version"-*.whl | head -n1)"
      fi
      echo "build_kernel: NCCL $version headers from $wheel"
      mkdir -p "$cache"
      rm -rf "$root.tmp" && mkdir -p "$root.tmp"
      "$python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith("nvidia/nccl/")]' "$wheel" "$root.tmp"
      rm -rf "$root" && mv "$root.tmp" "$root"
      export NCCL_HOME="$root/nvidia/nccl"
    fi
  fi
fi
if ((print_only)); then
  echo "NCCL_HOME=$NCCL_HOME"
  exit 0
fi

start=$(date +%s)
"$python" "$repo/fastvideo-kernel/build_lib.py" --out "$out_dir" --nccl-home "$NCCL_HOME" --testing
lib="$out_dir/libfastvideo_ulysses_a2a.so"
testing_lib="$out_dir/libfastvideo_ulysses_a2a_testing.so"

# CPU-side check: each library exports its C ABI and nothing else (built with -fvisibility=hidden), and the
# product library holds no test code at all (no simulation, epoch checker, host model or fabric copy symbol,
# local ones included). tests/kernel/test_kernel_host.py checks the same from Python.
product=(fvk_abi_version fvk_nccl_build_version fvk_nccl_runtime_version fvk_last_error fvk_max_ctas
  fvk_coresident_ctas fvk_relax_capture_mode fvk_pci_bus_id fvk_nvlink_p2p fvk_unique_id_bytes fvk_get_unique_id
  fvk_create fvk_comm_init fvk_window_alloc fvk_window_register fvk_devcomm_create fvk_lsa_info fvk_launch
  fvk_a2a_original fvk_destroy fvk_abort fvk_vote_open fvk_vote_exchange fvk_vote_unlink fvk_vote_close
  fvk_vote_would_run)
testing=(fvk_testing_abi_version fvk_sim_a2a fvk_check_window_sync fvk_check_ce_sync fvk_check_addressing
  fvk_fabric_copy)
test_code='sim_kernel|SimEnv|epoch_|checked_a2a|CheckedLsaEnv|flat_push|fabric|Checker|ce_sync|addressing'
bad=0
check_exports() {  # LIBRARY SYMBOL...: exactly these fvk_ symbols exported
  local so=$1
  shift
  local exported want
  exported="$(nm -D --defined-only "$so" | awk '$2 == "T" {print $3}' | sort)"
  want="$(printf '%s\n' "$@" | sort)"
  if [[ "$exported" != "$want" ]]; then
    echo "$so exports differ from its ABI (< missing, > unexpected):" >&2
    diff <(echo "$want") <(echo "$exported") >&2 || true
    bad=1
  fi
}
check_exports "$lib" "${product[@]}"
check_exports "$testing_lib" "${product[@]}" "${testing[@]}"
if nm -C "$lib" | grep -E "$test_code" >&2; then echo "test code in the product library $lib" >&2; bad=1; fi
# The same pattern finds the test code in the test library (the check above can fail).
nm -C "$testing_lib" | grep -E "$test_code" >/dev/null || { echo "pattern finds no test code in $testing_lib" >&2; bad=1; }
needed="$(readelf -d "$lib" | grep -E 'NEEDED|RUNPATH|RPATH' || true)"
echo "$needed"
[[ $bad == 0 ]] || exit 1
echo "build_kernel: OK $lib (${#product[@]} symbols) and $testing_lib (+${#testing[@]}), NCCL ${version:-from $NCCL_HOME}" \
  "in $(( $(date +%s) - start )) s"
