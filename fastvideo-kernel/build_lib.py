"""Compile the fastvideo-kernel native library with nvcc: the one place that knows the build command.

Used by ``setup.py`` (the wheel) and by ``scripts/build_kernel.sh`` (CI builds against pinned NCCL
releases). No torch and no CMake needed: one nvcc call (the kernel's .cu and the host-only vote's .cpp).

    python fastvideo-kernel/build_lib.py --out build/kernel [--nccl-home DIR] [--archs 90,100]

Environment: ``NCCL_HOME`` (a dir with include/nccl.h and lib/libnccl.so.2; default: the installed
``nvidia-nccl-cu*`` wheel), ``FASTVIDEO_KERNEL_CUDA_ARCHS`` (comma/semicolon list of SM versions,
default ``90``), ``FASTVIDEO_KERNEL_CSRC`` (the sources, default ``../csrc/ulysses_a2a``), ``NVCC``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

LIBRARY_NAME = "libfastvideo_ulysses_a2a.so"
SOURCES = ("ulysses_a2a.cu", "shm_vote.cpp", "sync_model.cpp", "ce_sync_model.cpp")  # .cpp: host-only C++
DEFAULT_ARCHS = "90"


def csrc_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / "csrc" / "ulysses_a2a"
    path = Path(os.environ.get("FASTVIDEO_KERNEL_CSRC") or default)
    if not (path / SOURCES[0]).is_file():
        raise SystemExit(f"fastvideo-kernel: sources not found in {path}; build from the repository checkout "
                         "(pip builds local directories in place) or set FASTVIDEO_KERNEL_CSRC")
    return path


def nccl_home(explicit: str | None = None) -> Path:
    """NCCL's include/ and lib/ root: an explicit dir, $NCCL_HOME, or the installed nvidia-nccl wheel."""
    root = explicit or os.environ.get("NCCL_HOME")
    if not root:
        spec = importlib.util.find_spec("nvidia.nccl")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("fastvideo-kernel: NCCL not found; install nvidia-nccl-cu13 (torch's) or set NCCL_HOME")
        root = next(iter(spec.submodule_search_locations))
    path = Path(root)
    if not (path / "include" / "nccl_device.h").is_file() or not (path / "lib" / "libnccl.so.2").is_file():
        raise SystemExit(f"fastvideo-kernel: {path} lacks include/nccl_device.h or lib/libnccl.so.2 "
                         "(NCCL >= 2.28 needed)")
    return path


def nccl_header_version(home: Path) -> str:
    text = (home / "include" / "nccl.h").read_text()
    parts = [re.search(rf"#define NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


def archs(explicit: str | None = None) -> list[str]:
    value = explicit or os.environ.get("FASTVIDEO_KERNEL_CUDA_ARCHS") or DEFAULT_ARCHS
    result = [a.strip().removeprefix("sm_") for a in re.split(r"[,;\s]+", value) if a.strip()]
    if not result or not all(re.fullmatch(r"\d+[a-z]?", a) for a in result):
        raise SystemExit(f"fastvideo-kernel: bad FASTVIDEO_KERNEL_CUDA_ARCHS={value!r}; e.g. '90' or '90,100'")
    return result


def nvcc() -> str:
    found = os.environ.get("NVCC") or shutil.which("nvcc")
    if not found and os.environ.get("CUDA_HOME"):
        found = str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    if not found or not Path(found).exists():
        raise SystemExit("fastvideo-kernel: nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)")
    return found


def build(out_dir: Path, nccl: str | None = None, arch_list: str | None = None) -> Path:
    """Compile the library into ``out_dir``; print a summary; return the library's path."""
    src, home, sm, compiler = csrc_dir(), nccl_home(nccl), archs(arch_list), nvcc()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    lib = home / "lib"
    cmd = [compiler, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden",
           *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in sm),
           f"-I{home / 'include'}", *(str(src / s) for s in SOURCES), "-o", str(target),
           f"-L{lib}", "-l:libnccl.so.2", "-ldl", "-lrt",
           # Installed wheel: fastvideo_kernel/lib -> site-packages/nvidia/nccl/lib. Build dir: absolute.
           "-Xlinker", "-rpath,$ORIGIN/../../nvidia/nccl/lib", "-Xlinker", f"-rpath,{lib.resolve()}"]
    start = time.monotonic()
    print("fastvideo-kernel build:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"fastvideo-kernel build summary: {target} ({target.stat().st_size} bytes) in "
          f"{time.monotonic() - start:.1f} s; nvcc: {version[-1] if version else '?'}; "
          f"NCCL headers {nccl_header_version(home)} from {home}; archs {','.join('sm_' + a for a in sm)}", flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output directory for the library")
    parser.add_argument("--nccl-home", help="NCCL root (include/, lib/); default $NCCL_HOME or the nvidia-nccl wheel")
    parser.add_argument("--archs", help="SM versions, e.g. 90 or 90,100 (default $FASTVIDEO_KERNEL_CUDA_ARCHS or 90)")
    args = parser.parse_args(argv)
    build(args.out, args.nccl_home, args.archs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
