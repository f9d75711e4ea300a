"""The header every run prints and writes: what exactly ran, where and when.

``date`` (UTC), ``gpu``, ``torch``, ``nccl``, ``commit`` of the tree under test (``describe_commit``: its ``COMMIT``
stamp or git; ``commit_note`` says which was recorded where the two disagree), ``native_library`` (path and SHA-256
of the kernel library the process mapped, or None), ``command`` (the exact command line), the line-up, every
``FASTVIDEO_*`` variable set, and what the case adds.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

from benchmarks.harness import lineup, product
from benchmarks.harness.commit import describe_commit, tree_commit
from benchmarks.harness.process import COMMAND_ENV, command_line
from benchmarks.harness.tree import BENCH_ROOT

SCHEMA = "fastvideo-bench/1"
# Present in every header (tests/test_benchmarks_cpu.py and check_results.py rely on them).
REQUIRED = ("schema", "case", "date", "gpu", "device", "sp_size", "torch", "nccl", "commit", "native_library",
            "command", "argv", "lineup", "complete")


def fastvideo_tree() -> Path:
    import fastvideo

    return Path(fastvideo.__file__).resolve().parent.parent


def _library_version(path: str) -> str:
    """What ``ncclGetVersion`` of the library at ``path`` reports, as ``major.minor.patch``."""
    import ctypes

    code = ctypes.c_int()
    if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) != 0:
        return "?"
    v = code.value
    major, minor = (v // 10000, v // 100 % 100) if v >= 10000 else (v // 1000, v // 100 % 10)
    return f"{major}.{minor}.{v % 100}"


def nccl_libraries() -> dict[str, str]:
    """Every libnccl file mapped into this process, with its own version: ``{path: "2.30.7"}``. Local."""
    from fastvideo.distributed.ulysses.nccl_runtime import nccl_libraries_mapped

    with open("/proc/self/maps") as maps:
        return {path: _library_version(path) for path in sorted(nccl_libraries_mapped(maps.read()))}


def describe_nccl(built: str, loaded: list[str]) -> str:
    """The header's ``nccl``: the version the process runs. ``torch.cuda.nccl.version()`` is the one torch was
    built against; a preloaded library (an NCCL 2.29+ for upstream's kernel) runs in its place. Pure."""
    running = sorted(set(loaded))
    if not running or running == [built]:
        return built
    return f"{' + '.join(running)} (torch built against {built})"


def nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build or a broken NCCL: report it as missing
        return None
    built = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    return describe_nccl(built, list(nccl_libraries().values()))


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def mapped_libraries(*needles: str) -> list[str]:
    """Shared objects this process has mapped whose file name contains one of ``needles`` (lower case)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                path = parts[-1] if len(parts) >= 6 else ""
                name = os.path.basename(path).lower()
                if (path.endswith(".so") or ".so." in path) and any(n in name for n in needles) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def native_library(helper=None) -> dict | None:
    """Path and SHA-256 of the native communication library the fused route loaded, if any: the one the helper's
    transport names, ``fastvideo_kernel.library_path()`` when the loader was imported, else a mapped shared object
    whose name mentions fastvideo or ulysses."""
    candidates = product.library_candidates(helper) if helper is not None else []
    kernel = sys.modules.get("fastvideo_kernel")  # only if something imported it already
    if kernel is not None and hasattr(kernel, "library_path"):
        try:
            candidates.append(str(kernel.library_path()))
        except Exception:  # noqa: BLE001 - a loader without a library: nothing to name
            pass
    candidates += mapped_libraries("fastvideo", "ulysses")
    for path in candidates:
        if os.path.isfile(path):
            return {"path": os.path.realpath(path), "sha256": sha256_file(path)}
    return None


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'host'})"


def build_header(device: torch.device, sp_size: int, helper=None, extra: dict | None = None,
                 case: str | None = None) -> dict:
    """The header of one run (local; call it on every rank, print and write it on rank 0)."""
    tree = fastvideo_tree()
    commit, commit_note = describe_commit(tree)
    command, source = command_line()
    header = {
        "schema": SCHEMA,
        "case": case,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name(device),
        "gpus_visible": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "device": str(device),
        "sp_size": sp_size,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl_version(),
        "commit": commit,
        "commit_note": commit_note,  # None unless a COMMIT stamp and the checkout's HEAD disagree
        "fastvideo_tree": str(tree),
        "bench_commit": tree_commit(BENCH_ROOT) if tree != BENCH_ROOT else None,  # the benchmark code's own
        "command": command,
        "command_source": source,
        "argv": list(sys.argv),
        "host": platform.node(),
        "python": platform.python_version(),
        "native_library": native_library(helper),
        "lineup": lineup.describe(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTVIDEO_") and k != COMMAND_ENV},
        "complete": False,
    }
    header.update(extra or {})
    return header


_FIRST_LINES = {"schema", "case", "date", "host", "gpu", "gpus_visible", "sp_size", "torch", "cuda", "nccl",
                "commit", "commit_note", "fastvideo_tree", "bench_commit", "native_library", "command",
                "command_source", "argv", "device", "python", "env", "complete", "lineup"}


def print_header(header: dict) -> None:
    lib = header.get("native_library")
    lib_text = f"{lib['path']} sha256={lib['sha256']}" if lib else "none loaded"
    print(f"# {header.get('case')}  date {header['date']}  host {header['host']}  gpu {header['gpu']}  "
          f"SP{header['sp_size']}")
    print(f"# torch {header['torch']}  cuda {header.get('cuda')}  nccl {header['nccl']}  commit {header['commit']}  "
          f"tree {header['fastvideo_tree']}" + (f"  (benchmark code {header['bench_commit']})"
                                                 if header.get("bench_commit") else ""))
    if header.get("commit_note"):  # the record names a commit other than a COMMIT stamp or HEAD claims: said twice
        print(f"# commit note: {header['commit_note']}")
        print(f"warning: commit {header['commit']}: {header['commit_note']}", file=sys.stderr)
    print(f"# native library: {lib_text}")
    print(f"# command: {header['command']}" + ("" if header.get("command_source") == "exact"
                                               else f"  ({header.get('command_source')})"))
    for key, value in header.items():
        if key not in _FIRST_LINES:
            print(f"# {key}: {value}")
    if header.get("env"):
        print("# env: " + " ".join(f"{k}={v}" for k, v in header["env"].items()))
    sys.stdout.flush()
