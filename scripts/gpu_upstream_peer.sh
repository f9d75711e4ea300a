#!/usr/bin/env bash
# Upstream FastVideo 0.2.1's own fused Ulysses route beside this package's, in the transport benchmark, on a CUDA
# host without a registry, from the repository root:
#
#   OUT=/tmp/upstream-peer bash scripts/gpu_upstream_peer.sh
#
# Needs, in the git-ignored .whl/ (made on a machine with a registry, never committed), upstream's sources and an
# NCCL 2.29+ for upstream's kernel (the hosts' torch 2.11 carries 2.28.9, which lacks ncclCommQueryProperties).
# Preferred, .whl/upstream/ (about 30 MB in all, small enough to carry):
#   nccl-2.30.7-sm90.tar.xz                 NCCL 2.30.7 built for sm_90 alone, stripped (29.9 MB):
#                                           bash scripts/build_nccl.sh --source NCCL --arch 90 \
#                                             --out .whl/upstream/nccl-2.30.7-sm90.tar.xz
#                                           (NCCL: git clone -b v2.30.7-1 https://github.com/NVIDIA/nccl; the build
#                                           takes a while, once);
#   upstream-comm-sources/                  the four files of the sdist and the wheel the build uses, with their
#                                           SOURCES.json (43 kB): python scripts/build_upstream_comm.py \
#                                             --sdist SDIST --wheel WHEEL --sources-out .whl/upstream/upstream-comm-sources
#                                           (SDIST, WHEEL: the two archives below, fetched once anywhere).
# Otherwise, in .whl/ itself, the archives (46 MB together):
#   fastvideo_kernel-0.3.5.tar.gz           pip download --no-deps --no-binary fastvideo-kernel fastvideo-kernel==0.3.5
#                                           (or the file itself from the package index's simple page)
#   fastvideo-0.2.1-py3-none-any.whl        pip download --no-deps fastvideo==0.2.1
# and one of:
#   nvidia_nccl_cu13-2.30.7-*.whl           pip download --no-deps nvidia-nccl-cu13==2.30.7 (216 MB);
#   nccl-headers-2.30.7.tar.gz              its include/ alone (tar czf ... -C nvidia/nccl include; 0.1 MB): the
#                                           extension compiles against it and takes NCCL from torch at load time,
#                                           which proves the build; it loads only where torch's NCCL is 2.29+ (the
#                                           load step records the missing symbol otherwise).
# Each half is taken from .whl/upstream/ where it is there, else from .whl/. An NCCL with its library (the tar.xz or
# the wheel) is the one NCCL of every process of the benchmark: preloaded (the extension binds to it) and first on
# the path torch loads its own NCCL from (torch loads that by file path, so a preload alone leaves torch on its own
# library, a second NCCL, and upstream's extension would be handed a communicator of another NCCL); this package's
# library is built against it as well.
# Steps: versions; upstream's communication extension built (scripts/build_upstream_comm.py), its NCCL symbols
# checked against the library the processes will load, and reported against torch's own; this package's library
# (against that NCCL, else the usual kernel wheel); the NCCL the processes load; the extension loaded; the transport
# benchmark with the routes nccl, fused and upstream-0.2.1 on every GPU, and fast-ulysses's two where PEER_SDIST
# names its sdist (gpu_fast_ulysses), the floor beside them (P = 1 on one GPU: the build, the extension's smoke
# check and the harness with nccl and fused alone: upstream builds no helper below 2 ranks, and a route asked for by
# name that cannot run fails the benchmark, so the summary says why upstream-0.2.1 is not asked for). Logs
# and the benchmark's JSON under $OUT, the commit stamped (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init upstream-peer
L="$WORK/logs"
export -f gpu_versions
# symbols_report EXT_DIR LIB NOTE: the NCCL symbols upstream's built extension needs, against LIB; a report, never
# a failure (NOTE says which NCCL the processes load instead).
symbols_report() {
  "$python" scripts/build_upstream_comm.py --out "$1" --symbols-only --check-symbols "$2" ||
    echo "(a report, not a failure: $3)"
}
export -f symbols_report
step versions 60 versions.log bash -c 'gpu_versions; nvcc --version | tail -n 2'
whl="$ROOT/.whl"
up="$whl/upstream"
sdist="$whl/fastvideo_kernel-0.3.5.tar.gz"
wheel="$whl/fastvideo-0.2.1-py3-none-any.whl"
sources="$up/upstream-comm-sources"
nccl_xz=$(ls "$up"/nccl-*-sm*.tar.xz 2>/dev/null | head -n1)
nccl_wheel=$(ls "$whl"/nvidia_nccl_cu13-2.30.7-*.whl 2>/dev/null | head -n1)
nccl_headers="$whl/nccl-headers-2.30.7.tar.gz"
missing=()
if [[ -f $sources/SOURCES.json ]]; then
  source_args=(--sources "$sources")
else
  source_args=(--sdist "$sdist" --wheel "$wheel")
  for f in "$sdist" "$wheel"; do [[ -f $f ]] || missing+=("$f (or $sources/)"); done
fi
[[ -n $nccl_xz || -n $nccl_wheel || -f $nccl_headers ]] ||
  missing+=("$up/nccl-2.30.7-sm90.tar.xz (or $whl/nvidia_nccl_cu13-2.30.7-*.whl, or $nccl_headers)")
