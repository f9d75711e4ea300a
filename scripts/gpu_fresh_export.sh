#!/usr/bin/env bash
# The README's two commands as a newcomer runs them on a GPU host (one GPU or several, with or without a package
# registry), from a fresh export of this tree (plus the overlay's wheels in .whl/overlay where they were carried),
# from the repository root:
#
#   OUT=/tmp/fresh bash scripts/gpu_fresh_export.sh
#
# The tree is exported into a new folder ($WORK/tree): `git archive HEAD` where the tree's commit (tree_commit in
# scripts/gpu_lib.sh: its COMMIT stamp or git, whichever its files are) is its checkout's HEAD, else the files of
# this tree without anything git ignores (build/, .venv/, .whl/, .revs/, compiled objects), so no earlier build, venv
# or carried wheel helps it; the commit of what was exported is stamped into the export. The NCCL wheel cache is
# a new empty folder too, and PYTHONPATH is cleared. Then, in the export, with the host's python as the README's
# set-up picks it: `bash scripts/run_demo.sh`, then `bash scripts/run_tests.sh`, each under a time limit, the
# whole inside BUDGET_S (default 570 s: one 10-minute device call). ONLY=demo or ONLY=tests runs one of the two
# (a second call when one call is not enough). Where the tests outgrow one call, split them over two with
# run_tests.sh's own selection, FASTVIDEO_PYTEST_ARGS (each call runs the whole set-up, then its share; together
# they cover every test once):
#
#   ONLY=tests FASTVIDEO_PYTEST_ARGS=tests/distributed OUT=... bash scripts/gpu_fresh_export.sh
#   ONLY=tests FASTVIDEO_PYTEST_ARGS="tests --ignore=tests/distributed" OUT=... bash scripts/gpu_fresh_export.sh
#
# NCCL_NVLS_ENABLE=0 (scripts/gpu_lib.sh). $OUT: summary.txt,
# commit.txt, logs.tar.gz, versions.log, demo.log, tests.log and the demo's plot.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
export BUDGET_S="${BUDGET_S:-570}"
only="${ONLY:-}"
case "$only" in "" | demo | tests) ;; *) echo "ONLY=$only: choose demo or tests (or leave it unset for both)" >&2; exit 2 ;; esac
gpu_init fresh-export
L="$WORK/logs"
commit=$(awk '{print $2; exit}' "$L/commit.txt")
tree="$WORK/tree"
rm -rf "$tree" "$WORK/nccl-cache" && mkdir -p "$tree" "$WORK/nccl-cache"
# git archive only where the checkout's HEAD is the tree's commit: a host's copy of the tree can come with a .git of
# another commit (its files are this tree's, its HEAD is not), and archiving that HEAD would test the wrong code.
head=$(git -C "$ROOT" rev-parse --verify -q HEAD 2>/dev/null || true)
if [[ -n $head && ${commit%-dirty} == "$head" ]]; then
  git -C "$ROOT" archive HEAD | tar -x -C "$tree"
  git -C "$ROOT" status --short >"$L/export.txt"
  echo "exported: git archive HEAD (uncommitted changes in this checkout, not exported, are listed above)" >>"$L/export.txt"
  commit=$head  # the archive holds HEAD's files alone
else
  tar -C "$ROOT" --exclude=./.git --exclude=./build --exclude=./.venv --exclude=./.whl --exclude=./.revs \
    --exclude=./.device --exclude=./_build --exclude=./dist --exclude=./COMMIT --exclude='__pycache__' \
    --exclude='*.pyc' --exclude='*.so' --exclude='*.egg-info' --exclude=.pytest_cache --exclude=.ruff_cache \
    -cf - . | tar -x -C "$tree"
  echo "exported: the tree's files without .git and without what .gitignore names (the checkout's HEAD:" \
       "${head:-none}; the tree's commit: $commit)" >"$L/export.txt"
fi
echo "$commit" >"$tree/COMMIT"
# The overlay's wheels, where they were carried: what the README tells a host without a registry to bring along
# (the main job and the overlay's test take upstream FastVideo from them). Nothing else ignored travels.
if [[ -d $ROOT/.whl/overlay ]]; then
  mkdir -p "$tree/.whl" && cp -r "$ROOT/.whl/overlay" "$tree/.whl/overlay"
  echo "carried: .whl/overlay ($(ls "$tree/.whl/overlay" | wc -l) files), the overlay's wheels" >>"$L/export.txt"
fi
{
  echo "commit $commit"
  (cd "$tree" && find . -type f | wc -l) | sed 's/^/files exported: /'
  ls -a "$tree"
} | tee -a "$L/export.txt"
{
  gpu_python '^(torch|safetensors|numpy|pytest|pytest-timeout|pytest-xdist|ruff|clang-format|matplotlib|ninja|nvidia-nccl)'
  timeout 15 "$python" -m pip download --no-deps --retries 0 --timeout 15 -d "$WORK/probe" nvidia-nccl-cu13==2.30.7 \
    >/dev/null 2>&1 \
    && echo "package registry: reachable" || echo "package registry: NOT reachable (pip download failed)"
  command -v nvcc || echo "nvcc: not on PATH"
  nproc
} >"$L/versions.log" 2>&1
cat "$L/versions.log"
cd "$tree" || exit 2
export FASTVIDEO_KERNEL_CACHE="$WORK/nccl-cache"
unset PYTHONPATH FASTVIDEO_KERNEL_LIBRARY FASTVIDEO_PYTHON FASTVIDEO_VENV FASTVIDEO_NO_INSTALL
if [[ $only != tests ]]; then
  step "README: bash scripts/run_demo.sh" 240 demo.log bash scripts/run_demo.sh
fi
if [[ $only != demo ]]; then
  step "README: bash scripts/run_tests.sh${FASTVIDEO_PYTEST_ARGS:+ (FASTVIDEO_PYTEST_ARGS=$FASTVIDEO_PYTEST_ARGS)}" \
    560 tests.log bash scripts/run_tests.sh
fi
find "$tree/build" -name '*.png' -exec cp {} "$WORK/" \; 2>/dev/null
plot=$(cd "$WORK" && ls -- *.png 2>/dev/null | head -n1)
gpu_finish logs/versions.log logs/demo.log logs/tests.log ${plot:+"$plot"}
