#!/usr/bin/env bash
# NCCL built from source for one SM architecture and packed small enough to carry to an offline GPU host, for
# upstream's fused route (scripts/gpu_upstream_peer.sh needs an NCCL 2.29+; the nvidia-nccl wheel, every
# architecture, is some 200 MB):
#
#   bash scripts/build_nccl.sh --source DIR --arch 90 --out .whl/upstream/nccl-2.30.7-sm90.tar.xz
#
# DIR: a checkout of https://github.com/NVIDIA/nccl (tag v2.30.7-1 for the file name above). Runs NCCL's
# `make src.build` for that architecture alone, unless DIR/build/lib/libnccl.so.2 is already the source's version;
# the tar.xz holds include/ and lib/libnccl.so* (the stripped library and its two links), the tree that
# `build_upstream_comm.py --nccl-home` and `fastvideo-kernel/build_lib.py --nccl-home` take. CUDA: $CUDA_HOME,
# else where nvcc says it runs from (nvcc may be a wrapper script, so its own path proves nothing), else
# /usr/local/cuda. JOBS (default: the cores + 1) sets make's parallelism. The library is linked against this
# machine's glibc and libstdc++ (the versions it needs are printed at the end): build it on a system no newer than
# the GPU host's.
set -euo pipefail

usage() {
  echo "usage: bash scripts/build_nccl.sh --source DIR --arch SM --out FILE.tar.xz" >&2
  exit 2
}
die() {
  echo "build_nccl.sh: $*" >&2
  exit 1
}

source_dir="" arch="" out=""
while (($#)); do
  case $1 in
    --source | --arch | --out)
      (($# >= 2)) || die "$1 needs a value"
      case $1 in --source) source_dir=$2 ;; --arch) arch=$2 ;; --out) out=$2 ;; esac
      shift 2
      ;;
    -h | --help) usage ;;
    *) die "unknown argument $1 (see the head of this script)" ;;
  esac
done
[[ -n $source_dir ]] || die "--source DIR is required: a checkout of https://github.com/NVIDIA/nccl (e.g. tag v2.30.7-1)"
[[ -n $arch ]] || die "--arch is required: the SM version, e.g. --arch 90 for H100/H200"
[[ -n $out ]] || die "--out is required: the archive to write, e.g. .whl/upstream/nccl-2.30.7-sm90.tar.xz"
[[ $arch =~ ^[0-9]+[a-z]?$ ]] || die "--arch $arch: an SM version such as 90 or 100a, without sm_"
[[ $out == *.tar.xz ]] || die "--out $out: the archive is a .tar.xz"
[[ -d $source_dir ]] || die "--source $source_dir does not exist (clone https://github.com/NVIDIA/nccl, tag v2.30.7-1)"
version_mk="$source_dir/makefiles/version.mk"
[[ -f $version_mk && -f $source_dir/src/Makefile ]] ||
  die "--source $source_dir: no makefiles/version.mk or src/Makefile (not an NCCL checkout)"

# The source's version, as its makefiles set it.
mk_field() { sed -n "s/^$1 *:= *\([0-9]*\).*/\1/p" "$version_mk"; }
version="$(mk_field NCCL_MAJOR).$(mk_field NCCL_MINOR).$(mk_field NCCL_PATCH)"
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--source $source_dir: cannot read the version from $version_mk"
IFS=. read -r major minor _ <<<"$version"
((major > 2 || (major == 2 && minor >= 29))) ||
  die "--source $source_dir is NCCL $version; upstream's kernel needs 2.29 or later (check out v2.30.7-1)"

