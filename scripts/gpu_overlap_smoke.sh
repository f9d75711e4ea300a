#!/usr/bin/env bash
# The all-to-all in flight and the pipelined attention block on one GPU (SP 1), from the repository root:
#
#   OUT=/tmp/overlap_smoke bash scripts/gpu_overlap_smoke.sh
#
# 1. tests/distributed/check_overlap.py: late data really waited for (control: an unwaited read sees unlanded
#    bytes), the pipelined block (2 and 4 head groups, forward and backward) captured in a CUDA graph and replayed
#    bit-exact against the eager synchronous block, torch.compile(fullgraph=True) with inductor of the op and the
#    block (start and wait nodes present). At SP 1 its exchanges go through the op's own start/wait bodies on a
#    one-rank group, so the communication stream and its events are exercised.
# 2. The harness case `overlap` at SP 1 on wan720p's per-rank geometry: sync against pipelined blocks, a smoke
#    test (nothing is exchanged at SP 1: no speed claim).
# 3. The CPU tests of the async op and the pipelined block (they need no GPU; run here for the host's torch).
# $OUT: summary.txt, commit.txt, logs.tar.gz and the two JSONs (scripts/gpu_lib.sh).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
gpu_init overlap_smoke
L="$WORK/logs"
export -f gpu_versions  # step runs its command under timeout, which cannot see a shell function
step "versions" 60 versions.log bash -c gpu_versions
step "check_overlap SP1" 300 check.log "$python" -m torch.distributed.run --standalone --nproc_per_node=1 \
  tests/distributed/check_overlap.py --json "$L/overlap_check_sp1.json"
step "overlap case SP1" 300 case.log "$python" -m benchmarks.run overlap --geometry wan720p --groups 1,2,4,8 \
  --routes off --quick --json "$L/overlap_sp1.json"
step "CPU tests" 400 pytest.log "$python" -m pytest -q -x tests/distributed/test_ulysses_async.py \
  tests/distributed/test_overlap_attention.py
gpu_finish logs/overlap_check_sp1.json logs/overlap_sp1.json
