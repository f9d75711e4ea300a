"""Build upstream's own Ulysses communication extension from the ``fastvideo-kernel==0.3.5`` sdist, alone, for the
transport benchmark's ``upstream-0.2.1`` peer (``benchmarks/cases/upstream_peer.py``).

    python scripts/build_upstream_comm.py --sdist .whl/fastvideo_kernel-0.3.5.tar.gz \\
        --wheel .whl/fastvideo-0.2.1-py3-none-any.whl --nccl-home NCCL --out OUT [--arch 90] [--compile-only]

The sdist builds one extension of every kernel (attention, GEMM, norms, quantisation, ThunderKittens); only its
communication part is built here: ``csrc/comm/ulysses_all_to_all.cu`` with ``include/comm/`` and a two-line
module definition written here that registers it (``register_ulysses_a2a``), as ``fastvideo_kernel_ops``, the
name upstream's ``comm_ops.py`` imports. Both archives are sha256-checked against their pins; neither is ever
part of this repository (they travel in the git-ignored ``.whl/``). ``OUT`` receives ``src/`` (the extracted
sources, ``comm_ops.py`` and upstream's ``ulysses_a2a.py`` from the wheel), ``build/fastvideo_kernel_ops*.so``
and ``build_info.json`` (the pins, torch, NCCL, the extension's sha256).

The kernel needs NCCL 2.29 or later (its device-API initialisers, ``ncclCommQueryProperties``): ``--nccl-home``
is an NCCL tree (``include/``, ``lib/``), e.g. the ``nvidia/nccl`` folder of an ``nvidia-nccl-cu13`` wheel, and the
process that runs the extension must load that NCCL (``LD_PRELOAD`` its ``libnccl.so.2``; torch then uses it too).
A tree with ``include/`` alone builds an extension that takes its NCCL symbols from the process at load time
(torch's NCCL): it loads only where that NCCL is 2.29 or later, and the load error names the missing symbol.
``--compile-only``: compile both sources to objects with nvcc and stop (no CUDA torch needed to link; where the
installed torch is a CPU build, the one generated header it lacks, ``c10/cuda/impl/cuda_cmake_macros.h``, is
supplied in the build folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

SDIST_SHA256 = "f2c865cde78d6b218ca4f8695cad96464d79d73f144f142f51bba0920976dcb4"  # fastvideo_kernel-0.3.5.tar.gz
WHEEL_SHA256 = "47e97668dc7b9f3fdeef7f2790e8057646913d344b79d0ff807a0ddcf9e68738"  # fastvideo-0.2.1 wheel
SDIST_FILES = ("csrc/comm/ulysses_all_to_all.cu", "include/comm/ulysses_all_to_all.cuh",
               "python/fastvideo_kernel/comm_ops.py")
WHEEL_FILE = "fastvideo/distributed/device_communicators/ulysses_a2a.py"
BINDING = """#include <torch/extension.h>
void register_ulysses_a2a(pybind11::module_ &);
PYBIND11_MODULE(fastvideo_kernel_ops, m) { register_ulysses_a2a(m); }
"""
CMAKE_MACROS = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check(path: Path, want: str, what: str) -> None:
    if not path.is_file():
        raise SystemExit(f"{what}: {path} does not exist (fetch it into .whl/ on a machine with a registry)")
    got = _sha256(path)
    if got != want:
        raise SystemExit(f"{what}: {path} has sha256 {got}, not the pinned {want}")


def extract(sdist: Path, wheel: Path, src: Path) -> None:
    """The three sdist files and upstream's ulysses_a2a.py into ``src/`` (flattened to ``src/<name>``, the
    header kept at ``src/include/comm/``)."""
    src.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
        for name in SDIST_FILES:
            if name not in members:
                raise SystemExit(f"--sdist {sdist}: {name} is missing (not fastvideo-kernel 0.3.5?)")
            data = tar.extractfile(members[name]).read()  # type: ignore[union-attr]
            to = src / name if name.startswith("include/") else src / Path(name).name
            to.parent.mkdir(parents=True, exist_ok=True)
            to.write_bytes(data)
    with zipfile.ZipFile(wheel) as z:
        (src / "ulysses_a2a.py").write_bytes(z.read(WHEEL_FILE))
    (src / "binding.cpp").write_text(BINDING)


def nccl_version(nccl_home: Path) -> str:
    header = (nccl_home / "include" / "nccl.h").read_text()
    fields = {}
    for key in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"):
        line = next((ln for ln in header.splitlines() if ln.startswith(f"#define {key} ")), None)
        fields[key] = line.split()[2] if line else "?"
    return ".".join(fields.values())


def compile_only(src: Path, build: Path, nccl_home: Path, arch: str) -> None:
    """nvcc -c of both sources against the installed torch's headers."""
    import torch.utils.cpp_extension as ext

    stub = build / "stub"
    (stub / "c10/cuda/impl").mkdir(parents=True, exist_ok=True)
    torch_inc = Path(ext.include_paths()[0])
    if not (torch_inc / "c10/cuda/impl/cuda_cmake_macros.h").exists():
        (stub / "c10/cuda/impl/cuda_cmake_macros.h").write_text(CMAKE_MACROS)
    includes = [src / "include", stub, *map(Path, ext.include_paths()), Path(sysconfig.get_paths()["include"]),
                nccl_home / "include"]
    flags = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-DTORCH_EXTENSION_NAME=fastvideo_kernel_ops",
             "-DTORCH_API_INCLUDE_EXTENSION_H", "--expt-relaxed-constexpr", *(f"-I{p}" for p in includes)]
    for source, obj in ((src / "ulysses_all_to_all.cu", "ulysses_all_to_all.o"), (src / "binding.cpp", "binding.o")):
        cmd = ["nvcc", "-c", str(source), "-o", str(build / obj), *flags]
        if source.suffix == ".cu":
            cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        else:
            cmd += ["-x", "cu"]  # one compiler for both (nvcc passes host code to the host compiler)
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def build(src: Path, build_dir: Path, nccl_home: Path, arch: str) -> Path:
    """The extension, linked against torch (CUDA) and ``nccl_home``'s libnccl.so.2 (rpath to it)."""
    from torch.utils.cpp_extension import load

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{arch[0]}.{arch[1:]}")
    lib = nccl_home / "lib"
    # Headers only: leave the NCCL symbols to the process (torch's libnccl), resolved when the module loads.
    ldflags = [f"-L{lib}", "-l:libnccl.so.2", f"-Wl,-rpath,{lib}"] if (lib / "libnccl.so.2").exists() else []
    load(name="fastvideo_kernel_ops", sources=[str(src / "binding.cpp"), str(src / "ulysses_all_to_all.cu")],
         extra_include_paths=[str(src / "include"), str(nccl_home / "include")],
         extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"],
         extra_ldflags=ldflags,
         build_directory=str(build_dir), verbose=True, is_python_module=True)
    found = sorted(build_dir.glob("fastvideo_kernel_ops*.so"))
    if not found:
        raise SystemExit(f"no fastvideo_kernel_ops*.so in {build_dir} after the build")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", type=Path, required=True, help="fastvideo_kernel-0.3.5.tar.gz")
    parser.add_argument("--wheel", type=Path, required=True, help="fastvideo-0.2.1-py3-none-any.whl")
    parser.add_argument("--nccl-home", type=Path, required=True, help="an NCCL 2.29+ tree (include/, lib/)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", default="90", help="the SM architecture (default 90: H100/H200)")
    parser.add_argument("--compile-only", action="store_true", help="compile to objects and stop (no link)")
    args = parser.parse_args(argv)
    _check(args.sdist, SDIST_SHA256, "--sdist")
    _check(args.wheel, WHEEL_SHA256, "--wheel")
    if not (args.nccl_home / "include" / "nccl_device.h").is_file():
        raise SystemExit(f"--nccl-home {args.nccl_home}: no include/nccl_device.h (an NCCL 2.29+ tree is needed)")
    version = nccl_version(args.nccl_home)
    if tuple(int(v) for v in version.split(".")[:2] if v.isdigit()) < (2, 29):
        raise SystemExit(f"--nccl-home {args.nccl_home}: NCCL {version}; upstream's kernel needs 2.29 or later")
    src, build_dir = args.out / "src", args.out / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    extract(args.sdist, args.wheel, src)
    start = time.time()
    import torch

    info = {"sdist": {"path": str(args.sdist), "sha256": SDIST_SHA256},
            "wheel": {"path": str(args.wheel), "sha256": WHEEL_SHA256}, "nccl": version,
            "nccl_home": str(args.nccl_home),
            "nccl_link": ("linked to its lib/libnccl.so.2" if (args.nccl_home / "lib" / "libnccl.so.2").exists()
                          else "headers only: NCCL symbols from the process at load time"),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "arch": args.arch, "compile_only": args.compile_only}
    if args.compile_only:
        compile_only(src, build_dir, args.nccl_home, args.arch)
    else:
        so = build(src, build_dir, args.nccl_home, args.arch)
        info["extension"] = {"path": str(so), "sha256": _sha256(so)}
    info["seconds"] = round(time.time() - start, 1)
    (args.out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"build_upstream_comm: OK ({'compiled' if args.compile_only else 'built'} in {info['seconds']} s, "
          f"NCCL {version}, torch {torch.__version__}): {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
