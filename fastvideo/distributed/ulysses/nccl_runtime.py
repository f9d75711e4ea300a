"""Which NCCL a process runs, for the native transport's capability check: pure functions, no import-time effect.

The kernel's device API is header-inline, so a library built against one NCCL minor release cannot serve a process
that runs another, and two ``libnccl.so`` files mapped at once mean two communicator implementations.
"""

from __future__ import annotations

import os

__all__ = ["nccl_libraries_mapped", "nccl_mismatch"]


def nccl_libraries_mapped(maps_text: str) -> set[str]:
    """Distinct ``libnccl.so*`` files mapped in a ``/proc/<pid>/maps`` text (by resolved path)."""
    paths = set()
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libnccl.so"):
            paths.add(os.path.realpath(path))
    return paths


def nccl_mismatch(build: int, runtime: int) -> str | None:
    """Why a runtime NCCL cannot serve a build (the device API is header-inline), or None."""
    from fastvideo_kernel import nccl_version_tuple

    b, r = nccl_version_tuple(build), nccl_version_tuple(runtime)
    if b[:2] != r[:2]:
        return f"kernel built against NCCL {'.'.join(map(str, b))}, process runs NCCL {'.'.join(map(str, r))}"
    return None
