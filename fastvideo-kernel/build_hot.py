"""Build the fused call's hot-path extension (``csrc/ulysses_hot/hot_calls.cpp``) against the installed torch.

The kernel library (``build_lib.py``) is torch-independent; this one small extension is not: it reads a tensor's
metadata and allocates the output through torch's C++ API, so it is built per torch install, with torch's own
extension builder (ninja and a C++ compiler; CUDA's headers where torch has CUDA). Without it the fused route runs
as before, on the Python path (``fastvideo.distributed.ulysses.hot``).

    python fastvideo-kernel/build_hot.py --out build/kernel     # -> build/kernel/fastvideo_ulysses_hot*.so

``FASTVIDEO_KERNEL_HOT`` (the built file) or a build beside the kernel library (``FASTVIDEO_KERNEL_LIBRARY``'s
directory) is what the helper loads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

NAME = "fastvideo_ulysses_hot"
SOURCE = "hot_calls.cpp"


def csrc_root() -> Path:
    return Path(os.environ.get("FASTVIDEO_KERNEL_CSRC_ROOT") or Path(__file__).resolve().parent.parent / "csrc")


def built_arches(flags: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for the arches a torch build names (``"sm_80 sm_90a"`` -> ``"8.0;9.0a"``)."""
    arches = [re.fullmatch(r"(?:sm|compute)_(\d+)(\d)([a-z]?)", flag) for flag in flags.split()]
    return ";".join(dict.fromkeys(f"{m[1]}.{m[2]}{m[3]}" for m in arches if m))


def build(out: Path, *, verbose: bool = False) -> Path:
    """Compile the extension into ``out``; returns the built file. Raises SystemExit naming what is missing."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise SystemExit(f"build_hot: torch is needed to build the hot-path extension ({exc})") from exc
    if shutil.which("ninja") is None and shutil.which("ninja", path=str(Path(sys.executable).parent)) is None:
        raise SystemExit("build_hot: ninja is needed (pip install ninja)")
    root = csrc_root()
    source = root / "ulysses_hot" / SOURCE
    if not source.is_file():
        raise SystemExit(f"build_hot: {source} not found; build from the repository checkout")
    cuda = torch.version.cuda is not None
    home = cpp_extension.CUDA_HOME
    if cuda and not (home and Path(home, "include", "cuda_runtime_api.h").is_file()):
        raise SystemExit(f"build_hot: this torch has CUDA, and its builder's CUDA_HOME ({home}) has no "
                         "include/cuda_runtime_api.h: set CUDA_HOME to CUDA's toolkit (the directory with bin/nvcc)")
    if cuda and not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # The extension has no device code, but torch's builder asks the visible GPUs for an arch list and fails
        # on a host with none (a CUDA torch on a CPU node): name the arches this torch was built for instead.
        if arches := built_arches(torch._C._cuda_getArchFlags()):
            os.environ["TORCH_CUDA_ARCH_LIST"] = arches
    out.mkdir(parents=True, exist_ok=True)
    work = out / f"{NAME}.build"
    work.mkdir(exist_ok=True)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the venv's ninja
    start = time.monotonic()
    module = cpp_extension.load(name=NAME, sources=[str(source)], extra_include_paths=[str(root / "ulysses_a2a")],
                       extra_cflags=["-O2", *(["-DFVK_HOT_CUDA"] if cuda else [])], with_cuda=cuda,
                       build_directory=str(work), verbose=verbose, is_python_module=True)
    built = next(work.glob(f"{NAME}*.so"))
    target = out / built.name
    shutil.copy2(built, target)
    # What it was built against, read before loading it (an extension built for another torch may not import).
    record = {"file": built.name, "interface": module.INTERFACE, "torch": list(module.TORCH_VERSION),
              "cuda": bool(module.CUDA), "torch_version": torch.__version__}
    (out / f"{NAME}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"build_hot: {target} (torch {torch.__version__}, {'CUDA ' + torch.version.cuda if cuda else 'CPU'}) "
          f"in {time.monotonic() - start:.0f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/kernel"), help="output directory (build/kernel)")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    build(args.out, verbose=args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
