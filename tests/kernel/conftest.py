"""Shared fixtures of the kernel tests: the built libraries (CPU) and the test library on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernel import built


@pytest.fixture(scope="module")
def product_lib():
    """The built product library (``tests/kernel/built.py``; skips, or fails under CI, without it)."""
    return built.product_library()


@pytest.fixture(scope="module")
def testing_lib():
    """The built test library (``tests/kernel/built.py``; skips, or fails under CI, without it)."""
    return built.testing_library()


@pytest.fixture(scope="module")
def gpu_lib():
    """The test library on a CUDA machine (``fastvideo_kernel.testing.load``: ``$FASTVIDEO_KERNEL_TESTING_LIBRARY``,
    or the one beside the product library), or skip saying why it cannot be used here."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        return built.kernel_testing.load()
    except built.fastvideo_kernel.KernelUnavailable as exc:
        pytest.skip(f"test library unavailable: {exc}")