cuda_home() {
  if [[ -n ${CUDA_HOME:-} ]]; then
    echo "$CUDA_HOME"
    return
  fi
  # nvcc reports the folder its real binary runs from (_HERE_), through any wrapper or link.
  local here
  here=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n1) || true
  if [[ -n $here && -x $here/nvcc ]]; then
    (cd "$here/.." && pwd)
    return
  fi
  local nvcc_path
  nvcc_path=$(command -v nvcc 2>/dev/null) && nvcc_path=$(readlink -f "$nvcc_path") &&
    [[ $(head -c 4 "$nvcc_path") == $'\x7fELF' ]] && {
    (cd "$(dirname "$nvcc_path")/.." && pwd)
    return
  }
  echo /usr/local/cuda
}
CUDA_HOME=$(cuda_home)
[[ -x $CUDA_HOME/bin/nvcc ]] || die "no nvcc at $CUDA_HOME/bin/nvcc: set CUDA_HOME to the CUDA toolkit's root"
echo "NCCL $version from $source_dir, sm_$arch, CUDA $CUDA_HOME"

build="$source_dir/build"
built_version=""
if [[ -e $build/lib/libnccl.so.2 ]]; then
  real=$(readlink -f "$build/lib/libnccl.so.2")
  built_version=${real##*/libnccl.so.}
fi
# NCCL's objects do not depend on the gencode flags, so an existing build of another architecture would be
# relinked as it is: the architecture a build was made for is recorded beside it and must match.
stamp="$build/BUILT_FOR_ARCH"
if [[ $built_version == "$version" ]]; then
  if [[ -f $stamp && $(cat "$stamp") != "$arch" ]]; then
    die "$build was built for sm_$(cat "$stamp"), not sm_$arch: run 'make -C $source_dir clean' first"
  fi
  if [[ -f $stamp ]]; then
    echo "already built for sm_$arch: $build/lib/libnccl.so.$version; make skipped"
  else
    echo "already built (its architecture not recorded: built outside this script; sm_$arch assumed):" \
      "$build/lib/libnccl.so.$version; make skipped"
  fi
else
  [[ -z $built_version ]] || die "$build holds NCCL $built_version, not the source's $version: run 'make -C $source_dir clean'"
  jobs=${JOBS:-$(($(nproc) + 1))}
  start=$SECONDS
  make -C "$source_dir" -j"$jobs" src.build NVCC_GENCODE="-gencode=arch=compute_$arch,code=sm_$arch" \
    CUDA_HOME="$CUDA_HOME"
  echo "$arch" >"$stamp"
  echo "built in $((SECONDS - start)) s"
fi

header="$build/include/nccl.h"
[[ -f $header ]] || die "$header is missing after the build"
h_field() { sed -n "s/^#define $1 *\([0-9]*\).*/\1/p" "$header"; }
header_version="$(h_field NCCL_MAJOR).$(h_field NCCL_MINOR).$(h_field NCCL_PATCH)"
[[ $header_version == "$version" ]] || die "$header says NCCL $header_version, the source $version"
lib_real="$build/lib/libnccl.so.$version"
[[ -f $lib_real ]] || die "$lib_real is missing after the build"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
cp -r "$build/include" "$stage/include"
cp "$lib_real" "$stage/lib/"
strip --strip-unneeded "$stage/lib/libnccl.so.$version"
ln -s "libnccl.so.$version" "$stage/lib/libnccl.so.2"
ln -s libnccl.so.2 "$stage/lib/libnccl.so"
mkdir -p "$(dirname "$out")"
# Fixed owner, order and times: the same build packs to the same bytes.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$stage" -cf - include lib |
  xz -T0 -6 >"$out.tmp"
mv "$out.tmp" "$out"
echo "NCCL $header_version (nccl.h), sm_$arch: $out, $(du -h "$out" | cut -f1)" \
  "($(stat -c %s "$out") bytes; the stripped library $(du -h "$stage/lib/libnccl.so.$version" | cut -f1))"
# The library runs only where the system's glibc and libstdc++ are at least the ones it was linked against.
if command -v objdump >/dev/null; then
  needs=$(objdump -T "$stage/lib/libnccl.so.$version" | { grep -o 'GLIBC_[0-9.]*\|GLIBCXX_[0-9.]*' || true; } |
    sort -uV | awk -F_ '{last[$1] = $0} END {print last["GLIBC"], last["GLIBCXX"]}')
  echo "the host needs at least: $needs (those of this machine's system libraries)"
fi
