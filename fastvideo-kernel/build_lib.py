"""Compile the fastvideo-kernel native libraries with nvcc: the one place that knows the build command.

Used by ``setup.py`` (the wheel: the product library only) and by ``scripts/build_kernel.sh`` (CI builds
against pinned NCCL releases: both). No torch and no CMake needed: nvcc compiles each source once and links
the product library (``libfastvideo_ulysses_a2a.so``: ``PRODUCT_SOURCES``) and, with ``--testing``, the test
library beside it (``libfastvideo_ulysses_a2a_testing.so``: the same product objects plus ``TESTING_SOURCES``,
csrc/ulysses_a2a/testing/).

    python fastvideo-kernel/build_lib.py --out build/kernel [--testing] [--nccl-home DIR] [--archs 90,100]

Environment: ``NCCL_HOME`` (a dir with include/nccl.h and lib/libnccl.so.2; default: the installed
``nvidia-nccl-cu*`` wheel), ``FASTVIDEO_KERNEL_CUDA_ARCHS`` (comma/semicolon list of SM versions,
default ``90``), ``FASTVIDEO_KERNEL_CSRC`` (the sources, default ``../csrc/ulysses_a2a``), ``NVCC``,
``FASTVIDEO_KERNEL_BUILD_JOBS`` (parallel compiles, default up to 4).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LIBRARY_NAME = "libfastvideo_ulysses_a2a.so"
TESTING_LIBRARY_NAME = "libfastvideo_ulysses_a2a_testing.so"
# The product library, the one the wheel ships: the context, both plan kinds' kernels, fvk_launch, the vote.
PRODUCT_SOURCES = ("context.cu", "ulysses_a2a.cu", "shm_vote.cpp")  # .cpp: host-only C++
# The test library: the same product objects plus the test and measurement code (csrc/ulysses_a2a/testing/).
TESTING_SOURCES = ("testing/checked_launch.cu", "testing/sim_ranks.cu", "testing/fabric_copy.cu",
                   "testing/addressing.cu", "testing/sync_model.cu", "testing/ce_sync_model.cpp")
DEFAULT_ARCHS = "90"


def csrc_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / "csrc" / "ulysses_a2a"
    path = Path(os.environ.get("FASTVIDEO_KERNEL_CSRC") or default)
    if not (path / PRODUCT_SOURCES[0]).is_file():
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


def _compile_all(compiler: str, flags: list[str], src: Path, names: list[str], obj_dir: Path,
                 jobs: int) -> dict[str, Path]:
    """Compile every source once (both libraries link the same product objects); compilers' output is printed
    per source, so that warnings are seen."""
    obj_dir.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> tuple[str, Path, subprocess.CompletedProcess]:
        obj = obj_dir / (name.replace("/", "_") + ".o")
        cmd = [compiler, *flags, "-c", str(src / name), "-o", str(obj)]
        return name, obj, subprocess.run(cmd, capture_output=True, text=True)

    objects: dict[str, Path] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, obj, done in pool.map(one, names):
            output = (done.stdout + done.stderr).strip()
            print(f"fastvideo-kernel compile {name}: rc={done.returncode}" + (f"\n{output}" if output else ""),
                  flush=True)
            if done.returncode:
                raise SystemExit(f"fastvideo-kernel: compiling {name} failed")
            objects[name] = obj
    return objects


def _link(compiler: str, objects: dict[str, Path], out_dir: Path, lib: Path, testing: bool) -> list[Path]:
    """Link the product library, and with ``testing`` the test library, from the compiled objects."""
    link = [f"-L{lib}", "-l:libnccl.so.2", "-ldl", "-lrt",
            # Installed wheel: fastvideo_kernel/lib -> site-packages/nvidia/nccl/lib. Build dir: absolute.
            "-Xlinker", "-rpath,$ORIGIN/../../nvidia/nccl/lib", "-Xlinker", f"-rpath,{lib.resolve()}"]
    targets = [(out_dir / LIBRARY_NAME, PRODUCT_SOURCES)]
    if testing:
        targets.append((out_dir / TESTING_LIBRARY_NAME, PRODUCT_SOURCES + TESTING_SOURCES))
    for target, sources in targets:
        cmd = [compiler, "-shared", *(str(objects[s]) for s in sources), "-o", str(target), *link]
        print("fastvideo-kernel link:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return [target for target, _ in targets]


def build(out_dir: Path, nccl: str | None = None, arch_list: str | None = None, *, testing: bool = False,
          jobs: int | None = None) -> list[Path]:
    """Compile the product library into ``out_dir`` (and, with ``testing``, the test library beside it); print a
    summary; return the libraries' paths."""
    src, home, sm, compiler = csrc_dir(), nccl_home(nccl), archs(arch_list), nvcc()
    jobs = jobs or int(os.environ.get("FASTVIDEO_KERNEL_BUILD_JOBS") or min(4, os.cpu_count() or 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = home / "lib"
    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden",
             *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in sm), f"-I{home / 'include'}"]
    start = time.monotonic()
    names = list(PRODUCT_SOURCES) + (list(TESTING_SOURCES) if testing else [])
    with tempfile.TemporaryDirectory(prefix="fastvideo-kernel-obj-") as obj_dir:  # nothing but libraries in out_dir
        objects = _compile_all(compiler, flags, src, names, Path(obj_dir), jobs)
        targets = _link(compiler, objects, out_dir, lib, testing)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    built = ", ".join(f"{t} ({t.stat().st_size} bytes)" for t in targets)
    print(f"fastvideo-kernel build summary: {built} in {time.monotonic() - start:.1f} s ({jobs} jobs); "
          f"nvcc: {version[-1] if version else '?'}; NCCL headers {nccl_header_version(home)} from {home}; "
          f"archs {','.join('sm_' + a for a in sm)}", flush=True)
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output directory for the library")
    parser.add_argument("--nccl-home", help="NCCL root (include/, lib/); default $NCCL_HOME or the nvidia-nccl wheel")
    parser.add_argument("--archs", help="SM versions, e.g. 90 or 90,100 (default $FASTVIDEO_KERNEL_CUDA_ARCHS or 90)")
    parser.add_argument("--testing", action="store_true",
                        help=f"also build the test library ({TESTING_LIBRARY_NAME}) beside the product one")
    parser.add_argument("--jobs", type=int, help="parallel compiles (default $FASTVIDEO_KERNEL_BUILD_JOBS or <= 4)")
    args = parser.parse_args(argv)
    build(args.out, args.nccl_home, args.archs, testing=args.testing, jobs=args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
