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
#   nvidia_nccl_cu13-2.30.7-*.whl           pip download --no-deps nvidia-nccl-cu13==2.30.7
# Upstream's kernel needs NCCL 2.29+ (the hosts' torch 2.11 carries 2.28.9), so the NCCL of the wheel above is
# preloaded into every process of the benchmark (torch's process groups then run on it too), and this package's
# kernel library is built against the same NCCL. Steps: versions; upstream's communication extension built from
# the sdist (scripts/build_upstream_comm.py); this package's library against NCCL 2.30.7; the NCCL the processes
# load; the transport benchmark with the routes nccl, fused and upstream-0.2.1 on every GPU (P = 1 on one GPU:
# the build, the extension's smoke check and the harness; upstream builds no helper below 2 ranks, and its rows
# say so). Logs and the benchmark's JSON under $OUT, the commit stamped (scripts/gpu_lib.sh).
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
missing=()
for f in "$sdist" "$wheel" "$nccl_wheel"; do [[ -n $f && -f $f ]] || missing+=("${f:-$whl/nvidia_nccl_cu13-2.30.7-*.whl}"); done
if ((${#missing[@]})); then
  echo "missing in .whl/: ${missing[*]} (see the head of this script)" | tee -a "$L/summary.txt"
  failed=1
  gpu_finish
fi
step "unpack NCCL 2.30.7" 60 build.log "$python" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith("nvidia/nccl/")]' "$nccl_wheel" "$WORK/nccl"
nccl_home="$WORK/nccl/nvidia/nccl"
step "build upstream comm extension" 420 build.log "$python" scripts/build_upstream_comm.py --sdist "$sdist" \
  --wheel "$wheel" --nccl-home "$nccl_home" --out "$WORK/upstream"
cp "$WORK/upstream/build_info.json" "$L/upstream_build_info.json" 2>/dev/null || true
step "build this library (NCCL 2.30.7)" 300 build.log "$python" fastvideo-kernel/build_lib.py --out "$WORK/kernel" \
  --nccl-home "$nccl_home" --testing
export FASTVIDEO_KERNEL_LIBRARY="$WORK/kernel/libfastvideo_ulysses_a2a_testing.so"
export PYTHONPATH="$ROOT/fastvideo-kernel:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export LD_PRELOAD="$nccl_home/lib/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}"
export FASTVIDEO_UPSTREAM_PEER="$WORK/upstream"
step "NCCL in the processes" 60 versions.log "$python" -c 'import torch; print("torch runs NCCL", ".".join(map(str, torch.cuda.nccl.version())))'
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
step "a2a nccl,fused,upstream (P=$gpus)" 480 a2a.log "$python" -m torch.distributed.run --standalone \
  --nproc_per_node="$gpus" benchmarks/benchmark_ulysses_a2a.py --routes nccl,fused,upstream --json "$L/a2a_upstream.json"
gpu_finish logs/a2a_upstream.json logs/upstream_build_info.json
