#!/usr/bin/env bash
# Upstream FastVideo 0.2.1's own fused Ulysses route beside this package's, in the transport benchmark, on a CUDA
# host without a registry, from the repository root:
#
#   OUT=/tmp/upstream-peer bash scripts/gpu_upstream_peer.sh
#
# Needs in the git-ignored .whl/ (fetched on a machine with a registry, never committed):
#   fastvideo_kernel-0.3.5.tar.gz           pip download --no-deps --no-binary :all: fastvideo-kernel==0.3.5
#                                           (or the file itself from the package index's simple page)
#   fastvideo-0.2.1-py3-none-any.whl        pip download --no-deps fastvideo==0.2.1
# and an NCCL 2.29+ for upstream's kernel (the hosts' torch 2.11 carries 2.28.9; the kernel does not compile
# against 2.28), one of:
#   nvidia_nccl_cu13-2.30.7-*.whl           pip download --no-deps nvidia-nccl-cu13==2.30.7 (216 MB): preloaded
#                                           into every process of the benchmark (torch's process groups then run on
#                                           it too), and this package's library is built against it as well;
#   nccl-headers-2.30.7.tar.gz              its include/ alone (tar czf ... -C nvidia/nccl include; 0.1 MB): the
#                                           extension compiles against it and takes NCCL from torch at load time,
#                                           which proves the build; it loads only where torch's NCCL is 2.29+ (the
#                                           load step records the missing symbol otherwise).
# Steps: versions; upstream's communication extension built from the sdist (scripts/build_upstream_comm.py); this
# package's library (against the wheel's NCCL, else the usual kernel wheel); the NCCL the processes load; the
# extension loaded; the transport benchmark with the routes nccl, fused and upstream-0.2.1 on every GPU (P = 1 on
# one GPU: the build, the extension's smoke check and the harness; upstream builds no helper below 2 ranks, and its
# rows say so). Logs and the benchmark's JSON under $OUT, the commit stamped (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init upstream-peer
L="$WORK/logs"
export -f gpu_versions
step versions 60 versions.log bash -c 'gpu_versions; nvcc --version | tail -n 2'
whl="$ROOT/.whl"
sdist="$whl/fastvideo_kernel-0.3.5.tar.gz"
wheel="$whl/fastvideo-0.2.1-py3-none-any.whl"
nccl_wheel=$(ls "$whl"/nvidia_nccl_cu13-2.30.7-*.whl 2>/dev/null | head -n1)
nccl_headers="$whl/nccl-headers-2.30.7.tar.gz"
missing=()
for f in "$sdist" "$wheel"; do [[ -f $f ]] || missing+=("$f"); done
[[ -n $nccl_wheel || -f $nccl_headers ]] || missing+=("$whl/nvidia_nccl_cu13-2.30.7-*.whl or $nccl_headers")
if ((${#missing[@]})); then
  echo "missing in .whl/: ${missing[*]} (see the head of this script)" | tee -a "$L/summary.txt"
  failed=1
  gpu_finish
fi
if [[ -n $nccl_wheel ]]; then
  step "unpack NCCL 2.30.7" 60 build.log "$python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith("nvidia/nccl/")]' "$nccl_wheel" "$WORK/nccl"
  nccl_home="$WORK/nccl/nvidia/nccl"
else
  mkdir -p "$WORK/nccl-headers" && tar xzf "$nccl_headers" -C "$WORK/nccl-headers"
  nccl_home="$WORK/nccl-headers"
  echo "NCCL 2.30.7 headers only: the extension takes NCCL from torch at load time" | tee -a "$L/summary.txt"
fi
step "build upstream comm extension" 420 build.log "$python" scripts/build_upstream_comm.py --sdist "$sdist" \
  --wheel "$wheel" --nccl-home "$nccl_home" --out "$WORK/upstream"
cp "$WORK/upstream/build_info.json" "$L/upstream_build_info.json" 2>/dev/null || true
if [[ -n $nccl_wheel ]]; then
  step "build this library (NCCL 2.30.7)" 300 build.log "$python" fastvideo-kernel/build_lib.py --out "$WORK/kernel" \
    --nccl-home "$nccl_home" --testing
  export FASTVIDEO_KERNEL_LIBRARY="$WORK/kernel/libfastvideo_ulysses_a2a_testing.so"
  export PYTHONPATH="$ROOT/fastvideo-kernel:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export LD_PRELOAD="$nccl_home/lib/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}"
else
  gpu_kernel_wheel
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export FASTVIDEO_UPSTREAM_PEER="$WORK/upstream"
step "NCCL in the processes" 60 versions.log "$python" -c 'import torch; print("torch runs NCCL", ".".join(map(str, torch.cuda.nccl.version())))'
step "load upstream's extension" 60 versions.log "$python" -c 'import os, torch; from pathlib import Path; from benchmarks.cases import upstream_peer as u; a, c, so = u.load(Path(os.environ["FASTVIDEO_UPSTREAM_PEER"])); print("loaded", so, "is_available", c.is_available(), u._smoke(c, torch.device("cuda", 0)))'
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
step "a2a nccl,fused,upstream (P=$gpus)" 480 a2a.log "$python" -m torch.distributed.run --standalone \
  --nproc_per_node="$gpus" benchmarks/benchmark_ulysses_a2a.py --routes nccl,fused,upstream --json "$L/a2a_upstream.json"
gpu_finish logs/a2a_upstream.json logs/upstream_build_info.json
