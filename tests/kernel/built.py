"""The kernel libraries the test command builds (``scripts/build_kernel.sh 2.28.9 build/kernel``), for the CPU
tests that load them: the product library and the test library beside it.

``FASTVIDEO_KERNEL_TEST_BUILD`` names another product build (its test library is the file beside it). A test
that needs a library skips, saying why, when it is absent or cannot be loaded on this machine; under
``CI=true`` (where the test command has built them) it fails instead.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

from tests.ci import ci

REPO = Path(__file__).resolve().parents[2]
try:
    import fastvideo_kernel
except ImportError:  # the loader is pure Python: use it from the source tree
    sys.path.insert(0, str(REPO / "fastvideo-kernel"))
    import fastvideo_kernel
from fastvideo_kernel import testing as kernel_testing  # noqa: E402

BUILT = Path(os.environ.get("FASTVIDEO_KERNEL_TEST_BUILD") or REPO / "build" / "kernel" / fastvideo_kernel.LIBRARY_NAME)
BUILT_TESTING = BUILT.with_name(kernel_testing.TESTING_LIBRARY_NAME)
BUILD_HINT = "run scripts/build_kernel.sh 2.28.9"


def unavailable(why: str) -> NoReturn:
    """Skip with ``why``, or fail under CI (the test command builds the libraries there)."""
    if ci():
        pytest.fail(f"CI must build the kernel libraries first: {why}")
    pytest.skip(why)


def _open(path: Path, loader: Callable[[], ctypes.CDLL]) -> ctypes.CDLL:
    if not path.is_file():
        unavailable(f"no built library at {path} ({BUILD_HINT})")
    with pytest.MonkeyPatch.context() as env:  # the loader reads these; restored on return
        env.setenv(fastvideo_kernel.ENV_LIBRARY, str(BUILT))
        env.setenv(kernel_testing.ENV_TESTING_LIBRARY, str(BUILT_TESTING))
        try:
            return loader()
        except fastvideo_kernel.KernelUnavailable as exc:
            why = f"the built library cannot be loaded here (e.g. its libnccl.so.2 is absent): {exc}"
    unavailable(why)


def product_library() -> ctypes.CDLL:
    """The built product library, opened by ``fastvideo_kernel.load`` (or skip / fail)."""
    return _open(BUILT, fastvideo_kernel.load)


def testing_library() -> ctypes.CDLL:
    """The built test library, opened by ``fastvideo_kernel.testing.load`` (or skip / fail)."""
    return _open(BUILT_TESTING, kernel_testing.load)
