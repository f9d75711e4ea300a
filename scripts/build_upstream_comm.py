"""Build upstream's own Ulysses communication extension from the ``fastvideo-kernel==0.3.5`` sdist, alone, for the
transport benchmark's ``upstream-0.2.1`` peer (``benchmarks/cases/upstream_peer.py``).

    python scripts/build_upstream_comm.py --sdist .whl/fastvideo_kernel-0.3.5.tar.gz \\
        --wheel .whl/fastvideo-0.2.1-py3-none-any.whl --nccl-home NCCL --out OUT [--arch 90] [--compile-only]
    python scripts/build_upstream_comm.py --sdist SDIST --wheel WHEEL --sources-out .whl/upstream/upstream-comm-sources
    python scripts/build_upstream_comm.py --sources .whl/upstream/upstream-comm-sources --nccl-home NCCL --out OUT

The sdist builds one extension of every kernel (attention, GEMM, norms, quantisation, ThunderKittens); only its
communication part is built here: ``csrc/comm/ulysses_all_to_all.cu`` with ``include/comm/`` and a two-line
module definition written here that registers it (``register_ulysses_a2a``), as ``fastvideo_kernel_ops``, the
name upstream's ``comm_ops.py`` imports. Both archives are sha256-checked against their pins; neither is ever
part of this repository (they travel in the git-ignored ``.whl/``). ``OUT`` receives ``src/`` (the extracted
sources, ``comm_ops.py`` and upstream's ``ulysses_a2a.py`` from the wheel), ``build/fastvideo_kernel_ops*.so``
and ``build_info.json`` (the pins, where the sources came from, torch, NCCL, the extension's sha256).

The build uses four files of the two archives (46 MB together). ``--sources-out DIR`` writes those four, taken
from the pinned archives, with ``SOURCES.json`` (the archives' pinned sha256 and each file's sha256), and stops;
``--sources DIR`` builds from such a folder instead of the archives, after checking that its SOURCES.json names
the pinned archives and that every file still has the sha256 it records. SOURCES.json guards against a folder
from other archives or edited since; it is no signature (whoever edits a file can edit it too), so a folder is
made from the pinned archives by ``--sources-out``, never by hand.

The kernel needs NCCL 2.29 or later (its device-API initialisers, ``ncclCommQueryProperties``): ``--nccl-home`` is
an NCCL tree (``include/``, ``lib/``), e.g. the ``nvidia/nccl`` folder of an ``nvidia-nccl-cu13`` wheel or the tree
``scripts/build_nccl.sh`` packs, and the process that runs the extension must load that NCCL (``LD_PRELOAD`` its
``libnccl.so.2``; the build itself re-runs so, since it imports what it built), and torch must run on the same one,
since the extension is handed torch's communicator (``scripts/gpu_upstream_peer.sh`` arranges both). A tree with
``include/`` alone builds an extension that takes its NCCL symbols from the process at load time (torch's NCCL): it
loads only where that NCCL is 2.29 or later, and the load error names the missing symbol. ``--check-symbols LIB``
(repeatable): after the build, every NCCL symbol the compiled code needs (``nm``) must be defined by ``LIB`` (a
libnccl.so.2), or the run fails naming the missing ones; ``--symbols-only`` runs that check on an existing ``--out``
without building.
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
SDIST_NAME, WHEEL_NAME = "fastvideo_kernel-0.3.5.tar.gz", "fastvideo-0.2.1-py3-none-any.whl"
# Each file of src/ (and of a --sources-out folder): the archive and the path in it (the sdist's paths below its
# top folder).
SOURCES = {
    "ulysses_all_to_all.cu": ("sdist", "csrc/comm/ulysses_all_to_all.cu"),
    "include/comm/ulysses_all_to_all.cuh": ("sdist", "include/comm/ulysses_all_to_all.cuh"),
    "comm_ops.py": ("sdist", "python/fastvideo_kernel/comm_ops.py"),
    "ulysses_a2a.py": ("wheel", "fastvideo/distributed/device_communicators/ulysses_a2a.py"),
}
MANIFEST = "SOURCES.json"
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


def from_archives(sdist: Path, wheel: Path) -> dict[str, bytes]:
    """The files of ``SOURCES`` read from the (already checked) sdist and wheel."""
    files: dict[str, bytes] = {}
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
        for name, (archive, inner) in SOURCES.items():
            if archive != "sdist":
                continue
            if inner not in members:
                raise SystemExit(f"--sdist {sdist}: {inner} is missing (not fastvideo-kernel 0.3.5?)")
            files[name] = tar.extractfile(members[inner]).read()  # type: ignore[union-attr]
    with zipfile.ZipFile(wheel) as z:
        for name, (archive, inner) in SOURCES.items():
            if archive == "wheel":
                files[name] = z.read(inner)
    return files


def write_sources(files: dict[str, bytes], folder: Path) -> None:
    """``files`` and their SOURCES.json into ``folder`` (``--sources-out``)."""
    manifest = {"sdist": {"name": SDIST_NAME, "sha256": SDIST_SHA256},
                "wheel": {"name": WHEEL_NAME, "sha256": WHEEL_SHA256}, "files": {}}
    for name, data in files.items():
        archive, inner = SOURCES[name]
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        manifest["files"][name] = {"from": f"{archive}:{inner}", "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_sources(folder: Path) -> dict[str, bytes]:
    """The files of a ``--sources-out`` folder, after checking its SOURCES.json against the pins and every file
    against SOURCES.json (``--sources``)."""
    path = folder / MANIFEST
    remake = (f"remake the folder: --sdist {SDIST_NAME} --wheel {WHEEL_NAME} --sources-out {folder}")
    if not path.is_file():
        raise SystemExit(f"--sources {folder}: no {MANIFEST} ({remake})")
    try:
        manifest = json.loads(path.read_text())
        archives = {key: (manifest[key]["name"], manifest[key]["sha256"]) for key in ("sdist", "wheel")}
        recorded = {name: (entry["from"], entry["sha256"]) for name, entry in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(f"--sources {path}: not a {MANIFEST} of this script ({type(exc).__name__}: {exc}; "
                         f"{remake})") from None
    for key, pinned in (("sdist", (SDIST_NAME, SDIST_SHA256)), ("wheel", (WHEEL_NAME, WHEEL_SHA256))):
        if archives[key] != pinned:
            raise SystemExit(f"--sources {path}: its files come from the {key} {archives[key][0]} (sha256 "
                             f"{archives[key][1]}), not the pinned {pinned[0]} (sha256 {pinned[1]}); {remake}")
    if set(recorded) != set(SOURCES):
        raise SystemExit(f"--sources {path}: lists {sorted(recorded)}, not the files the build uses "
                         f"{sorted(SOURCES)}; {remake}")
    files: dict[str, bytes] = {}
    for name, (origin, want) in recorded.items():
        archive, inner = SOURCES[name]
        if origin != f"{archive}:{inner}":
            raise SystemExit(f"--sources {path}: {name} from {origin}, not {archive}:{inner}; {remake}")
        if not (folder / name).is_file():
            raise SystemExit(f"--sources {folder}: {name} is missing; {remake}")
        files[name] = (folder / name).read_bytes()
        got = hashlib.sha256(files[name]).hexdigest()
        if got != want:
            raise SystemExit(f"--sources {folder}: {name} has sha256 {got}, not the {want} {MANIFEST} records "
                             f"(changed since it was written; {remake})")
    return files


def write_src(files: dict[str, bytes], src: Path) -> None:
    """The sources and the module definition into ``src/`` (``src/<name>``, the header at ``src/include/comm/``)."""
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    (src / "binding.cpp").write_text(BINDING)


def _nm(args: list[str]) -> list[str]:
    """Symbol names from ``nm`` (the last field of each line, any ``@version`` dropped)."""
    proc = subprocess.run(["nm", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"nm {' '.join(args)} failed: {proc.stderr.strip()}")
    return [line.split()[-1].split("@")[0] for line in proc.stdout.splitlines() if line.strip()]


def needed_nccl_symbols(paths: list[Path]) -> list[str]:
    """The NCCL functions the compiled code calls: undefined ``nccl*`` symbols of objects or a shared library."""
    names: set[str] = set()
    for path in paths:
        names.update(_nm(["-D", "-u", str(path)] if ".so" in path.name else ["-u", str(path)]))
    return sorted(n for n in names if n.startswith("nccl"))


def check_symbols(paths: list[Path], libs: list[Path]) -> dict[str, dict]:
    """Per library: the NCCL symbols ``paths`` need and those it does not define (printed as well)."""
    needed = needed_nccl_symbols(paths)
    print(f"NCCL symbols needed by {', '.join(p.name for p in paths)} ({len(needed)}): {' '.join(needed)}")
    report = {}
    for lib in libs:
        if not lib.is_file():
            raise SystemExit(f"--check-symbols {lib}: no such file (a libnccl.so.2)")
        defined = set(_nm(["-D", "--defined-only", str(lib)]))
        missing = [n for n in needed if n not in defined]
        real = lib.resolve()
        report[str(lib)] = {"resolves_to": str(real), "needed": needed, "missing": missing}
        print(f"  {lib} ({real.name}): " + (f"all {len(needed)} defined" if not missing else
                                             f"{len(missing)} of {len(needed)} NOT defined: {' '.join(missing)}"))
    return report


def _built(build_dir: Path) -> list[Path]:
    """What an earlier run left to check: the extension, else the compiled objects."""
    found = sorted(build_dir.glob("fastvideo_kernel_ops*.so")) or sorted(build_dir.glob("*.o"))
    if not found:
        raise SystemExit(f"--symbols-only: no fastvideo_kernel_ops*.so or *.o in {build_dir} (build with --out first)")
    return found


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


def preloaded_env(nccl_home: Path, environ: dict[str, str]) -> dict[str, str] | None:
    """The environment in which the build loads ``nccl_home``'s libnccl.so.2 before torch's, or None where it
    already does (or the tree has headers only). Local, pure.

    torch's extension loader imports the module it has just built. A process that has loaded torch's own NCCL
    resolves the module's ``libnccl.so.2`` to that one (the same soname, whatever the rpath says), and the import
    fails on the first symbol torch's NCCL lacks; preloaded, the tree's library is the one it binds to.
    """
    lib = nccl_home / "lib" / "libnccl.so.2"
    if not lib.exists():
        return None
    current = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if any(Path(p).exists() and Path(p).resolve() == lib.resolve() for p in current):
        return None
    return {**environ, "LD_PRELOAD": ":".join([str(lib.resolve()), *current])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", type=Path, help=SDIST_NAME)
    parser.add_argument("--wheel", type=Path, help=WHEEL_NAME)
    parser.add_argument("--sources", type=Path, help="a --sources-out folder, instead of --sdist and --wheel")
    parser.add_argument("--sources-out", type=Path, help="with --sdist and --wheel: write the files the build uses "
                        "and their SOURCES.json into this folder, and stop")
    parser.add_argument("--nccl-home", type=Path, help="an NCCL 2.29+ tree (include/, lib/)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--arch", default="90", help="the SM architecture (default 90: H100/H200)")
    parser.add_argument("--compile-only", action="store_true", help="compile to objects and stop (no link)")
    parser.add_argument("--check-symbols", type=Path, action="append", default=[], metavar="LIB",
                        help="a libnccl.so.2 that must define every NCCL symbol the build needs (repeatable)")
    parser.add_argument("--symbols-only", action="store_true",
                        help="with --out and --check-symbols: check what an earlier run built there, build nothing")
    args = parser.parse_args(argv)
    if args.symbols_only:
        if args.out is None or not args.check_symbols:
            parser.error("--symbols-only needs --out (an earlier build) and at least one --check-symbols LIB")
        report = check_symbols(_built(args.out / "build"), args.check_symbols)
        return _symbols_verdict(report)
    archives = args.sdist is not None or args.wheel is not None
    if args.sources_out is not None:
        if args.sdist is None or args.wheel is None or args.sources is not None:
            parser.error("--sources-out takes the files from --sdist and --wheel (both, and not --sources)")
        _check(args.sdist, SDIST_SHA256, "--sdist")
        _check(args.wheel, WHEEL_SHA256, "--wheel")
        args.sources_out.mkdir(parents=True, exist_ok=True)
        write_sources(from_archives(args.sdist, args.wheel), args.sources_out)
        print(f"build_upstream_comm: {len(SOURCES)} files and {MANIFEST} in {args.sources_out}")
        return 0
    if archives == (args.sources is not None) or (archives and (args.sdist is None or args.wheel is None)):
        parser.error("the sources: --sdist and --wheel, or --sources DIR (a --sources-out folder), one way of the two")
    if args.nccl_home is None or args.out is None:
        parser.error("a build needs --nccl-home (an NCCL 2.29+ tree) and --out (its folder)")
    if archives:
        _check(args.sdist, SDIST_SHA256, "--sdist")
        _check(args.wheel, WHEEL_SHA256, "--wheel")
    if not (args.nccl_home / "include" / "nccl_device.h").is_file():
        raise SystemExit(f"--nccl-home {args.nccl_home}: no include/nccl_device.h (an NCCL 2.29+ tree is needed)")
    version = nccl_version(args.nccl_home)
    if tuple(int(v) for v in version.split(".")[:2] if v.isdigit()) < (2, 29):
        raise SystemExit(f"--nccl-home {args.nccl_home}: NCCL {version}; upstream's kernel needs 2.29 or later")
    env = None if args.compile_only else preloaded_env(args.nccl_home, dict(os.environ))
    if env is not None:
        print(f"build_upstream_comm: re-run with LD_PRELOAD={env['LD_PRELOAD']} (the build imports what it built, "
              "which must bind to this NCCL, not torch's)", flush=True)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__),
                                   *(sys.argv[1:] if argv is None else argv)], env)
    files = from_archives(args.sdist, args.wheel) if archives else read_sources(args.sources)
    src, build_dir = args.out / "src", args.out / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    write_src(files, src)
    start = time.time()
    import torch

    info = {"sdist": {"name": SDIST_NAME, "sha256": SDIST_SHA256},
            "wheel": {"name": WHEEL_NAME, "sha256": WHEEL_SHA256},
            "sources": ({"way": "archives", "sdist": str(args.sdist), "wheel": str(args.wheel)} if archives else
                        {"way": f"extracted folder ({MANIFEST} checked against the pins)", "path": str(args.sources)}),
            "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
            "nccl": version, "nccl_home": str(args.nccl_home),
            "nccl_link": ("linked to its lib/libnccl.so.2" if (args.nccl_home / "lib" / "libnccl.so.2").exists()
                          else "headers only: NCCL symbols from the process at load time"),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "arch": args.arch, "compile_only": args.compile_only}
    if args.compile_only:
        compile_only(src, build_dir, args.nccl_home, args.arch)
        compiled = sorted(build_dir.glob("*.o"))
    else:
        so = build(src, build_dir, args.nccl_home, args.arch)
        info["extension"] = {"path": str(so), "sha256": _sha256(so)}
        compiled = [so]
    info["seconds"] = round(time.time() - start, 1)
    if args.check_symbols:
        info["symbols"] = check_symbols(compiled, args.check_symbols)
    (args.out / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    verdict = _symbols_verdict(info.get("symbols", {}))
    print(f"build_upstream_comm: {'OK' if verdict == 0 else 'symbols missing'} "
          f"({'compiled' if args.compile_only else 'built'} in {info['seconds']} s, NCCL {version}, "
          f"torch {torch.__version__}, sources from {info['sources']['way'].split(' ')[0]}): {args.out}")
    return verdict


def _symbols_verdict(report: dict[str, dict]) -> int:
    """0 where every checked library defines every needed symbol; else 1, naming them."""
    bad = {lib: r["missing"] for lib, r in report.items() if r["missing"]}
    for lib, missing in bad.items():
        print(f"build_upstream_comm: {lib} lacks {' '.join(missing)}: the extension would not load with it "
              "(an NCCL 2.29+ is needed: LD_PRELOAD its libnccl.so.2)", file=sys.stderr)
    return 1 if bad else 0

if __name__ == "__main__":
    sys.exit(main())