if ((${#missing[@]})); then
  echo "missing: ${missing[*]} (see the head of this script)" | tee -a "$L/summary.txt"
  failed=1
  gpu_finish
fi
echo "sources: ${source_args[*]}; NCCL: ${nccl_xz:-${nccl_wheel:-$nccl_headers}}" | tee -a "$L/summary.txt"
# torch's own NCCL, as the processes would load it without a preload: what the symbol report compares.
torch_nccl=$("$python" -c 'import torch; torch.cuda.nccl.version(); print(next((ln.split()[-1] for ln in open("/proc/self/maps") if "libnccl.so" in ln), ""))' 2>/dev/null)
if [[ -n $nccl_xz ]]; then
  # Python's tarfile, not tar: a host may lack xz; the data filter where this Python has it.
  step "unpack NCCL (${nccl_xz##*/})" 120 build.log "$python" -c 'import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' "$nccl_xz" "$WORK/nccl-tree"
  nccl_home="$WORK/nccl-tree"
elif [[ -n $nccl_wheel ]]; then
  step "unpack NCCL 2.30.7" 60 build.log "$python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith("nvidia/nccl/")]' "$nccl_wheel" "$WORK/nccl"
  nccl_home="$WORK/nccl/nvidia/nccl"
else
  mkdir -p "$WORK/nccl-headers" && tar xzf "$nccl_headers" -C "$WORK/nccl-headers"
  nccl_home="$WORK/nccl-headers"
  echo "NCCL 2.30.7 headers only: the extension takes NCCL from torch at load time" | tee -a "$L/summary.txt"
fi
nccl_lib="$nccl_home/lib/libnccl.so.2"
check_args=()
if [[ -e $nccl_lib ]]; then
  check_args=(--check-symbols "$nccl_lib")
  # A library built on another machine may need a newer glibc or libstdc++ than this one has: the loader's own
  # error here, before anything is built on it.
  step "NCCL library loads" 60 versions.log "$python" -c 'import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int(); rc = lib.ncclGetVersion(ctypes.byref(v)); print(sys.argv[1], "loads: ncclGetVersion rc", rc, "version code", v.value); sys.exit(rc)' "$nccl_lib"
fi
step "build upstream comm extension" 420 build.log "$python" scripts/build_upstream_comm.py "${source_args[@]}" \
  --nccl-home "$nccl_home" --out "$WORK/upstream" "${check_args[@]}"
cp "$WORK/upstream/build_info.json" "$L/upstream_build_info.json" 2>/dev/null || true
if [[ -n $torch_nccl ]]; then
  if [[ -e $nccl_lib ]]; then note="the processes preload $nccl_lib"; else note="the processes load this one"; fi
  step "symbols vs torch's own NCCL" 60 versions.log bash -c 'symbols_report "$@"' _ "$WORK/upstream" \
    "$torch_nccl" "$note"
fi
if [[ -e $nccl_lib ]]; then
  nccl_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$nccl_home/include/nccl.h" | paste -sd.)
  step "build this library (NCCL $nccl_version)" 300 build.log "$python" fastvideo-kernel/build_lib.py \
    --out "$WORK/kernel" --nccl-home "$nccl_home" --testing
  export FASTVIDEO_KERNEL_LIBRARY="$WORK/kernel/libfastvideo_ulysses_a2a_testing.so"
  export PYTHONPATH="$ROOT/fastvideo-kernel:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export LD_PRELOAD="$nccl_lib${LD_PRELOAD:+:$LD_PRELOAD}"
  # torch loads its NCCL from the first sys.path entry holding nvidia/nccl/lib/libnccl.so.*: this one, the same file.
  mkdir -p "$WORK/nccl-site/nvidia/nccl/lib" && ln -sf "$nccl_lib" "$WORK/nccl-site/nvidia/nccl/lib/libnccl.so.2"
  export PYTHONPATH="$WORK/nccl-site:$PYTHONPATH"
else
  gpu_kernel_wheel
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export FASTVIDEO_UPSTREAM_PEER="$WORK/upstream"
step "NCCL in the processes" 60 versions.log "$python" -c 'import sys; from benchmarks.cases import upstream_peer as u; state, why = u.nccl_check(); print(state); print(why or "one NCCL: torch and the extension share it"); sys.exit(1 if why else 0)'
step "load upstream's extension" 60 versions.log "$python" -c 'import os, torch; from pathlib import Path; from benchmarks.cases import upstream_peer as u; a, c, so = u.load(Path(os.environ["FASTVIDEO_UPSTREAM_PEER"])); print("loaded", so, "is_available", c.is_available(), u._smoke(c, torch.device("cuda", 0)))'
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
routes=nccl,fused,upstream
if [[ $gpus == 1 ]]; then
  routes=nccl,fused
  echo "P=1: upstream-0.2.1 not asked for (upstream builds no helper below 2 ranks); its extension's smoke check is" \
       "the load step above" | tee -a "$L/summary.txt"
fi
if [[ -n "${PEER_SDIST:-}" ]]; then
  gpu_fast_ulysses && routes+=,peer
fi
step "a2a $routes (P=$gpus)" 480 a2a.log "$python" -m torch.distributed.run --standalone \
  --nproc_per_node="$gpus" benchmarks/benchmark_ulysses_a2a.py --routes "$routes" --json "$L/a2a_upstream.json"
gpu_finish logs/a2a_upstream.json logs/upstream_build_info.json
